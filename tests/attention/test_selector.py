"""The selector: each backend's declared support, "auto" by the device's order of preference, and
a clear reason when a named backend cannot serve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda.attention.cpu_backend import CpuAttentionBackend
from pagoda.attention.selector import create_backend, select_backend, unsupported_reason
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.attention.triton_backend import TritonAttentionBackend
from pagoda.engine.args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")


@needs_kernels
def test_auto_on_cpu_prefers_the_cpu_backend_where_it_serves():
    assert select_backend("auto", CPU, torch.float32, 64) is CpuAttentionBackend
    assert select_backend("auto", CPU, torch.bfloat16, 64) is CpuAttentionBackend
    assert select_backend("auto", CPU, torch.float16, 64) is TorchAttentionBackend
    assert select_backend("auto", CPU, torch.float32, 20) is TorchAttentionBackend


def test_auto_on_cuda_is_triton():
    assert select_backend("auto", CUDA, torch.bfloat16, 128) is TritonAttentionBackend


@pytest.mark.parametrize(
    "name,device,dtype,head_dim,message",
    [
        ("cpu", CPU, torch.float16, 64, "needs float32 or bfloat16 (got float16)"),
        ("cpu", CPU, torch.float32, 20, "divisible by 8 (got 20)"),
        ("cpu", CUDA, torch.float32, 64, "runs on cpu only, not on cuda"),
        ("flash", CPU, torch.float32, 64, "Unknown attention backend 'flash'"),
    ],
)
def test_a_named_backend_that_cannot_serve_says_why(name, device, dtype, head_dim, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        select_backend(name, device, dtype, head_dim)


def test_auto_on_another_device_says_why():
    with pytest.raises(ConfigError, match="No attention backend serves .* not on mps"):
        select_backend("auto", torch.device("mps"), torch.float32, 64)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    assert unsupported_reason("triton", CPU, torch.float32, 64) is None  # tests/attention runs interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "interpreter" in unsupported_reason("triton", CPU, torch.float32, 64)
    assert unsupported_reason("triton", CUDA, torch.float32, 64) is None


@needs_kernels
def test_cpu_backend_needs_its_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "Pagoda's C kernels need a CPU with AVX2 and FMA")
    assert "C kernels need a CPU with AVX2" in unsupported_reason("cpu", CPU, torch.float32, 64)
    assert select_backend("auto", CPU, torch.float32, 64) is TorchAttentionBackend


def test_only_triton_declares_cuda_graphs():
    assert TritonAttentionBackend.support.cuda_graphs
    assert not TorchAttentionBackend.support.cuda_graphs and not CpuAttentionBackend.support.cuda_graphs


def test_create_backend():
    assert isinstance(create_backend("torch"), TorchAttentionBackend)
    assert isinstance(create_backend("triton"), TritonAttentionBackend)


@needs_kernels
def test_engine_config_records_the_choice():
    """The default model on CPU: cpu in float32 and bfloat16, torch in float16, and cpu refused there."""
    config = EngineArgs().create_config()
    assert config.attention_backend == "cpu" and not config.attention_cuda_graphs
    assert EngineArgs(dtype="bfloat16").create_config().attention_backend == "cpu"
    assert EngineArgs(dtype="float16").create_config().attention_backend == "torch"
    with pytest.raises(ConfigError, match="needs float32 or bfloat16"):
        EngineArgs(dtype="float16", attention_backend="cpu").create_config()


def test_the_interface_imports_no_backend_and_auto_on_cpu_no_triton():
    script = """
import sys, torch
import pagoda.attention.backend
assert not [m for m in sys.modules if m.startswith("pagoda.attention.") and m.endswith("_backend")]
from pagoda.attention.selector import select_backend
select_backend("auto", torch.device("cpu"), torch.float32, 64)
assert "triton" not in sys.modules
print("ok")
"""
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
