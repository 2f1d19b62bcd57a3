"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket at
startup, then replayed for every pure-decode step that fits, with no per-kernel launch cost.

A graph replays fixed device addresses, so every graph reads the same static input buffers,
which each replay overwrites. A step of n decodes runs in the graph of the smallest bucket >= n;
its lanes are laid out as the attention backends' padding contract asks:

    lanes [0, n)       the step's decodes, one query token each
    lanes [n, bucket)  padding: slot -1 (nothing is written), seq_len 1 over block 0 of the table;
                       their output rows are garbage and never read

query_start_loc is always 0, 1, ..., bucket. The attention metadata is built once per bucket at
capture, with every context at max_model_len: that fixes the host-side launch parameters (the
split-KV slice count), which stay correct for any shorter context. Graphs are captured largest
first into one shared memory pool; a step reads its graph's output before the next replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionBackend, AttentionInputs

BUCKET_STEP = 16
MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly: launch costs are small beside their work


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch-size buckets: 1, 2, 4, 8, 16, then steps of 16, up to and including max_batch."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch} | set(range(BUCKET_STEP, max_batch, BUCKET_STEP)) | {max_batch}
    return tuple(sorted(sizes))


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `batch` lanes, or None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@dataclass
class _Graph:
    run: Callable[[], torch.Tensor]  # replays the graph (or, without capture, runs the forward)
    output: torch.Tensor | None  # the captured forward's hidden states [bucket, hidden]


class CUDAGraphRunner:
    """Decode forwards through captured graphs. With capture=False (CPU tests) each "replay" runs
    the forward eagerly on the same static buffers and capture-time metadata, so everything but
    the capture itself can be checked without a GPU."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        sizes: tuple[int, ...],
        max_context: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = sizes
        self.max_context, self.block_size, self.dtype = max_context, block_size, dtype
        self.capture_graphs = capture
        max_batch, max_blocks = sizes[-1], -(-max_context // block_size)
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
            self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
            self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[int, _Graph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self, sizes: tuple[int, ...] | None = None) -> None:
        """Capture the graphs of `sizes` (default: all buckets), largest first."""
        for size in sorted(sizes or self.sizes, reverse=True):
            self._graphs[size] = self._capture_one(size)

    def _capture_one(self, size: int) -> _Graph:
        metadata = self.backend.build_metadata(self._capture_inputs(size))
        ids, positions = self.input_ids[:size], self.positions[:size]

        def forward() -> torch.Tensor:
            return self.model(ids, positions, self.kv_caches, metadata)

        if not self.capture_graphs:
            return _Graph(forward, None)
        forward()  # compiles the Triton kernels and sets up cuBLAS outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return _Graph(graph.replay, output)

    def _capture_inputs(self, size: int) -> AttentionInputs:
        return AttentionInputs(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            query_lens_cpu=(1,) * size,
            seq_lens_cpu=(self.max_context,) * size,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    def covers(self, inputs: AttentionInputs) -> bool:
        """Whether a step can replay a graph: decodes only, no more than the largest bucket."""
        fits = inputs.block_tables.shape[1] <= self.block_tables.shape[1]
        return inputs.num_decodes == inputs.num_reqs <= self.max_batch and fits

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """The hidden states [n, hidden] of a step that `covers` accepts; valid until the next replay."""
        n = inputs.num_reqs
        size = bucket_for(n, self.sizes)
        self._fill(n, size, input_ids, positions, inputs)
        graph = self._graphs[size]
        if graph.output is None:
            return graph.run()[:n]
        graph.run()
        return graph.output[:n]

    def _fill(self, n: int, size: int, input_ids, positions, inputs: AttentionInputs) -> None:
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        width = inputs.block_tables.shape[1]  # columns past it are stale but never read: seq_len bounds them
        self.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
