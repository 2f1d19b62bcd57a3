"""Sizing the KV cache on a GPU, as vLLM does: of gpu_memory_utilization x the device's memory,
what the weights, the activation peak of the largest step, the CUDA graphs and everything outside
PyTorch's allocator (CUDA context, library workspaces, other processes) leave.

The activation peak is measured, not estimated: one step of max_num_batched_tokens prompt
tokens spread over as many requests as may run at once, every one sampling with penalties,
top-k and top-p (the sampler's costliest path), on a throwaway KV cache. Graph memory is measured
by capturing the largest and the smallest bucket on that cache; the other buckets are assumed to
cost what the smallest does (they share the largest's memory pool). Prompt logprobs over long
chunks are not profiled: their [tokens, vocab] float32 rows live in the (1 - utilization) margin.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from pagoda.errors import ConfigError
from pagoda.pooling_params import WARMUP_POOLING
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GIB = 1 << 30
_COSTLIEST_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=20)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes of device memory by use, measured at startup."""

    total: int  # the device's memory
    weights: int  # the model's parameters and buffers
    activation_peak: int  # above the weights, during the largest step (sampling included)
    cuda_graphs: int  # all buckets' graphs and their memory pool (0 when eager)
    non_torch: int  # used outside PyTorch's allocator: CUDA context, workspaces, other processes

    def describe(self) -> str:
        parts = ("total", "weights", "activation_peak", "cuda_graphs", "non_torch")
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f} GiB" for p in parts)


def kv_cache_num_blocks(profile: MemoryProfile, utilization: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` (all layers' keys and values of block_size tokens) that fit in
    utilization x total after everything else; block 0, never handed out, is among them."""
    used = profile.weights + profile.activation_peak + profile.cuda_graphs + profile.non_torch
    budget = int(profile.total * utilization) - used
    num_blocks = max(budget, 0) // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"No GPU memory is left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{profile.total * utilization / GIB:.2f} GiB and the rest takes {used / GIB:.2f} GiB "
            f"({profile.describe()}). Raise --gpu-memory-utilization, lower --max-num-batched-tokens "
            "or --max-num-seqs, use --enforce-eager, or quantize the weights."
        )
    return num_blocks


def profile(runner) -> MemoryProfile:
    """Measure `runner` (a ModelRunner with its weights loaded and no KV cache yet)."""
    logger.info("Profiling GPU memory with a dummy step")
    device = runner.device
    _release()
    weights = torch.cuda.memory_allocated(device)
    step, num_blocks = dummy_step(runner.config)
    runner.allocate_kv_cache(num_blocks)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(step)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    graphs = _graph_memory(runner) if runner.config.use_cuda_graphs else 0
    runner.kv_caches = []  # the throwaway cache goes; the real one is allocated from the result
    _release()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    result = MemoryProfile(total, weights, activation_peak, graphs, non_torch)
    logger.info("GPU memory: %s", result.describe())
    return result


def dummy_step(config):
    """The largest step the scheduler can form, as fresh prompts, and the KV blocks it needs
    (block 0 included). Returns (SchedulerOutput, num_blocks)."""
    from pagoda.core.outputs import SchedulerOutput

    s, bs = config.scheduler, config.cache.block_size
    max_prompt = config.model.max_model_len - 1
    num_reqs = min(s.max_num_seqs, s.max_num_batched_tokens)
    tokens = min(s.max_num_batched_tokens, num_reqs * max_prompt)
    gen = torch.Generator().manual_seed(0)
    pooling = None if config.pooler is None else WARMUP_POOLING
    scheduled, next_block = [], 1
    for i in range(num_reqs):
        n = tokens // num_reqs + (i < tokens % num_reqs)
        prompt = torch.randint(0, config.model.vocab_size, (n,), generator=gen).tolist()
        request = Request(
            f"profile-{i}", prompt, _COSTLIEST_SAMPLING, frozenset(), config.model.max_model_len, pooling=pooling
        )
        blocks = -(-n // bs)
        request.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append((request, n))
    return SchedulerOutput(tuple(scheduled), tokens), next_block


def _graph_memory(runner) -> int:
    """Capture the largest and the smallest bucket on the throwaway cache; extrapolate to all."""
    device = runner.device
    _release()
    free_before = torch.cuda.mem_get_info(device)[0]
    graphs = runner.make_graph_runner()
    graphs.capture(graphs.sizes[-1:])
    _release()
    largest = free_before - torch.cuda.mem_get_info(device)[0]
    estimate = largest
    if len(graphs.sizes) > 1:
        graphs.capture(graphs.sizes[:1])
        _release()
        smallest = free_before - torch.cuda.mem_get_info(device)[0] - largest
        estimate += max(smallest, 0) * (len(graphs.sizes) - 1)
    del graphs
    _release()
    return max(estimate, 0)


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
