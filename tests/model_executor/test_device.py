"""--device cuda is refused before anything loads, naming what is missing: a CUDA build of torch,
a visible GPU, the triton package (simulated here on whatever machine runs the tests)."""

from __future__ import annotations

import sys

import pytest
import torch

from pagoda.errors import ConfigError
from pagoda.model_executor.device import check_device


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")


def test_torch_without_cuda_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"^--device cuda cannot be used: this torch \(.*\) is built without CUDA\.$"):
        check_device("cuda")


def test_no_visible_gpu_is_named(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--device cuda:1 cannot be used: torch sees no usable CUDA device"):
        check_device("cuda:1")


def test_missing_triton_is_named(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(ConfigError, match="the GPU extras are not installed: the triton package cannot be imported"):
        check_device("cuda")


def test_cpu_and_auto_are_not_checked(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    check_device("cpu")
    check_device("auto")


def test_a_usable_gpu_passes(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or type(sys)("triton"))
    check_device("cuda")
