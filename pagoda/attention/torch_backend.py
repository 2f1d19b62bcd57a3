"""Reference attention in plain torch: the correctness reference, and the CPU path where the C
kernels of the `cpu` backend cannot be built.

Decodes are attended in one batched call per layer over block-gathered keys and values;
prefill chunks, which are few per step, one request at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionInputs


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor  # long [ceil(seq_len / block_size)]
    causal_mask: torch.Tensor | None  # bool [query_len, seq_len]; None when there is no earlier context


@dataclass(frozen=True)
class DecodeBatch:
    block_tables: torch.Tensor  # long [num_decodes, max_blocks]
    mask: torch.Tensor  # additive [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decodes: object  # what the backend's `decode_attention` reads; None without decodes
    prefills: tuple[PrefillChunk, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        nd, bs, device = inputs.num_decodes, inputs.block_size, inputs.block_tables.device
        decodes = self.decode_metadata(inputs) if nd else None
        prefills = []
        starts = inputs.query_start_loc.tolist()
        for i in range(nd, inputs.num_reqs):
            q_len, seq_len = inputs.query_lens_cpu[i], inputs.seq_lens_cpu[i]
            mask = None
            if seq_len > q_len:  # earlier context in the cache: the causal mask is aligned bottom-right
                rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
                mask = torch.arange(seq_len, device=device)[None, :] <= rows
            block_ids = inputs.block_tables[i, : -(-seq_len // bs)].long()
            prefills.append(PrefillChunk(starts[i], starts[i + 1], seq_len, block_ids, mask))
        return TorchAttentionMetadata(inputs.slot_mapping, nd, decodes, tuple(prefills))

    def decode_metadata(self, inputs: AttentionInputs) -> DecodeBatch:
        tables = decode_block_tables(inputs)
        nd, device = inputs.num_decodes, tables.device
        positions = torch.arange(tables.shape[1] * inputs.block_size, device=device)
        beyond = positions[None, :] >= inputs.seq_lens[:nd, None]
        mask = torch.zeros(beyond.shape, dtype=inputs.dtype, device=device).masked_fill_(beyond, float("-inf"))
        return DecodeBatch(tables.long().contiguous(), mask.view(nd, 1, 1, -1))

    def decode_attention(self, q, k_cache, v_cache, decodes: DecodeBatch, scale: float) -> torch.Tensor:
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

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale: float):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)
        out = torch.empty_like(query)
        nd = metadata.num_decode_tokens
        if nd:
            out[:nd] = self.decode_attention(query[:nd], k_cache, v_cache, metadata.decodes, scale)
        for chunk in metadata.prefills:
            q = query[chunk.query_start : chunk.query_end]
            if chunk.causal_mask is None:
                k = key[chunk.query_start : chunk.query_end]
                v = value[chunk.query_start : chunk.query_end]
            else:
                k = k_cache.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.seq_len]
                v = v_cache.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.seq_len]
            out[chunk.query_start : chunk.query_end] = _attend(q, k, v, chunk.causal_mask, scale)
        return out


def decode_block_tables(inputs: AttentionInputs) -> torch.Tensor:
    """The decodes' rows of the block tables, cut to the blocks of the longest one (a view)."""
    nd = inputs.num_decodes
    return inputs.block_tables[:nd, : -(-max(inputs.seq_lens_cpu[:nd]) // inputs.block_size)]


def _attend(q, k, v, mask, scale):
    """One request: q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H, D]. Batched 4-D inputs: with 3-D ones
    torch's CPU SDPA takes its math path, 4-6x slower than its flash kernel at 1,024 tokens."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)
