"""Deterministic serving's kernels: the batch-invariant GEMM gives every row the same bits whatever
rows share the call (and whatever the thread count or instruction set), and the prefill attention
kernel gives every query row the bits the decode kernel gives it, however the prompt is chunked;
both close to float64 / SDPA references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the C kernels cannot be built on this machine")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 24), (37, 8), (16, 1536)])
def test_gemm_rows_are_invariant(libs, threads, n, k):
    torch.manual_seed(n + k)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(300, k)
    lib = libs["native"]
    packed = cpu.pack_panels(lib, weight)
    full = cpu.gemm_invariant(lib, x, packed, bias, n)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(full.double(), exact, rtol=1e-5, atol=1e-5 * math.sqrt(k))
    for m in [*range(1, 14), 31, 32, 33, 49, 97]:  # from 2 rows the next item's panels are prefetched
        for start in (0, m, 300 - m):
            assert torch.equal(cpu.gemm_invariant(lib, x[start : start + m], packed, bias, n), full[start : start + m])
    assert torch.equal(cpu.gemm_invariant(lib, x, packed, None, n) + bias, full)  # the bias added last
    for count in (1, 5):  # one thread; more threads than cores, which take each other's items
        threads(count)
        assert torch.equal(cpu.gemm_invariant(lib, x, packed, bias, n), full)
        assert torch.equal(cpu.gemm_invariant(lib, x[:33], packed, bias, n), full[:33])
    # every output is one fma chain over k in order: the same bits from 8- as from 16-lane vectors
    avx2 = libs["avx2"]
    assert torch.equal(cpu.gemm_invariant(avx2, x[:7], cpu.pack_panels(avx2, weight), bias, n), full[:7])


def test_gemm_reads_strided_rows(libs):
    lib = libs["native"]
    weight, x = torch.randn(48, 64), torch.randn(5, 96)
    view = x[:, 16:80]  # rows 96 floats apart
    out = cpu.gemm_invariant(lib, view, cpu.pack_panels(lib, weight), None, 48)
    assert torch.equal(out, cpu.gemm_invariant(lib, view.contiguous(), cpu.pack_panels(lib, weight), None, 48))


def paged_cache(num_tokens: int, block_size: int, kv_heads: int, head_dim: int):
    """A cache holding one request's num_tokens keys and values in shuffled blocks, its table."""
    num_blocks = -(-num_tokens // block_size)
    kv = torch.randn(2, num_blocks + 1, block_size, kv_heads, head_dim)
    table = (torch.randperm(num_blocks) + 1).to(torch.int32)[None].contiguous()
    return kv, table


def decode_rows(lib, query, kv, table, first_pos, scale):
    """Each query row attended by the decode kernel alone, as the decode at its position."""
    rows, heads, head_dim = query.shape
    out = torch.empty(rows, heads, head_dim)
    no_store = torch.tensor([-1])
    for r in range(rows):
        seq_len = torch.tensor([first_pos + r + 1], dtype=torch.int32)
        q = query[r : r + 1]
        cpu.paged_decode_attention(lib, out[r : r + 1], q, q, q, kv, no_store, table, seq_len, scale)
    return out


def assert_chunks_equal(lib, query, kv, table, chunks, expected, scale):
    """Prefilling the query rows in `chunks`, each over the cache of the chunks before it, gives
    `expected` (each row's decode) bitwise."""
    start = 0
    for size in chunks:
        out = torch.empty(size, *query.shape[1:])
        query_start = torch.tensor([0, size], dtype=torch.int32)
        seq_len = torch.tensor([start + size], dtype=torch.int32)
        cpu.prefill_attention(lib, out, query[start : start + size], kv, table, query_start, seq_len, scale)
        assert torch.equal(out, expected[start : start + size]), chunks
        start += size


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize(
    "block_size,kv_heads,group,head_dim",
    [(16, 3, 3, 64), (8, 2, 2, 64), (1, 2, 2, 16), (16, 1, 4, 72), (24, 4, 1, 128)],
)
def test_prefill_rows_equal_decodes(libs, isa, block_size, kv_heads, group, head_dim):
    """Rows across several 256-token spans, chunked many ways (a chunk, its 8-row work items and the
    spans' key and value tiles ending anywhere; a 46-row hit after 530 cached): each equals its
    decode bitwise."""
    lib, total = libs[isa], 600
    torch.manual_seed(head_dim)
    kv, table = paged_cache(total, block_size, kv_heads, head_dim)
    query, scale = torch.randn(total, kv_heads * group, head_dim), head_dim**-0.5
    expected = decode_rows(lib, query, kv, table, 0, scale)
    for chunks in ([total], [1, 255, 1, 343], [300, 300], [17, 256, 327], [530, 46, 24]):
        assert_chunks_equal(lib, query, kv, table, chunks, expected, scale)
    k = kv[0][table[0].long()].flatten(0, 1)[:total].transpose(0, 1)
    v = kv[1][table[0].long()].flatten(0, 1)[:total].transpose(0, 1)
    sdpa = F.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, is_causal=True, scale=scale, enable_gqa=True
    ).transpose(0, 1)
    assert torch.allclose(expected, sdpa, atol=2e-6)


@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 128)])
def test_prefill_rows_equal_decodes_on_a_bfloat16_cache(libs, kv_heads, group, head_dim):
    """On a bf16 cache too (widened as read), long chunks (whose keys are transposed on AVX-512)
    and short ones alike equal their decodes bitwise."""
    lib, total = libs["native"], 400
    torch.manual_seed(7)
    kv, table = paged_cache(total, 16, kv_heads, head_dim)
    kv = kv.bfloat16()
    query, scale = torch.randn(total, kv_heads * group, head_dim), head_dim**-0.5
    expected = decode_rows(lib, query, kv, table, 0, scale)
    assert_chunks_equal(lib, query, kv, table, [300, 37, 63], expected, scale)


def test_prefill_several_requests_in_one_call(libs, threads):
    """Requests of one call do not touch each other's rows; the thread count changes nothing."""
    lib = libs["native"]
    torch.manual_seed(1)
    kv, table = paged_cache(700, 16, 3, 64)
    query, scale = torch.randn(700, 9, 64), 0.125
    expected = decode_rows(lib, query, kv, table, 0, scale)
    # three requests over the same cache: rows 0-99 (a prompt), 450-699 (after 450 cached), 5-6
    rows = torch.cat([query[:100], query[450:], query[5:7]])
    tables = table.expand(3, -1).contiguous()
    query_start = torch.tensor([0, 100, 350, 352], dtype=torch.int32)
    seq_lens = torch.tensor([100, 700, 7], dtype=torch.int32)
    for n in (1, 2):
        threads(n)
        out = torch.empty(352, 9, 64)
        cpu.prefill_attention(lib, out, rows, kv, tables, query_start, seq_lens, scale)
        assert torch.equal(out, torch.cat([expected[:100], expected[450:], expected[5:7]]))


def test_decodes_sharing_a_prefix_equal_each_alone(libs, threads):
    """Decodes whose tables share a prefix's blocks (as the radix cache leaves them), in one call of
    several spans each, give each request the bits it gets alone, on one thread or two, close to
    softmax attention."""
    lib = libs["native"]
    torch.manual_seed(3)
    lens, shared, own = [700, 900, 650, 1300], 40, 42  # blocks of 16: 640 shared tokens
    kv = torch.randn(2, shared + own * len(lens), 16, 3, 64)
    pool = torch.randperm(kv.shape[1]).to(torch.int32)
    tables = torch.cat([pool[:shared].expand(len(lens), -1), pool[shared:].view(len(lens), own)], 1).contiguous()
    query, scale, no_store = torch.randn(len(lens), 9, 64), 0.125, torch.full((len(lens),), -1)
    alone = torch.empty(len(lens), 9, 64)
    for i, n in enumerate(lens):
        q, seq_len = query[i : i + 1], torch.tensor([n], dtype=torch.int32)
        cpu.paged_decode_attention(lib, alone[i : i + 1], q, q, q, kv, no_store[:1], tables[i : i + 1], seq_len, scale)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for n in (1, 2):
        threads(n)
        together = torch.empty_like(alone)
        cpu.paged_decode_attention(lib, together, query, query, query, kv, no_store, tables, seq_lens, scale)
        assert torch.equal(together, alone), n
    for i, n in enumerate(lens):
        k, v = (kv[j][tables[i].long()].flatten(0, 1)[:n] for j in (0, 1))
        ref = torch.stack([torch.softmax(scale * k[:, h // 3] @ query[i, h], 0) @ v[:, h // 3] for h in range(9)])
        assert torch.allclose(alone[i], ref, atol=1e-5), i
