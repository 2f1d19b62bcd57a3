"""Choosing an attention backend: the one named, or for "auto" the first in the device's order of
preference that can serve the model, checked against what each backend declares
(`AttentionBackend.support`, `unavailable_reason`).

Backends are imported only when asked about, so an installation without Triton (or a test that
must set TRITON_INTERPRET before Triton is first imported) never imports it for a CPU model.
"""

from __future__ import annotations

import importlib
import logging

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = {  # name -> (module, class)
    "cpu": ("pagoda.attention.cpu_backend", "CpuAttentionBackend"),
    "torch": ("pagoda.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("pagoda.attention.triton_backend", "TritonAttentionBackend"),
}
AUTO_ORDER = {"cuda": ("triton", "torch"), "cpu": ("cpu", "torch")}  # other device types: torch, which says why not


def select_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> type[AttentionBackend]:
    """The backend class that serves this model: `name`, or for "auto" the preferred one that can.
    Raises ConfigError saying why when none can."""
    candidates = AUTO_ORDER.get(device.type, ("torch",)) if name == "auto" else (name,)
    reasons = []
    for candidate in candidates:
        reason = unsupported_reason(candidate, device, dtype, head_dim)
        if reason is None:
            return backend_class(candidate)
        logger.info("Attention backend %r passed over: %s", candidate, reason)
        reasons.append(reason)
    if name != "auto":
        raise ConfigError(_sentence(reasons[0]))
    raise ConfigError(_sentence(f"no attention backend serves a {dtype} model on {device.type}: {'; '.join(reasons)}"))


def unsupported_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why backend `name` cannot serve this model here, or None when it can."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)}"
    try:
        cls = backend_class(name)
    except ImportError as e:
        return f"the {name} attention backend cannot be imported here ({e})"
    support = cls.support
    if device.type not in support.devices:
        return f"the {name} attention backend runs on {' and '.join(support.devices)} only, not on {device.type}"
    if dtype not in support.dtypes:
        names = " or ".join(_dtype_name(d) for d in support.dtypes)
        return f"the {name} attention backend needs {names} (got {_dtype_name(dtype)})"
    if head_dim % support.head_dim_multiple:
        return (
            f"the {name} attention backend needs a head_dim divisible by {support.head_dim_multiple} (got {head_dim})"
        )
    reason = cls.unavailable_reason(device)
    return None if reason is None else f"the {name} attention backend is unavailable: {reason}"


def backend_class(name: str) -> type[AttentionBackend]:
    """Imports the backend's module; raises KeyError for an unknown name, ImportError without its packages."""
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, batch_invariant: bool = False) -> AttentionBackend:
    """An instance of a backend that select_backend chose (EngineConfig.attention_backend);
    `batch_invariant` (EngineConfig.deterministic) for one whose support declares it."""
    cls = backend_class(name)
    return cls(batch_invariant=True) if batch_invariant else cls()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sentence(reason: str) -> str:
    return reason[0].upper() + reason[1:] + "."
