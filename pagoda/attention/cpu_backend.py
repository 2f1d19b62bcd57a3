"""The CPU serving path: decodes read their keys and values in place from the paged cache through
a compiled C kernel (no gather copy); prefill chunks run through torch's SDPA as in the torch
backend (sdpa.py). In bfloat16 the KV cache is bfloat16 and the decode kernel computes in float32
(csrc/bf16.c); every build of the kernels has it.

Batch-invariant (deterministic serving, float32): prefill chunks go through a C kernel that
computes each query row with the decode kernel's arithmetic, reading the paged cache in place, so
a token's attention output is bitwise the same in a chunk of any size, after any cached prefix, or
as a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionBackend, AttentionInputs, BackendSupport
from pagoda.attention.sdpa import PrefillChunk, attend_prefills, decode_block_tables, prefill_chunks
from pagoda.attention.sdpa import store_kv as sdpa_store_kv
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class PagedDecodes:
    block_tables: torch.Tensor  # int32 [num_decodes, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [num_decodes]


@dataclass(frozen=True)
class PagedPrefills:
    """The prefill chunks (the requests after the decodes) as the batch-invariant kernel reads them."""

    block_tables: torch.Tensor  # int32 [num_prefills, max_blocks], contiguous
    query_start: torch.Tensor  # int32 [num_prefills + 1]: request i's rows of the batch
    seq_lens: torch.Tensor  # int32 [num_prefills]


@dataclass(frozen=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decodes: PagedDecodes | None  # None without decodes
    prefills: tuple[PrefillChunk, ...]  # for SDPA; empty when batch-invariant
    paged_prefills: PagedPrefills | None  # batch-invariant with prefills only


_NO_KERNELS = "its C kernels cannot be built here (they need gcc and an x86-64 CPU with AVX2 and FMA)"


class CpuAttentionBackend(AttentionBackend[CpuAttentionMetadata]):
    name = "cpu"
    support = BackendSupport(  # the C kernels'
        devices=("cpu",), dtypes=(torch.float32, torch.bfloat16), head_dim_multiple=8, batch_invariant=True
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return _NO_KERNELS if cpu_kernels.load() is None else None

    def __init__(self, batch_invariant: bool = False) -> None:
        lib = cpu_kernels.load()
        if lib is None:
            raise ConfigError(f"The cpu attention backend is unavailable: {_NO_KERNELS}.")
        self.lib, self.batch_invariant = lib, batch_invariant

    def build_metadata(self, inputs: AttentionInputs) -> CpuAttentionMetadata:
        nd = inputs.num_decodes
        decodes = None
        if nd:
            decodes = PagedDecodes(decode_block_tables(inputs).contiguous(), inputs.seq_lens[:nd].contiguous())
        if not self.batch_invariant:
            return CpuAttentionMetadata(inputs.slot_mapping, nd, decodes, prefill_chunks(inputs), None)
        paged = None
        if nd < inputs.num_reqs:
            paged = PagedPrefills(
                inputs.block_tables[nd:].contiguous(), inputs.query_start_loc[nd:], inputs.seq_lens[nd:]
            )
        return CpuAttentionMetadata(inputs.slot_mapping, nd, decodes, (), paged)

    def forward(self, query, key, value, kv_cache, metadata: CpuAttentionMetadata, scale: float):
        if query.dtype == torch.bfloat16:
            return self._forward_bf16(query, key, value, kv_cache, metadata, scale)
        out = torch.empty(query.shape, dtype=query.dtype)
        nd, decodes, slots = metadata.num_decodes, metadata.decodes, metadata.slot_mapping
        if nd < query.shape[0]:
            cpu_kernels.store_kv(self.lib, key[nd:], value[nd:], kv_cache, slots[nd:])
        if decodes is not None:  # the decodes' keys and values are stored by the kernel itself
            cpu_kernels.paged_decode_attention(
                self.lib,
                out[:nd],
                query[:nd],
                key[:nd],
                value[:nd],
                kv_cache,
                slots[:nd],
                decodes.block_tables,
                decodes.seq_lens,
                scale,
            )
        if metadata.paged_prefills is not None:
            p = metadata.paged_prefills
            cpu_kernels.prefill_attention(
                self.lib, out, query, kv_cache, p.block_tables, p.query_start, p.seq_lens, scale
            )
        attend_prefills(out, query, key, value, kv_cache, metadata.prefills, scale)
        return out

    def _forward_bf16(self, query, key, value, kv_cache, metadata: CpuAttentionMetadata, scale: float):
        """bfloat16: keys and values stored by torch, decodes through the bf16 kernel."""
        sdpa_store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        nd, decodes = metadata.num_decodes, metadata.decodes
        if decodes is not None:
            out[:nd] = cpu_kernels.paged_decode_attention_bf16(
                self.lib, query[:nd], kv_cache[0], kv_cache[1], decodes.block_tables, decodes.seq_lens, scale
            )
        attend_prefills(out, query, key, value, kv_cache, metadata.prefills, scale)
        return out
