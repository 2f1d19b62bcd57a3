"""The attention backend interface and the KV layout contract every backend shares.

KV layout (per layer): one tensor of shape (2, num_blocks, block_size, num_kv_heads, head_dim);
index 0 holds keys, 1 values. Token t of a request lives in block `block_table[t // block_size]`
at offset `t % block_size`, i.e. slot `block * block_size + offset`. Block 0 is never handed to
a request: padded lanes (CUDA graphs) may point at it and write garbage there.

A batch packs the query tokens of all its requests back to back. Requests with exactly one query
token (decodes) come first; `num_decodes` says how many. The model runner lays its batches out so.

Each backend declares what it can serve (`BackendSupport`); `selector.py` picks and creates one.
This module imports no concrete backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

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


@dataclass(frozen=True)
class BackendSupport:
    """What a backend can serve: the selector checks a model against it before creating one."""

    devices: tuple[str, ...]  # torch device types
    dtypes: tuple[torch.dtype, ...]  # the model's activation dtype, which is also the KV cache's
    head_dim_multiple: int = 1  # head_dim must be divisible by it
    cuda_graphs: bool = False  # build_metadata reads only host values and forward never syncs: capturable
    # created with batch_invariant=True, each query row's output is bitwise the same whatever other rows
    # share the call, how its request's prompt was chunked and how much of it was already cached
    batch_invariant: bool = False


M = TypeVar("M")  # a backend's per-step metadata


class AttentionBackend(ABC, Generic[M]):
    """Writes a step's keys and values into the paged cache and attends over it."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why the backend cannot run on `device` in this installation (beyond `support`), or None."""
        return None

    def first_use_shapes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_model_len: int
    ) -> tuple[tuple[int, int], ...]:
        """Steps of one request each, as (query tokens, tokens in all), that between them run every
        kernel variant this backend builds on first use, for a model of these shapes: the engine
        runs them at startup so that no request waits for a compile. None by default."""
        return ()

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> M:
        """Per-step metadata, built once and shared by all layers."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: M,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store key/value at the step's slots, then causal attention over each request's cache."""
