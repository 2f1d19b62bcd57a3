"""The CPU serving path: decodes read their keys and values in place from the paged cache through
a compiled C kernel (no gather copy); prefill chunks run as in the torch backend.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionInputs
from pagoda.attention.torch_backend import TorchAttentionBackend, decode_block_tables
from pagoda.kernels import cpu as cpu_kernels


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the cpu backend cannot serve this model here, or None when it can."""
    if device.type != "cpu":
        return f"the cpu attention backend runs on the CPU only, not on {device.type}"
    if dtype != torch.float32 or head_dim % 8:
        return f"the cpu attention backend needs float32 and a head_dim divisible by 8 (got {dtype}, {head_dim})"
    if cpu_kernels.load() is None:
        return (
            "the cpu attention backend's C kernels cannot be built here "
            "(they need gcc and an x86-64 CPU with AVX2 and FMA)"
        )
    return None


@dataclass(frozen=True)
class PagedDecodes:
    block_tables: torch.Tensor  # int32 [num_decodes, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [num_decodes]


class CpuAttentionBackend(TorchAttentionBackend):
    """Needs float32 caches and head_dim % 8 == 0 (see unsupported_reason)."""

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def decode_metadata(self, inputs: AttentionInputs) -> PagedDecodes:
        return PagedDecodes(
            decode_block_tables(inputs).contiguous(), inputs.seq_lens[: inputs.num_decodes].contiguous()
        )

    def decode_attention(self, q, k_cache, v_cache, decodes: PagedDecodes, scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode_attention(
            self.lib, q, k_cache, v_cache, decodes.block_tables, decodes.seq_lens, scale
        )
