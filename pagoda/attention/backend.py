"""The attention backend interface and the KV layout contract every backend shares.

KV layout (per layer): one tensor of shape (2, num_blocks, block_size, num_kv_heads, head_dim);
index 0 holds keys, 1 values. Token t of a request lives in block `block_table[t // block_size]`
at offset `t % block_size`, i.e. slot `block * block_size + offset`. Block 0 is never handed to
a request: padded lanes (CUDA graphs) may point at it and write garbage there.

A batch packs the query tokens of all its requests back to back. Requests with exactly one query
token (decodes) come first; `num_decodes` says how many.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """What every backend gets from the model runner for one step."""

    query_start_loc: torch.Tensor  # int32 [B + 1]: request i owns query tokens [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # int32 [B]: tokens in the KV cache after this step, this step's included
    block_tables: torch.Tensor  # int32 [B, max_blocks]: padded with 0
    slot_mapping: torch.Tensor  # int64 [T]: where each query token's key/value is written; -1 = skip
    num_decodes: int
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    dtype: torch.dtype = torch.float32  # the model's activation dtype

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend(ABC):
    """Writes a step's keys and values into the paged cache and attends over it."""

    name: str

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> object:
        """Per-step metadata, built once and shared by all layers."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: object,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store key/value at the step's slots, then causal attention over each request's cache."""


def get_backend(name: str) -> AttentionBackend:
    if name == "cpu":
        from pagoda.attention.cpu_backend import CpuAttentionBackend
        from pagoda.kernels import cpu as cpu_kernels

        lib = cpu_kernels.load()
        if lib is None:
            raise ValueError("the cpu attention backend needs its C kernels, which cannot be built here (see the log)")
        return CpuAttentionBackend(lib)
    if name == "torch":
        from pagoda.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from pagoda.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'cpu', 'torch' or 'triton'")
