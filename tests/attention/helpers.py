"""Hand-built attention steps: random paged caches, block tables and the reference's answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionBackend, AttentionInputs, kv_cache_shape
from pagoda.attention.torch_backend import TorchAttentionBackend


@dataclass(frozen=True)
class Step:
    inputs: AttentionInputs
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # earlier context already in place; this step's tokens not yet written
    scale: float


def make_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    padded_lanes: int = 0,
    dtype: torch.dtype = torch.float32,
) -> AttentionInputs:
    """Requests with one query token first count as decodes. Blocks come from a shuffled pool
    without block 0; tables get one spare 0 column. `padded_lanes` trailing requests are CUDA-graph
    padding: slot -1, and seq_len 0 or 1 pointing at block 0."""
    assert all(s >= q for q, s in zip(query_lens, seq_lens))
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    assert sum(blocks_per_req) <= len(pool), "cache too small for this batch"
    max_blocks = max(blocks_per_req, default=0) + 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        n = blocks_per_req[i]
        tables[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    query_lens, seq_lens = list(query_lens), list(seq_lens)
    pad = torch.zeros(padded_lanes, max_blocks, dtype=torch.int32)
    for lane in range(padded_lanes):
        query_lens.append(1)
        seq_lens.append(lane % 2)
        slots.append(-1)
    if padded_lanes:
        assert num_decodes == len(query_lens) - padded_lanes, "padding belongs to decode-only batches"
        num_decodes = len(query_lens)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionInputs(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.cat([tables, pad]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=num_decodes,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
        dtype=dtype,
    )


def make_step(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    padded_lanes: int = 0,
    seed: int = 0,
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = needed + 4
    inputs = make_inputs(query_lens, seq_lens, block_size, num_blocks, gen, padded_lanes, dtype)
    num_tokens = int(inputs.query_start_loc[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return Step(
        inputs=inputs,
        query=randn(num_tokens, num_kv_heads * group, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(*kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)),
        scale=head_dim**-0.5,
    )


def run(backend: AttentionBackend, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the step) on a copy of the step's cache."""
    cache = step.kv_cache.clone()
    metadata = backend.build_metadata(step.inputs)
    out = backend.forward(step.query, step.key, step.value, cache, metadata, step.scale)
    return out, cache


def reference(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    return run(TorchAttentionBackend(), step)


def assert_matches_reference(backend: AttentionBackend, step: Step, tol: float) -> None:
    """The backend's output within `tol` of the torch reference's, and the same cache bit for bit."""
    out, cache = run(backend, step)
    ref_out, ref_cache = reference(step)
    assert out.dtype == step.query.dtype
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    assert torch.equal(cache, ref_cache)
