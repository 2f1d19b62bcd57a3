"""Runs one scheduled step: builds the packed batch tensors, runs the model, samples.

The runner owns the model, the paged KV cache tensors and the attention backend; the scheduler
owns which blocks belong to whom. Data flows one way: SchedulerOutput in, ModelRunnerOutput out.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backend import AttentionInputs, kv_cache_shape
from pagoda.attention.selector import create_backend
from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor import gpu_memory
from pagoda.model_executor.cpu_invariant import InvariantLinear
from pagoda.model_executor.cpu_threads import ComputeThreads
from pagoda.model_executor.cuda_graphs import MAX_GRAPH_BATCH, CUDAGraphRunner, capture_sizes
from pagoda.model_executor.loader import load_model
from pagoda.model_executor.lora_layers import LoRAModel, plain_linear
from pagoda.model_executor.pooler import Pooler
from pagoda.model_executor.sampler import Sampler, token_logprob
from pagoda.model_executor.spec_verify import verify
from pagoda.pooling_params import WARMUP_POOLING
from pagoda.request import Request, TokenLogprob
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.structured.grammar import TokenBitmask

logger = logging.getLogger(__name__)

GIB = 1 << 30


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU in a private anonymous mapping of its own, whose pages
    the OS maps, already zero, when first touched, so that allocating a large KV cache costs no
    start-up time: torch.zeros writes every page (4 GiB took 7.6 s on a fresh 2-core VM). Not
    numpy's zeros (calloc): in the test suite's long-lived process a quarter of a calloc'd cache
    came back already resident, presumably memory malloc reused and calloc had to clear. Page
    aligned; unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it
PREFAULT_CHUNK = 8 << 20  # bytes a madvise call maps: a cache freed meanwhile ends the thread within one


def prefault_at_idle_priority(caches: list[torch.Tensor]) -> threading.Thread:
    """Makes the caches' pages resident from a daemon thread at the OS's idle priority
    (SCHED_IDLE: it runs only where a core has nothing else to do), so that steps do not take the
    first touch of a block's pages (zeros_on_first_touch) under load: 5% of a fresh server's time
    at concurrency 32, and the block pool hands out every block once before it reuses one.
    madvise(MADV_POPULATE_WRITE) maps a page as a first write would, without writing: the
    contents are untouched, so the blocks steps write meanwhile are safe. The thread never holds a
    cache, not even for a moment: had it held the last reference of one the engine dropped (an LLM
    freed right after it was built), it would free it, and a torch tensor's deleter on a daemon
    thread racing the interpreter's exit aborts the process ("terminate called without an active
    exception"). It reads the caches' addresses up front and learns of a freed one from its weak
    reference's callback; a range freed between that look and the call is harmless (madvise fails
    with ENOMEM, or faults in pages of whatever took the addresses, writing nothing). It stops
    quietly where the kernel lacks the advice."""
    freed = threading.Event()
    # each span keeps its weak reference alive with it: a weak reference no one holds calls nothing back
    spans = [(c.data_ptr(), c.nbytes, weakref.ref(c, lambda _: freed.set())) for c in caches]

    def run() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only (Linux)
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: releases the GIL
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for start, nbytes, _ in spans:
            for offset in range(0, nbytes, PREFAULT_CHUNK):
                if freed.is_set():  # the engine let its caches go
                    return
                if madvise(start + offset, min(PREFAULT_CHUNK, nbytes - offset), MADV_POPULATE_WRITE):
                    logger.debug("KV cache prefault stopped: %s", os.strerror(ctypes.get_errno()))
                    return

    thread = threading.Thread(target=run, name="pagoda-kv-prefault", daemon=True)
    thread.start()
    return thread


def available_memory_bytes() -> int | None:
    """The kernel's estimate of the memory new allocations can have (MemAvailable), None where
    /proc/meminfo does not give it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_COMPILE_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        # the compute pool of the thread that builds the runner, which runs every step after
        self.threads = ComputeThreads(config.threads) if self.device.type == "cpu" else None
        self.backend = create_backend(config.attention_backend, config.deterministic)
        torch.manual_seed(config.seed)
        self.model = load_model(
            config.model, self.backend, self.device, config.deterministic, modules_only=config.enable_lora
        )
        self.lora = self._lora_model() if config.enable_lora else None
        self.sampler = Sampler(cpu_kernels.load() if self.device.type == "cpu" else None)
        self.pooler = Pooler()  # embedding requests' vectors
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CUDAGraphRunner | None = None  # set by capture_cuda_graphs

    def _lora_model(self) -> LoRAModel:
        """The model's projections wrapped for adapters, whose updates run as its linears do:
        on the batch-invariant GEMM in deterministic serving, else by torch."""
        if self.config.deterministic:
            lib = cpu_kernels.load()
            return LoRAModel(self.model, lambda weight: InvariantLinear(weight, None, lib))
        return LoRAModel(self.model, plain_linear)

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.config.cache.kv_cache_dtype == "bfloat16" else self.config.model.dtype

    def block_bytes(self) -> int:
        """One KV block of every layer: keys and values of block_size tokens."""
        m = self.config.model
        return 2 * self.block_size * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize * m.num_layers

    def num_blocks_for(self, memory_gib: float) -> int:
        return int(memory_gib * GIB // self.block_bytes())

    def num_kv_blocks(self) -> int:
        """KV blocks to allocate (block 0 included): kv_cache_memory on CPU; on a GPU what
        gpu_memory_utilization leaves after weights, the activation peak and CUDA graphs."""
        if self.device.type != "cuda":
            return self.num_blocks_for(self.config.cache.kv_cache_memory_gib)
        profile = gpu_memory.profile(self)
        return gpu_memory.kv_cache_num_blocks(profile, self.config.cache.gpu_memory_utilization, self.block_bytes())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        if self.device.type == "cpu":
            # the pages are taken as they are first used, so a budget past what the machine has
            # would fail under load, not here: refuse it now (torch.zeros failed here)
            total, available = num_blocks * self.block_bytes(), available_memory_bytes()
            if available is not None and total > available:
                raise ConfigError(
                    f"The KV cache ({total / GIB:.2f} GiB) is larger than the memory available "
                    f"({available / GIB:.2f} GiB); lower --kv-cache-memory."
                )
            self.kv_caches = [zeros_on_first_touch(shape, self.kv_dtype) for _ in range(m.num_layers)]
            prefault_at_idle_priority(self.kv_caches)
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(m.num_layers)]

    def make_graph_runner(self, capture: bool = True) -> CUDAGraphRunner:
        """A graph runner over the current KV cache, with buckets up to the largest decode batch."""
        s, m = self.config.scheduler, self.config.model
        sizes = capture_sizes(min(s.max_num_seqs, s.max_num_batched_tokens, MAX_GRAPH_BATCH))
        return CUDAGraphRunner(
            self.model,
            self.backend,
            self.kv_caches,
            sizes=sizes,
            max_context=m.max_model_len,
            block_size=self.block_size,
            dtype=m.dtype,
            device=self.device,
            capture=capture,
        )

    def capture_cuda_graphs(self) -> None:
        """After allocate_kv_cache: capture the decode graphs, unless the config runs eagerly."""
        if not self.config.use_cuda_graphs:
            return
        logger.info("Capturing CUDA graphs for decode batches")
        start, free = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        self.cuda_graphs = self.make_graph_runner()
        self.cuda_graphs.capture()
        used = (free - torch.cuda.mem_get_info(self.device)[0]) / GIB
        logger.info(
            "CUDA graphs for decode batches %s captured in %.1f s (%.2f GiB)",
            self.cuda_graphs.sizes,
            time.perf_counter() - start,
            used,
        )

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """After allocate_kv_cache (and capture_cuda_graphs): run the attention backend's
        first-use shapes once each, eagerly, on blocks no request holds yet, so that every kernel
        variant a step can use is compiled before the first request (Triton builds them lazily)."""
        m = self.config.model
        shapes = self.backend.first_use_shapes(m.num_heads, m.num_kv_heads, m.head_dim, m.dtype, m.max_model_len)
        free_blocks = self.kv_caches[0].shape[1] - 1  # block 0 is the null block
        steps = [(q, total, -(-total // self.block_size)) for q, total in shapes]  # with the blocks each takes
        steps = [step for step in steps if step[2] <= free_blocks]
        if not steps:
            return
        start, graphs, self.cuda_graphs = time.perf_counter(), self.cuda_graphs, None
        pooling = None if self.config.pooler is None else WARMUP_POOLING
        try:
            for i, (query_len, total, blocks) in enumerate(steps):
                request = Request(
                    f"compile-{i}", [0] * total, _COMPILE_SAMPLING, frozenset(), m.max_model_len, pooling=pooling
                )
                request.num_computed_tokens = total - query_len
                request.block_ids = list(range(1, 1 + blocks))
                self.execute(SchedulerOutput(((request, query_len),), query_len))
        finally:
            self.cuda_graphs = graphs
        logger.info("Kernels compiled for %d step shapes in %.1f s", len(steps), time.perf_counter() - start)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.adjust()
        self.sampler.drop(step.finished_request_ids)
        self.pooler.drop(step.finished_request_ids)
        batch = self._prepare(step)
        if self.lora is None or not batch.lora_rows:
            hidden = self._forward(batch)
        else:
            with self.lora.rows(batch.lora_rows):
                hidden = self._forward(batch)
        sampling = [r for r, _ in batch.samplers]
        tokens: list[int | None] = [None] * len(step.scheduled)
        logprobs: list[TokenLogprob | None] = [None] * len(step.scheduled)
        if sampling:
            logits = self.model.compute_logits(hidden[batch.sample_indices])
            out = self.sampler.sample(logits, sampling, self._grammar_bitmask(sampling))
            for (_, slot), token, lp in zip(batch.samplers, out.token_ids, out.logprobs):
                tokens[slot], logprobs[slot] = token, lp
        prompt_logprobs = (
            self._prompt_logprobs(step, batch, hidden) if batch.wants_prompt_logprobs else [None] * len(step.scheduled)
        )
        embeddings = None
        if batch.poolers:
            embeddings = [None] * len(step.scheduled)
            for pool in batch.poolers:
                rows = hidden[pool.rows]
                embeddings[pool.slot] = self.pooler.add(pool.request, rows, pool.start, pool.ends)
        if not batch.verifiers:
            return ModelRunnerOutput(tokens, logprobs, prompt_logprobs, embeddings=embeddings)
        accepted: list[list[int]] = [[] for _ in step.scheduled]
        accepted_logprobs: list[list[TokenLogprob | None]] = [[] for _ in step.scheduled]
        verifying = [r for r, _ in batch.verifiers]
        drafts = [step.draft_token_ids[r.request_id] for r in verifying]
        logits = self.model.compute_logits(hidden[batch.verify_indices])
        bitmask = self._grammar_bitmask(verifying, drafts)
        verdicts = verify(logits, verifying, drafts, self.sampler, bitmask)
        for (_, slot), verdict in zip(batch.verifiers, verdicts):
            accepted[slot], tokens[slot] = verdict.accepted, verdict.token
            accepted_logprobs[slot], logprobs[slot] = verdict.logprobs[:-1], verdict.logprobs[-1]
        return ModelRunnerOutput(tokens, logprobs, prompt_logprobs, accepted, accepted_logprobs, embeddings)

    def _grammar_bitmask(self, requests: list[Request], drafts: list[list[int]] | None = None) -> TokenBitmask | None:
        """The allowed tokens of this step's constrained requests (None when none is): one row
        per request sampling, or, with `drafts`, one per position a request verifies."""
        if all(request.grammar is None for request in requests):
            return None
        from pagoda.structured.grammar import step_bitmask  # xgrammar: only once a request is constrained

        return step_bitmask(requests, self.config.model.vocab_size, drafts)

    def _forward(self, batch: _Batch) -> torch.Tensor:
        """A pure-decode step that fits a bucket replays that bucket's CUDA graph; the rest run eagerly."""
        if self.cuda_graphs is not None and self.cuda_graphs.covers(batch.attn_inputs):
            hidden = self.cuda_graphs.replay(batch.input_ids, batch.positions, batch.attn_inputs)
            return hidden if batch.read_rows is None else hidden[batch.read_rows]
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, batch.read_rows)

    def _prepare(self, step: SchedulerOutput) -> _Batch:
        """The batch's rows are the step's requests reordered decodes first (`order`); everything
        handed back is indexed by the step's order."""
        bs = self.block_size
        order = _decodes_first([n for _, n in step.scheduled])
        scheduled = [step.scheduled[i] for i in order]
        starts = [r.num_computed_tokens for r, _ in scheduled]
        query_lens = [n for _, n in scheduled]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        drafts = [step.draft_token_ids.get(r.request_id, []) for r, _ in scheduled]
        token_ids: list[int] = []
        for (request, n), start, draft in zip(scheduled, starts, drafts):
            token_ids += request.token_ids[start : start + n - len(draft)] + draft
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, query_lens)])
        max_blocks = max(len(r.block_ids) for r, _ in scheduled)
        tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, (request, _) in enumerate(scheduled):
            tables[i, : len(request.block_ids)] = request.block_ids
        row_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        device = self.device
        inputs = AttentionInputs(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(tables).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_size=bs,
            dtype=self.config.model.dtype,
        )
        # a request that reaches its end samples its next token, or verifies its drafts (1 + k rows);
        # an embedding request pools its prompt's rows instead (at its end, or each chunk's rows)
        ends = [seq_lens[i] == r.num_tokens for i, (r, _) in enumerate(scheduled)]
        sampling_rows = [i for i, (r, _) in enumerate(scheduled) if ends[i] and not drafts[i] and r.pooling is None]
        sample_indices = [int(query_start_loc[i + 1]) - 1 for i in sampling_rows]
        pooling_rows = [i for i, (r, _) in enumerate(scheduled) if r.pooling is not None]
        pools_every_row = any(scheduled[i][0].pooling.every_row for i in pooling_rows)  # type: ignore[union-attr]
        pooled_last = [int(query_start_loc[i + 1]) - 1 for i in pooling_rows if ends[i]]
        verify_rows = [i for i in range(len(scheduled)) if drafts[i]]
        verify_indices = [
            int(j)
            for i in verify_rows
            for j in range(query_start_loc[i + 1] - 1 - len(drafts[i]), query_start_loc[i + 1])
        ]
        wants_prompt_logprobs = any(
            r.sampling_params.prompt_logprobs is not None and r.is_prefilling for r, _ in step.scheduled
        )
        # the rows whose hidden states the step reads, where that is not all (prompt logprobs and
        # MEAN or CLS pooling read every prompt row): the forward returns those only, and the
        # indices count among them
        read_rows, among_read = None, None
        every_row = wants_prompt_logprobs or pools_every_row
        if not every_row and len(sample_indices) + len(verify_indices) + len(pooled_last) < len(token_ids):
            read_rows = sorted(sample_indices + verify_indices + pooled_last)
            among_read = {row: k for k, row in enumerate(read_rows)}
            sample_indices = [among_read[row] for row in sample_indices]
            verify_indices = [among_read[row] for row in verify_indices]
        poolers = []
        for i in pooling_rows:
            request, first, last = scheduled[i][0], int(query_start_loc[i]), int(query_start_loc[i + 1])
            if among_read is not None:  # LAST pooling only: the last row, where the prompt ends
                if not ends[i]:
                    continue
                first, last = among_read[last - 1], among_read[last - 1] + 1
            poolers.append(_Pool(request, order[i], slice(first, last), starts[i], ends[i]))
        query_starts = np.empty(len(order), dtype=np.int32)
        query_starts[order] = query_start_loc[:-1]
        lora_rows: dict[str, list[int]] = {}  # adapter uid -> the rows of its requests' query tokens
        for i, (request, _) in enumerate(scheduled):
            if request.lora is not None:
                assert self.lora is not None, "a request with an adapter reached an engine without LoRA"
                self.lora.register(request.lora, device)
                lora_rows.setdefault(request.lora.uid, []).extend(range(query_start_loc[i], query_start_loc[i + 1]))
        return _Batch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(positions).to(device),
            attn_inputs=inputs,
            attn_metadata=self.backend.build_metadata(inputs),
            samplers=[(scheduled[i][0], order[i]) for i in sampling_rows],
            poolers=poolers,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
            verifiers=[(scheduled[i][0], order[i]) for i in verify_rows],
            verify_indices=torch.tensor(verify_indices, dtype=torch.long, device=device),
            read_rows=None if read_rows is None else torch.tensor(read_rows, dtype=torch.long, device=device),
            query_starts=query_starts,
            wants_prompt_logprobs=wants_prompt_logprobs,
            lora_rows=[
                (uid, None if len(rows) == len(token_ids) else torch.tensor(rows, dtype=torch.long, device=device))
                for uid, rows in lora_rows.items()
            ],
        )

    def _prompt_logprobs(
        self, step: SchedulerOutput, batch: _Batch, hidden: torch.Tensor
    ) -> list[list[TokenLogprob] | None]:
        """For each prompt token computed this step but the last, the logprob of the token after it."""
        result: list[list[TokenLogprob] | None] = []
        for i, (request, n) in enumerate(step.scheduled):
            num_top = request.sampling_params.prompt_logprobs
            # positions whose next token is a prompt token, skipping any scored before a preemption
            start = max(request.num_computed_tokens, request.num_prompt_logprobs)
            end = min(request.num_computed_tokens + n, request.num_prompt_tokens - 1)
            if num_top is None or end <= start:
                result.append(None)
                continue
            q0 = int(batch.query_starts[i]) + start - request.num_computed_tokens
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[q0 : q0 + end - start]).float(), dim=-1)
            nexts = request.token_ids[start + 1 : end + 1]
            result.append([token_logprob(logprobs[j], t, num_top) for j, t in enumerate(nexts)])
        return result


@dataclass(frozen=True)
class _Pool:
    """An embedding request's rows of the forward's output this step (Pooler.add's arguments)."""

    request: Request
    slot: int  # its place in the step
    rows: slice
    start: int  # the prompt position of its first row
    ends: bool  # its prompt ends this step


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_inputs: AttentionInputs
    attn_metadata: object  # the backend's own type, opaque to the runner
    samplers: list[tuple[Request, int]]  # requests that sample this step, with their slot in the step
    sample_indices: torch.Tensor  # the samplers' last query tokens' rows of the forward's output, as `samplers`
    poolers: list[_Pool]  # the embedding requests that pool rows this step
    verifiers: list[tuple[Request, int]]  # requests verifying drafts this step, with their slot in the step
    verify_indices: torch.Tensor  # each verifier's 1 + k last query tokens' rows of the output, as `verifiers`
    read_rows: torch.Tensor | None  # the batch rows the forward returns (sorted), None: all
    query_starts: np.ndarray  # per request, in the step's order: the batch row of its first query token
    wants_prompt_logprobs: bool
    # (adapter uid, the batch rows that run it, None: all); empty: none do
    lora_rows: list[tuple[str, torch.Tensor | None]]


def _decodes_first(query_lens: list[int]) -> list[int]:
    """The step's indices with its decodes (one query token) first, each group in the step's order:
    the batch order AttentionInputs' contract asks for."""
    return sorted(range(len(query_lens)), key=lambda i: query_lens[i] != 1)
