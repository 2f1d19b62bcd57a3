"""Triton kernels for the paged KV cache, and the thin launchers the Triton backend calls.

The cache layout is backend.py's: (2, num_blocks, block_size, num_kv_heads, head_dim).

Attention programs work per KV head. A program's BLOCK_M rows are (query token, query head)
pairs of one KV head's group, row r = token r // GROUP of the tile, head kv_head * GROUP + r % GROUP,
so every key and value tile read from the cache serves all the query heads that share it (GQA),
and a decode, with GROUP rows of real work, still feeds the matrix units a 16-row tile.

Keys are read through the block table one position at a time (a gather), so any block size works
and a key tile may span several blocks. Softmax is online, in fp32 and base 2.

Launch grids depend only on host integers (token and request counts, maximum lengths), never on
device values, so a launch is capturable in a CUDA graph once its inputs live in static buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 256  # split-KV: fewest keys per slice worth a program
MAX_SPLITS = 32


@dataclass(frozen=True)
class TileConfig:
    """How one attention launch tiles its work."""

    block_m: int  # rows per program: query tokens x query heads of one KV group
    tile_n: int  # keys per inner-loop step
    one_tile_per_seq: bool  # every request's query tokens fit one program's rows
    num_warps: int = 4
    num_stages: int = 3

    def block_q(self, group: int) -> int:
        return self.block_m // group


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter (TRITON_INTERPRET=1: CPU tests, dry runs) turns a runtime loop bound
    into an int with int() of a shape-(1,) array, which NumPy >= 2.4 refuses (triton-lang/triton#9171,
    fixed after 3.6). Index through squeeze() instead, as the fix does."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if triton.knobs.runtime.interpret:
    _fix_interpreter_loop_bounds()


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


ONE_TILE_ROWS = 64  # the most query rows (tokens x heads of a KV group) of a request in one program


def choose_config(group: int, head_dim: int, dtype: torch.dtype, max_query_len: int) -> TileConfig:
    """Small tiles when every request fits one program (decodes, speculative verification),
    flash-attention tiles otherwise."""
    if max_query_len * group <= ONE_TILE_ROWS:
        return TileConfig(block_m=_pow2(max_query_len * group), tile_n=64, one_tile_per_seq=True)
    wide = head_dim > 128 or dtype.itemsize > 2  # keep K/V stages within Hopper's shared memory
    block_m = max(64 if wide else 128, _pow2(group))
    return TileConfig(block_m=block_m, tile_n=32 if wide else 64, one_tile_per_seq=False, num_warps=8)


def tile_configs(group: int, head_dim: int, dtype: torch.dtype, max_query_len: int) -> dict[TileConfig, int]:
    """Every config choose_config gives for query lengths up to max_query_len, each with the
    shortest length that gets it (past ONE_TILE_ROWS rows it gives one config whatever the length)."""
    first_of: dict[TileConfig, int] = {}
    for query_len in range(1, min(max_query_len, ONE_TILE_ROWS // group + 1) + 1):
        first_of.setdefault(choose_config(group, head_dim, dtype, query_len), query_len)
    return first_of


def choose_split_config(group: int, dtype: torch.dtype) -> TileConfig:
    return TileConfig(block_m=_pow2(group), tile_n=64 if dtype.itemsize > 2 else 128, one_tile_per_seq=True)


# ----------------------------------------------------------------------------------------------
# KV store


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # negative slots are padded tokens
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_PAD)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + h * stride_ch + d
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key, value for every slot >= 0."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    _check_cache(kv_cache)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


# ----------------------------------------------------------------------------------------------
# Attention: shared pieces


@triton.jit
def _find_tile(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Which request a tile belongs to, and its first query token within the request.

    Request i owns tiles [first(i), first(i + 1)) with first(i) = (qsl[i] - qsl[0]) // BLOCK_Q + i:
    at least ceil(q_len / BLOCK_Q) of them, so num_tokens // BLOCK_Q + num_seqs tiles cover every
    batch; a tile past its request's last token has nothing to do."""
    q0 = tl.load(qsl_ptr)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:  # the last i with first(i) <= tile
        mid = (lo + hi) // 2
        first = (tl.load(qsl_ptr + mid) - q0) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    first = (tl.load(qsl_ptr + seq) - q0) // BLOCK_Q + seq
    return seq, (tile - first) * BLOCK_Q


@triton.jit
def _load_queries(
    q_ptr,
    q_start,
    q_first,
    q_len,
    kv_head,
    stride_qt,
    stride_qh,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """The program's rows: query vectors [BLOCK_M, HEAD_PAD], token index within the request,
    token index in the batch, query head, and whether the row is real."""
    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP
    valid = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    head = kv_head * GROUP + rows % GROUP
    token = (q_start + tok).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    mask = valid[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None] + d[None, :], mask=mask, other=0.0)
    return q, tok, token, head, valid


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    last_key,
    key_start,
    key_end,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    scale_log2,
    stride_cb,
    stride_co,
    stride_ch,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over cache positions [key_start, key_end); row r sees positions <= last_key[r].
    m_i is the running maximum of scaled log2 scores, l_i the running sum of 2 ** (score - m_i)."""
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < head_dim
    for start in range(key_start, key_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        in_range = pos < key_end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        offs = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        kt = tl.load(k_cache_ptr + offs[None, :] + d[:, None], mask=in_range[None, :] & d_valid[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
        visible = in_range[None, :] & (pos[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=in_range[:, None] & d_valid[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# ----------------------------------------------------------------------------------------------
# Attention: one pass over each request's context


# Triton compiles a variant of a kernel for each specialization of its arguments: an integer equal
# to 1, divisible by 16 or neither, a pointer 16-byte aligned or not. Those that change from step to
# step are left unspecialized (how many requests, the block tables' width, how many slices; the
# request tensors, which a mixed step's prefills see as slices after its decodes), so that one
# variant per tile config serves every step: a variant first met while serving stalls that step by
# its compile (0.4-0.9 s on an H200 on a fresh machine). The model's shapes and strides, and the
# query, cache and output tensors, keep theirs (alignment lets loads vectorize).
INDEX_POINTERS = ["qsl_ptr", "seq_lens_ptr", "block_tables_ptr"]


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"], do_not_specialize_on_alignment=INDEX_POINTERS)
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (tiles, num_kv_heads): one tile of a request's query tokens against its whole context."""
    kv_head = tl.program_id(1)
    if ONE_TILE_PER_SEQ:
        seq = tl.program_id(0)
        q_first = 0
    else:
        seq, q_first = _find_tile(qsl_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_first >= q_len:
        return
    context = tl.load(seq_lens_ptr + seq) - q_len  # cached tokens before this step's first query token
    q, tok, token, head, valid = _load_queries(
        q_ptr, q_start, q_first, q_len, kv_head, stride_qt, stride_qh, head_dim, GROUP, BLOCK_M, BLOCK_Q, HEAD_PAD
    )
    last_key = tl.where(valid, context + tok, -1)  # causal, aligned bottom-right
    key_end = context + tl.minimum(q_first + BLOCK_Q, q_len)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        last_key,
        0,
        key_end,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        kv_head,
        scale_log2,
        stride_cb,
        stride_co,
        stride_ch,
        head_dim,
        BLOCK_SIZE,
        TILE_N,
        HEAD_PAD,
        DOT_PRECISION,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a lane with no keys (seq_len 0) writes zeros
    d = tl.arange(0, HEAD_PAD)
    mask = valid[:, None] & (d < head_dim)[None, :]
    dst = out_ptr + (token * stride_ot + head * stride_oh)[:, None] + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    num_tokens: int,
    max_query_len: int,
    config: TileConfig | None = None,
) -> None:
    """out[t] = attention of query[t] over its request's cached keys and values.

    Requests are query_start_loc's len - 1; their tokens, num_tokens in all, may start anywhere
    in query (query_start_loc holds batch positions)."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    query = _rows_contiguous(query)
    group = _group(query, kv_cache)
    config = config or choose_config(group, query.shape[2], query.dtype, max_query_len)
    block_q = config.block_q(group)
    if config.one_tile_per_seq:
        assert max_query_len <= block_q, "one_tile_per_seq needs every request within one tile"
        tiles = num_seqs
    else:
        tiles = num_tokens // block_q + num_seqs
    _paged_attention_kernel[(tiles, kv_cache.shape[3])](
        out_ptr=out,
        num_seqs=num_seqs,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        ONE_TILE_PER_SEQ=config.one_tile_per_seq,
        **_attention_args(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, config),
    )


# ----------------------------------------------------------------------------------------------
# Attention: split-KV (flash decoding) for few requests with long contexts


@triton.jit(do_not_specialize=["num_splits", "stride_bt"], do_not_specialize_on_alignment=INDEX_POINTERS)
def _paged_attention_split_kernel(
    tmp_out_ptr,
    tmp_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_splits,
    num_heads,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (requests, num_kv_heads, num_splits): one request's tokens against one slice of its
    context. Writes the slice's normalized output and log2-sum-exp to tmp_out [T, H, S, D] and
    tmp_lse [T, H, S]; an empty slice writes -inf."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    q, tok, token, head, valid = _load_queries(
        q_ptr, q_start, 0, q_len, kv_head, stride_qt, stride_qh, head_dim, GROUP, BLOCK_M, BLOCK_Q, HEAD_PAD
    )
    last_key = tl.where(valid, seq_len - q_len + tok, -1)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N  # whole tiles, sized per request
    key_start = split * per_split
    key_end = tl.minimum(key_start + per_split, seq_len)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        last_key,
        key_start,
        key_end,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        kv_head,
        scale_log2,
        stride_cb,
        stride_co,
        stride_ch,
        head_dim,
        BLOCK_SIZE,
        TILE_N,
        HEAD_PAD,
        DOT_PRECISION,
    )
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (token * num_heads + head) * num_splits + split
    d = tl.arange(0, HEAD_PAD)
    tl.store(tmp_out_ptr + row[:, None] * head_dim + d[None, :], out, mask=valid[:, None] & (d < head_dim)[None, :])
    tl.store(tmp_lse_ptr + row, lse, mask=valid)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    tmp_out_ptr,
    tmp_lse_ptr,
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Grid (tokens, num_heads): out = sum_s 2^lse_s * out_s / sum_s 2^lse_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    row = (token * num_heads + head) * num_splits + s
    lse = tl.load(tmp_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    d = tl.arange(0, HEAD_PAD)
    mask = (s < num_splits)[:, None] & (d < head_dim)[None, :]
    parts = tl.load(tmp_out_ptr + row[:, None] * head_dim + d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def paged_attention_split(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    num_tokens: int,
    num_splits: int,
    config: TileConfig | None = None,
) -> None:
    """paged_attention for requests of one query token whose tokens are the batch's first
    num_tokens, each context cut into num_splits slices attended in parallel, then merged."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits}: the merge takes 1 to {MAX_SPLITS} slices"
    query = _rows_contiguous(query)
    config = config or choose_split_config(_group(query, kv_cache), query.dtype)
    num_heads, head_dim = query.shape[1:]
    tmp_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    tmp_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_attention_split_kernel[(num_seqs, kv_cache.shape[3], num_splits)](
        tmp_out_ptr=tmp_out,
        tmp_lse_ptr=tmp_lse,
        num_splits=num_splits,
        num_heads=num_heads,
        **_attention_args(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, config),
    )
    _merge_splits_kernel[(num_tokens, num_heads)](
        out,
        tmp_out,
        tmp_lse,
        num_splits,
        num_heads,
        out.stride(0),
        out.stride(1),
        head_dim,
        SPLITS_PAD=MAX_SPLITS,  # one variant for any slice count: the padded lanes weigh nothing
        HEAD_PAD=_pow2(head_dim),
        num_warps=4 if head_dim >= 128 else 2,
    )


def _group(query: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """Query heads per KV head."""
    return query.shape[1] // kv_cache.shape[3]


def _attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    config: TileConfig,
) -> dict:
    """The arguments both attention kernels take, by name: the inputs, their strides and the tiling."""
    _check_cache(kv_cache)
    group, head_dim = _group(query, kv_cache), query.shape[2]
    return dict(
        q_ptr=query,
        k_cache_ptr=kv_cache[0],
        v_cache_ptr=kv_cache[1],
        qsl_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        block_tables_ptr=block_tables,
        scale_log2=scale * LOG2E,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_cb=kv_cache.stride(1),
        stride_co=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_bt=block_tables.stride(0),
        head_dim=head_dim,
        GROUP=group,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=config.block_m,
        BLOCK_Q=config.block_q(group),
        TILE_N=config.tile_n,
        HEAD_PAD=_pow2(head_dim),
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def choose_decode_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many slices to cut each decode's context into (1 = no split-KV).

    One program per (request, KV head) leaves most of the GPU idle when there are few requests;
    cutting long contexts into slices restores the parallelism at the price of a merge pass. Aim
    for about two waves of programs, slices of at least MIN_SPLIT_KEYS keys, and a power of two
    so that few kernel variants get compiled."""
    programs = num_decodes * num_kv_heads
    if programs >= num_sms:
        return 1
    want = min(math.ceil(2 * num_sms / programs), max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index tokens and heads by stride but assume contiguous head dimensions."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(kv_cache: torch.Tensor) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.stride(-1) == 1, "see backend.kv_cache_shape"
