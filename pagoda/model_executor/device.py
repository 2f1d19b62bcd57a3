"""Whether an explicitly requested device can serve here, checked before anything is loaded, so
that `--device cuda` on a machine without a usable GPU (or without Triton, which the GPU path's
attention kernels need) fails at once with what is missing rather than deep inside the load."""

from __future__ import annotations

import importlib

import torch

from pagoda.errors import ConfigError


def cuda_unavailable_reason() -> str | None:
    """What this process lacks to run on CUDA, or None when it has a GPU and Triton."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch sees no usable CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it)"
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return f"the GPU extras are not installed: the triton package cannot be imported ({exc})"
    return None


def check_device(device: str) -> None:
    """Raises ConfigError naming what is missing when `device` ("auto", "cpu", "cuda", ...) is
    "cuda" and cannot serve; "auto" falls back to the CPU by itself."""
    if device.partition(":")[0] != "cuda":
        return
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--device {device} cannot be used: {reason}.")
