"""The Triton backend against the torch reference, under Triton's interpreter on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.attention import triton_kernels
from pagoda.attention.backend import AttentionInputs
from pagoda.attention.triton_backend import TritonAttentionBackend

from . import helpers
from .helpers import Step, make_step, reference, run

# (query_lens, seq_lens): decodes come first, as the layout contract says.
SCENARIOS = {
    "prefill": ([5, 17, 33], [5, 17, 33]),
    "chunked": ([7, 16], [23, 48]),  # earlier context in the cache: a later chunk or a prefix hit
    "decode": ([1, 1, 1, 1, 1], [1, 15, 16, 17, 40]),  # at, and one past, block boundaries
    "mixed": ([1, 1, 1, 9, 20], [16, 17, 33, 9, 45]),
    "multi_token": ([4, 4, 3], [20, 33, 16]),  # speculative verification
}


def assert_matches_reference(step: Step, backend: TritonAttentionBackend | None = None, tol: float = 1e-4):
    helpers.assert_matches_reference(backend or TritonAttentionBackend(), step, tol)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,group", [(16, 1), (16, 4), (8, 3), (1, 4)])
def test_matches_reference(scenario, block_size, group):
    query_lens, seq_lens = SCENARIOS[scenario]
    assert_matches_reference(make_step(query_lens, seq_lens, block_size=block_size, group=group))


@pytest.mark.parametrize("head_dim", [96, 128])
def test_other_head_dims(head_dim):
    assert_matches_reference(make_step(*SCENARIOS["mixed"], head_dim=head_dim, group=2))


@pytest.mark.parametrize("group", [1, 3])
def test_long_prefills_span_several_tiles(group):
    """Prefills too long for one program: tiles are found by binary search over query_start_loc."""
    assert_matches_reference(make_step([1, 70, 5, 100], [30, 70, 9, 110], num_kv_heads=1, group=group))


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decodes(splits):
    """Split-KV forced on; with 8 slices the short contexts leave some slices empty."""
    step = make_step([1, 1, 1, 1, 6], [1, 16, 17, 100, 40], group=4, seed=splits)
    assert_matches_reference(step, TritonAttentionBackend(decode_splits=splits))


def test_fp16():
    step = make_step(*SCENARIOS["mixed"], group=4, dtype=torch.float16)
    assert_matches_reference(step, tol=2e-3)


def test_strided_query_key_value():
    """Model runners hand over views of one fused projection: token stride > heads * head_dim."""
    step = make_step(*SCENARIOS["mixed"], group=2)
    qkv = torch.cat([step.query, step.key, step.value], dim=1)
    heads, kv_heads = step.query.shape[1], step.key.shape[1]
    views = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    assert not views[0].is_contiguous()
    assert_matches_reference(dataclasses.replace(step, query=views[0], key=views[1], value=views[2]))


@pytest.mark.parametrize("splits", [None, 4])
def test_padded_lanes_neither_crash_nor_write(splits):
    """CUDA-graph padding: slot -1 and seq_len 0 or 1 pointing at block 0."""
    padded = make_step([1, 1, 1], [5, 17, 40], group=2, padded_lanes=3)
    out, cache = run(TritonAttentionBackend(decode_splits=splits), padded)
    real = drop_padding(padded, 3)
    ref_out, ref_cache = reference(real)
    torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache, ref_cache)  # block 0 included: padded lanes wrote nothing
    assert torch.isfinite(out[3:]).all()
    assert (out[3] == 0).all() and (out[5] == 0).all()  # seq_len 0: no keys, zeros


def test_store_kv_skips_negative_slots():
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    cache = torch.zeros(2, 3, 4, 2, 8)
    triton_kernels.store_kv(key, value, cache, torch.tensor([5, -1, 0, 11]))
    expected = torch.zeros_like(cache)
    for token, slot in ((0, 5), (2, 0), (3, 11)):
        expected[0, slot // 4, slot % 4] = key[token]
        expected[1, slot // 4, slot % 4] = value[token]
    assert torch.equal(cache, expected)


def test_kernel_with_small_tiles():
    """Many tiles per request and rows left over (GROUP 3 in 16 rows): the tile search at its edges."""
    step = make_step([9, 16, 1, 23], [9, 20, 8, 23], num_kv_heads=1, group=3)
    ref_out, _ = reference(step)
    inputs, cache = step.inputs, step.kv_cache.clone()
    triton_kernels.store_kv(step.key, step.value, cache, inputs.slot_mapping)
    out = torch.full_like(step.query, float("nan"))
    config = triton_kernels.TileConfig(block_m=16, tile_n=16, one_tile_per_seq=False)
    triton_kernels.paged_attention(
        out,
        step.query,
        cache,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables,
        step.scale,
        num_tokens=out.shape[0],
        max_query_len=max(inputs.query_lens_cpu),
        config=config,
    )
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


def test_decode_splits_heuristic():
    choose = triton_kernels.choose_decode_splits
    assert choose(num_decodes=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 32
    assert choose(num_decodes=1, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 4  # slices >= 256 keys
    assert choose(num_decodes=8, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 4
    assert choose(num_decodes=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1  # too short to split
    assert choose(num_decodes=64, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1  # GPU already full


def drop_padding(step: Step, lanes: int) -> Step:
    i = step.inputs
    reqs, tokens = i.num_reqs - lanes, int(i.query_start_loc[-1]) - lanes
    inputs = AttentionInputs(
        query_start_loc=i.query_start_loc[: reqs + 1],
        seq_lens=i.seq_lens[:reqs],
        block_tables=i.block_tables[:reqs],
        slot_mapping=i.slot_mapping[:tokens],
        num_decodes=min(i.num_decodes, reqs),
        query_lens_cpu=i.query_lens_cpu[:reqs],
        seq_lens_cpu=i.seq_lens_cpu[:reqs],
        block_size=i.block_size,
        dtype=i.dtype,
    )
    return dataclasses.replace(
        step, inputs=inputs, query=step.query[:tokens], key=step.key[:tokens], value=step.value[:tokens]
    )
