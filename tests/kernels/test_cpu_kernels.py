"""Building Pagoda's C kernels, and the single-row GEMV against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.attention.selector import unsupported_reason
from pagoda.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")


@pytest.mark.parametrize("n_out,k", [(4, 8), (7, 16), (160, 96), (1000, 584), (3072, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(n_out, k, bias):
    """Row counts that are and are not multiples of the 4-row block; k with and without a
    16-column tail."""
    gen = torch.Generator().manual_seed(n_out * k)
    weight, x = torch.randn(n_out, k, generator=gen), torch.randn(1, k, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    out = cpu_kernels.gemv(cpu_kernels.load(), x, weight, b)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_kernels_build_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    cpu_kernels._load.cache_clear()
    try:
        assert cpu_kernels.load() is not None
        built = list((tmp_path / "kernels").glob("cpu-*.so"))
        assert len(built) == 1 and built[0].name.startswith(f"cpu-{cpu_kernels.cpu_isa()[-1]}-")
        stamp = built[0].stat().st_mtime_ns
        cpu_kernels._load.cache_clear()
        assert cpu_kernels.load() is not None and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    finally:
        cpu_kernels._load.cache_clear()


@pytest.mark.parametrize(
    "compiler, reason", [("/nonexistent/cc", "need a C compiler"), ("/bin/false", "building Pagoda's C kernels failed")]
)
def test_no_kernels_say_why(tmp_path, monkeypatch, compiler, reason):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    cpu_kernels._load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert reason in unsupported_reason("cpu", torch.device("cpu"), torch.float32, 64)
    finally:
        cpu_kernels._load.cache_clear()
