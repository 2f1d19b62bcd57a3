"""A fake engine for the core's tests: it steps a scheduler, "runs the model" by writing each
scheduled token into a simulated paged KV store, and samples a token that is a pure function of the
request's token history. No torch.

Because the sampled token depends only on the history, caching, chunking and preemption must not
change any request's output; `reference_output` is the oracle.

The simulated KV store also checks the cache's content: before a request computes its new tokens,
every earlier token's slot (block_ids[t // block_size], t % block_size) must hold that token, so a
wrong prefix hit, a block overwritten while shared, or a block reused while still read shows up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput, StepOutputs
from pagoda.core.radix_cache import RadixCache
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

VOCAB = 16


def fake_token(token_ids: list[int]) -> int:
    """The fake model: a deterministic mix of the history's length and last three tokens."""
    h = len(token_ids)
    for token in token_ids[-3:]:
        h = (h * 1_000_003 + token * 7919 + 1) % 2**31
    return h % VOCAB


def reference_output(
    prompt: list[int], params: SamplingParams, eos: frozenset[int], max_model_len: int
) -> tuple[list[int], str, int | None]:
    """What an unconstrained engine generates: (output tokens, finish reason, stop reason)."""
    tokens, out = list(prompt), []
    while True:
        token = fake_token(tokens)
        tokens.append(token)
        out.append(token)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and token in eos:
                return out, "stop", None
            if token in params.stop_token_ids:
                return out, "stop", token
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, "length", None
        if len(tokens) >= max_model_len:
            return out, "length", None


def make_request(
    request_id: str,
    prompt: list[int],
    max_model_len: int = 64,
    eos: frozenset[int] = frozenset(),
    parent: Request | None = None,
    arrival_time: float | None = None,
    **params,
) -> Request:
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(request_id, list(prompt), SamplingParams(**params), eos, max_model_len, parent=parent, **extra)


def make_scheduler(
    num_blocks: int,
    block_size: int,
    caching: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 64,
    policy: str = "fcfs",
    max_queue: int | None = None,
    max_prefill_with_decodes: int | None = None,
    prefill_alone_threshold: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    config = SchedulerConfig(
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        policy,
        max_queue,
        max_prefill_with_decodes,
        prefill_alone_threshold,
    )
    return Scheduler(config, kv)


@dataclass
class FakeEngine:
    """Steps a scheduler with fake model outputs and checks every invariant after every step."""

    scheduler: Scheduler
    sample: Callable[[Request], int] = lambda request: fake_token(request.token_ids)
    slots: dict[int, list[int | None]] = field(default_factory=dict)  # block -> token in each slot
    steps: int = 0
    last_outputs: StepOutputs = field(default_factory=StepOutputs)

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def step(self, abort_mid_step: tuple[Request, ...] = ()) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.check_output(output)
        sampled = [self.run_model(request, num_new) for request, num_new in output.scheduled]
        for request in abort_mid_step:  # the step is "on the device" while the client goes away
            self.scheduler.finish_requests([request.request_id], "abort")
        none = [None] * len(sampled)
        self.last_outputs = self.scheduler.update(output, ModelRunnerOutput(sampled, none, none))
        self.kv.check_integrity(self.scheduler.running)
        self.steps += 1
        return output

    def run_until_done(self, max_steps: int = 10_000) -> None:
        while self.scheduler.num_unfinished:
            self.step()
            assert self.steps < max_steps, "the scheduler did not finish its requests (livelock?)"

    def run_model(self, request: Request, num_new: int) -> int | None:
        """Check the KV the request reads, write its new tokens' KV, sample if it reached its end."""
        bs = self.kv.block_size
        start = request.num_computed_tokens
        for pos in range(start):
            block = request.block_ids[pos // bs]
            got = self.slots.get(block, [None] * bs)[pos % bs]
            assert got == request.token_ids[pos], (
                f"request {request.request_id} reads token {got} at position {pos} (block {block}), "
                f"expected {request.token_ids[pos]}"
            )
        for pos in range(start, start + num_new):
            block = request.block_ids[pos // bs]
            self.slots.setdefault(block, [None] * bs)[pos % bs] = request.token_ids[pos]
        if start + num_new == request.num_tokens:
            return self.sample(request)
        return None

    def check_output(self, output: SchedulerOutput) -> None:
        config = self.scheduler.config
        sizes = [num_new for _, num_new in output.scheduled]
        assert output.num_batched_tokens == sum(sizes) <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len(self.scheduler.running) <= config.max_num_seqs
        requests = [request for request, _ in output.scheduled]
        assert len({id(r) for r in requests}) == len(requests), "a request scheduled twice in one step"
        running = {id(r) for r in self.scheduler.running}
        for request, num_new in output.scheduled:
            assert id(request) in running
            assert num_new >= 1
            assert request.num_computed_tokens + num_new <= request.num_tokens
            assert len(request.block_ids) >= self.kv.blocks_for(request.num_computed_tokens + num_new)
            assert 0 not in request.block_ids, "the null block was handed to a request"

    def check_all_released(self) -> None:
        """After everything finished: no block is owned; every block is free or cached and idle."""
        pool, cache = self.kv.pool, self.kv.cache
        self.kv.check_integrity([])
        assert pool.ref_counts == [0] * pool.num_blocks
        assert not self.kv._locked and not self.scheduler.requests
        num_cached = cache.num_cached_blocks
        assert pool.num_free + num_cached == pool.capacity
        assert cache.num_evictable_blocks == num_cached
        if isinstance(cache, RadixCache):
            assert cache.root.lock_ref == 1
