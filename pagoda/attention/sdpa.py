"""Paged attention through torch's SDPA: the pieces the torch and cpu backends share. Both write
the step's keys and values with `store_kv` and attend prefill chunks (every request after the
decodes) with `attend_prefills`, one request at a time; they differ only in how decodes attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionInputs


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor  # long [ceil(seq_len / block_size)]
    # additive [query_len, seq_len] in the activation dtype, 0 or -inf; None without earlier context.
    # Built once per step for every layer: a bool mask is converted by SDPA in each layer's call.
    causal_mask: torch.Tensor | None


def prefill_chunks(inputs: AttentionInputs) -> tuple[PrefillChunk, ...]:
    """One chunk per request after the decodes."""
    bs, device = inputs.block_size, inputs.block_tables.device
    starts = inputs.query_start_loc.tolist()
    chunks = []
    for i in range(inputs.num_decodes, inputs.num_reqs):
        q_len, seq_len = inputs.query_lens_cpu[i], inputs.seq_lens_cpu[i]
        mask = None
        if seq_len > q_len:  # earlier context in the cache: the causal mask is aligned bottom-right
            rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
            future = torch.arange(seq_len, device=device)[None, :] > rows
            mask = torch.zeros(future.shape, dtype=inputs.dtype, device=device).masked_fill_(future, float("-inf"))
        block_ids = inputs.block_tables[i, : -(-seq_len // bs)].long()
        chunks.append(PrefillChunk(starts[i], starts[i + 1], seq_len, block_ids, mask))
    return tuple(chunks)


def decode_block_tables(inputs: AttentionInputs) -> torch.Tensor:
    """The decodes' rows of the block tables, cut to the blocks of the longest one (a view)."""
    nd = inputs.num_decodes
    return inputs.block_tables[:nd, : -(-max(inputs.seq_lens_cpu[:nd]) // inputs.block_size)]


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def attend_prefills(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: tuple[PrefillChunk, ...],
    scale: float,
) -> None:
    """Writes each chunk's rows of `out`; the chunk's own keys and values are already stored."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    for chunk in chunks:
        q = query[chunk.query_start : chunk.query_end]
        if chunk.causal_mask is None:
            k = key[chunk.query_start : chunk.query_end]
            v = value[chunk.query_start : chunk.query_end]
        else:
            k = k_cache.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.seq_len]
            v = v_cache.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.seq_len]
        out[chunk.query_start : chunk.query_end] = _attend(q, k, v, chunk.causal_mask, scale)


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
