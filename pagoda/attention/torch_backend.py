"""Reference attention in plain torch: the correctness reference, and the CPU path where the C
kernels of the `cpu` backend cannot be built.

Decodes are attended in one batched call per layer over block-gathered keys and values;
prefill chunks, which are few per step, one request at a time (sdpa.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionInputs, BackendSupport
from pagoda.attention.sdpa import PrefillChunk, attend_prefills, decode_block_tables, prefill_chunks, store_kv


@dataclass(frozen=True)
class DecodeBatch:
    block_tables: torch.Tensor  # long [num_decodes, max_blocks]
    mask: torch.Tensor  # additive [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decodes: DecodeBatch | None  # None without decodes
    prefills: tuple[PrefillChunk, ...]


class TorchAttentionBackend(AttentionBackend[TorchAttentionMetadata]):
    name = "torch"
    # no CUDA graphs: building the metadata reads query_start_loc back from the device
    support = BackendSupport(devices=("cpu", "cuda"), dtypes=(torch.float32, torch.bfloat16, torch.float16))

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        decodes = _decode_batch(inputs) if inputs.num_decodes else None
        return TorchAttentionMetadata(inputs.slot_mapping, inputs.num_decodes, decodes, prefill_chunks(inputs))

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale: float):
        store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if metadata.decodes is not None:
            out[:nd] = _decode_attention(query[:nd], kv_cache[0], kv_cache[1], metadata.decodes, scale)
        attend_prefills(out, query, key, value, kv_cache, metadata.prefills, scale)
        return out


def _decode_batch(inputs: AttentionInputs) -> DecodeBatch:
    tables = decode_block_tables(inputs)
    nd, device = inputs.num_decodes, tables.device
    positions = torch.arange(tables.shape[1] * inputs.block_size, device=device)
    beyond = positions[None, :] >= inputs.seq_lens[:nd, None]
    mask = torch.zeros(beyond.shape, dtype=inputs.dtype, device=device).masked_fill_(beyond, float("-inf"))
    return DecodeBatch(tables.long().contiguous(), mask.view(nd, 1, 1, -1))


def _decode_attention(q, k_cache, v_cache, decodes: DecodeBatch, scale: float) -> torch.Tensor:
    """Decodes batched: q [B, H, D] against each request's gathered blocks."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    gathered = (batch, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]; index_select beats fancy indexing here
    k = k_cache.index_select(0, decodes.block_tables.flatten()).view(gathered)
    v = v_cache.index_select(0, decodes.block_tables.flatten()).view(gathered)
    o = F.scaled_dot_product_attention(
        q.view(batch, num_heads, 1, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=decodes.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return o.view(batch, num_heads, head_dim)
