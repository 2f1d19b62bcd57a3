"""The kernel builds the kernel tests share: this CPU's ("native") and one capped at AVX2
(PAGODA_CPU_ISA=avx2), each built and loaded once per session; `cpu.load()`'s cache is left
cleared, so the rest of the suite loads the native build as usual."""

from __future__ import annotations

import ctypes

import pytest

from pagoda.kernels import cpu as cpu_kernels

ISAS = ("native", "avx2")


def build(isa: str) -> ctypes.CDLL:
    """The kernels for `isa` ("native" or "avx2"), loaded fresh."""
    with pytest.MonkeyPatch.context() as patch:
        if isa == "avx2":
            patch.setenv("PAGODA_CPU_ISA", "avx2")
        cpu_kernels._load.cache_clear()
        lib = cpu_kernels.load()
    cpu_kernels._load.cache_clear()
    assert lib is not None and (isa == "native" or lib.isa[-1] == "avx2")
    return lib


@pytest.fixture(scope="session")
def libs() -> dict[str, ctypes.CDLL]:
    return {isa: build(isa) for isa in ISAS}


@pytest.fixture(params=ISAS)
def lib(request, libs) -> ctypes.CDLL:
    return libs[request.param]
