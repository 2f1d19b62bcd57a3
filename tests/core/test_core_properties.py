"""Property-based tests: random workloads through the real scheduler, KV manager, radix cache and
block pool, driven by the fake engine. The fake model's token is a pure function of the history, so
every request must produce exactly the reference output whatever the pool size, block size, budget,
policy, caching, chunking and preemption did to it."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.request import Request

from .fake_engine import VOCAB, FakeEngine, make_request, make_scheduler, reference_output

EOS = frozenset({0})


@dataclass(frozen=True)
class Spec:
    """One request group of a workload: its prompt, sampling knobs, arrival and abort steps."""

    prompt: tuple[int, ...]
    n: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    arrival_step: int
    abort_step: int | None  # aborts the group's first request (and, if mid_step, during a step)
    abort_mid_step: bool


@dataclass(frozen=True)
class Workload:
    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_with_decodes: int | None
    prefill_alone_threshold: int | None
    policy: str
    specs: tuple[Spec, ...]


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_model_len = draw(st.integers(8, 80))
    # The engine's contract: the pool holds at least one max_model_len request.
    min_capacity = -(-max_model_len // block_size)
    num_blocks = 1 + draw(st.integers(min_capacity, 3 * min_capacity))
    tokens = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(tokens, max_size=40), min_size=1, max_size=3))
    specs = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        prompt = (prefix + draw(st.lists(tokens, max_size=20)))[: max_model_len - 1] or [1]
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 30)))
        min_tokens = draw(st.integers(0, min(3, max_tokens or 3)))
        abort_step = draw(st.one_of(st.none(), st.none(), st.integers(0, 40)))
        specs.append(
            Spec(
                prompt=tuple(prompt),
                n=draw(st.integers(1, 3)),
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                ignore_eos=draw(st.booleans()),
                stop_token_ids=tuple(draw(st.lists(tokens, max_size=2))),
                arrival_step=draw(st.integers(0, 20)),
                abort_step=abort_step,
                abort_mid_step=draw(st.booleans()),
            )
        )
    return Workload(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_prefill_with_decodes=draw(st.one_of(st.none(), st.integers(1, 16))),
        prefill_alone_threshold=draw(st.one_of(st.none(), st.integers(1, 24))),
        policy=draw(st.sampled_from(["fcfs", "lpm"])),
        specs=tuple(specs),
    )


def run_workload(w: Workload, caching: bool, num_blocks: int | None = None) -> tuple[list[Request], FakeEngine]:
    """Runs a workload to the end; returns the requests, group by group, in arrival order."""
    scheduler = make_scheduler(
        num_blocks or w.num_blocks,
        w.block_size,
        caching,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        policy=w.policy,
        max_prefill_with_decodes=w.max_prefill_with_decodes,
        prefill_alone_threshold=w.prefill_alone_threshold,
    )
    engine = FakeEngine(scheduler)
    groups: list[list[Request]] = []
    for i, spec in enumerate(w.specs):
        parent = None
        group = []
        for j in range(spec.n):
            request = make_request(
                f"{i}.{j}",
                list(spec.prompt),
                w.max_model_len,
                EOS,
                parent=parent,
                max_tokens=spec.max_tokens,
                min_tokens=spec.min_tokens,
                ignore_eos=spec.ignore_eos,
                stop_token_ids=spec.stop_token_ids,
            )
            parent = parent or request
            group.append(request)
        groups.append(group)
    requests = [r for g in groups for r in g]
    max_steps = 50 + 4 * sum(len(s.prompt) + w.max_model_len for s in w.specs for _ in range(s.n))
    while engine.steps <= max(s.arrival_step for s in w.specs) or scheduler.num_unfinished:
        for spec, group in zip(w.specs, groups):
            if spec.arrival_step == engine.steps:
                for request in group:
                    scheduler.add_request(request)
        mid_step = []
        for spec, group in zip(w.specs, groups):
            if spec.abort_step == engine.steps and spec.arrival_step <= engine.steps:
                if spec.abort_mid_step:
                    mid_step.append(group[0])
                else:
                    scheduler.finish_requests([group[0].request_id], "abort")
                    engine.kv.check_integrity(scheduler.running)
        engine.step(tuple(mid_step))
        assert engine.steps < max_steps, "the scheduler did not finish its requests (livelock?)"
    engine.check_all_released()
    return requests, engine


def check_outputs(w: Workload, requests: list[Request]) -> None:
    index = 0
    for spec in w.specs:
        for j in range(spec.n):
            request = requests[index]
            index += 1
            expected, reason, stop_reason = reference_output(
                list(spec.prompt), request.sampling_params, EOS, w.max_model_len
            )
            assert request.is_finished and not request.block_ids
            assert request.prompt_token_ids == list(spec.prompt)
            if request.finish_reason == "abort":
                assert j == 0 and spec.abort_step is not None
                assert request.output_token_ids == expected[: request.num_output_tokens]
                continue
            assert request.output_token_ids == expected, f"request {request.request_id}"
            assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_reference(w: Workload) -> None:
    for caching in (True, False):
        requests, _ = run_workload(w, caching)
        check_outputs(w, requests)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_outputs_independent_of_pool_size_and_caching(w: Workload) -> None:
    runs = [run_workload(w, caching)[0] for caching in (True, False)]
    num_requests = sum(spec.n for spec in w.specs)
    ample = 1 + num_requests * -(-w.max_model_len // w.block_size)
    runs.append(run_workload(w, True, num_blocks=ample)[0])
    outputs = [[(r.output_token_ids, r.finish_reason) for r in run] for run in runs]
    aborted = {i for i, r in enumerate(runs[0]) if r.finish_reason == "abort"}
    for run in outputs[1:]:
        for i, (got, want) in enumerate(zip(run, outputs[0])):
            if i not in aborted and got[1] != "abort":
                assert got == want
