"""KV cache sizing on a GPU as arithmetic, and the profiling step it measures, run on CPU."""

from __future__ import annotations

import pytest

from pagoda.config import CacheConfig
from pagoda.errors import ConfigError
from pagoda.model_executor.gpu_memory import MemoryProfile, dummy_step, kv_cache_num_blocks

GIB = 1 << 30


def test_blocks_are_what_utilization_leaves():
    profile = MemoryProfile(
        total=100 * GIB, weights=16 * GIB, activation_peak=2 * GIB, cuda_graphs=GIB // 2, non_torch=GIB
    )
    block = 2 * 16 * 8 * 128 * 2 * 32  # Llama-3-8B, bf16, 16 tokens: 2 MiB
    assert kv_cache_num_blocks(profile, 0.9, block) == int(70.5 * GIB) // block
    assert kv_cache_num_blocks(profile, 1.0, block) == int(80.5 * GIB) // block


def test_other_processes_count_against_the_budget():
    alone = MemoryProfile(100 * GIB, 16 * GIB, 2 * GIB, 0, GIB)
    shared = MemoryProfile(100 * GIB, 16 * GIB, 2 * GIB, 0, 31 * GIB)  # 30 GiB held by another process
    assert kv_cache_num_blocks(shared, 0.9, GIB) == kv_cache_num_blocks(alone, 0.9, GIB) - 30


@pytest.mark.parametrize("utilization", [0.2, 0.19])
def test_nothing_left_is_a_config_error(utilization):
    profile = MemoryProfile(total=100 * GIB, weights=16 * GIB, activation_peak=2 * GIB, cuda_graphs=GIB, non_torch=GIB)
    with pytest.raises(ConfigError, match="No GPU memory is left for the KV cache.*weights 16.00 GiB"):
        kv_cache_num_blocks(profile, utilization, 2 * GIB)  # 0.2: room for one block, and block 0 is reserved


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_must_be_a_fraction(utilization):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=utilization)


class _Config:
    """The fields of EngineConfig that dummy_step reads."""

    def __init__(self, max_num_seqs, max_num_batched_tokens, max_model_len, block_size=16, vocab=1000):
        from types import SimpleNamespace

        self.scheduler = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.cache = SimpleNamespace(block_size=block_size)
        self.model = SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab)
        self.pooler = None  # the generate runner


@pytest.mark.parametrize(
    "seqs,tokens,max_len,expect_reqs,expect_tokens",
    [(256, 8192, 2048, 256, 8192), (256, 100, 2048, 100, 100), (1, 8192, 2048, 1, 2047), (4, 1000, 100, 4, 396)],
)
def test_dummy_step_is_the_largest_step_the_scheduler_can_form(seqs, tokens, max_len, expect_reqs, expect_tokens):
    step, num_blocks = dummy_step(_Config(seqs, tokens, max_len))
    lens = [n for _, n in step.scheduled]
    assert len(lens) == expect_reqs and sum(lens) == expect_tokens == step.num_batched_tokens
    assert max(lens) - min(lens) <= 1 and max(lens) < max_len
    blocks = [b for r, _ in step.scheduled for b in r.block_ids]
    assert sorted(blocks) == list(range(1, num_blocks))  # disjoint, block 0 left out
    for request, n in step.scheduled:
        assert len(request.block_ids) * 16 >= n == request.num_prompt_tokens
        assert request.sampling_params.top_p < 1 and request.sampling_params.uses_penalties


def test_dummy_step_runs_through_the_runner(tiny_llama):
    """The profiling step (every request sampling the costliest way) on a real runner, on CPU."""
    from pagoda.engine.args import EngineArgs
    from pagoda.model_executor.model_runner import ModelRunner

    config = EngineArgs(str(tiny_llama), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256).create_config()
    runner = ModelRunner(config)
    step, num_blocks = dummy_step(config)
    runner.allocate_kv_cache(num_blocks)
    out = runner.execute(step)
    assert len(out.token_ids) == 8 and all(t is not None for t in out.token_ids)
    assert all(lp is not None and len(lp.top) == 20 for lp in out.logprobs)


class FakeCuda:
    """torch.cuda's memory queries, scripted: `free` drops by what each graph capture costs."""

    def __init__(self, total=80 * GIB, allocated=10 * GIB, peak=13 * GIB, reserved=11 * GIB):
        self.total, self.free, self.allocated, self.peak, self.reserved = (
            total,
            total - 12 * GIB,
            allocated,
            peak,
            reserved,
        )

    def install(self, monkeypatch):
        import pagoda.model_executor.gpu_memory as gm

        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(gm.torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(gm.torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(gm.torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(gm.torch.cuda, "memory_reserved", lambda *a: self.reserved)
        monkeypatch.setattr(gm.torch.cuda, "mem_get_info", lambda *a: (self.free, self.total))


class FakeGraphs:
    def __init__(self, cuda: FakeCuda, sizes, cost):
        self.cuda, self.sizes, self.cost = cuda, sizes, cost

    def capture(self, sizes):
        for size in sizes:
            self.cuda.free -= self.cost[size]


def test_graph_memory_is_the_largest_plus_the_smallest_for_each_other_bucket(monkeypatch):
    from types import SimpleNamespace

    from pagoda.model_executor.gpu_memory import _graph_memory

    cuda = FakeCuda()
    cuda.install(monkeypatch)
    sizes = (1, 2, 4, 8, 16)
    runner = SimpleNamespace(device="cuda", make_graph_runner=lambda: FakeGraphs(cuda, sizes, {16: 300, 1: 7}))
    assert _graph_memory(runner) == 300 + 7 * 4


def test_profile_runs_the_dummy_step_and_drops_its_cache(monkeypatch, tiny_llama):
    from pagoda.engine.args import EngineArgs
    from pagoda.model_executor import gpu_memory
    from pagoda.model_executor.model_runner import ModelRunner

    config = EngineArgs(str(tiny_llama), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128).create_config()
    runner = ModelRunner(config)
    executed = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda step: executed.append(step) or execute(step))
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    profile = gpu_memory.profile(runner)
    assert len(executed) == 1 and len(executed[0].scheduled) == 4 and executed[0].num_batched_tokens == 32
    assert runner.kv_caches == []  # the throwaway cache is gone; the real one comes next
    assert profile == MemoryProfile(
        total=80 * GIB, weights=10 * GIB, activation_peak=3 * GIB, cuda_graphs=0, non_torch=GIB
    )
