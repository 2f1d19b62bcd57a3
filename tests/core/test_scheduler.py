from __future__ import annotations

import pytest

from pagoda.core.outputs import SchedulerOutput
from pagoda.core.scheduler import LPM_MAX_SKIPS, QueueFullError, Scheduler
from pagoda.request import Request, RequestStatus

from .fake_engine import FakeEngine, make_request, make_scheduler, reference_output

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def ids(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(request.request_id, num_new) for request, num_new in output.scheduled]


def add(scheduler: Scheduler, request_id: str, prompt: list[int], **kwargs) -> Request:
    kwargs.setdefault("max_model_len", scheduler.config.max_model_len)
    request = make_request(request_id, prompt, **kwargs)
    scheduler.add_request(request)
    return request


def lookup(scheduler: Scheduler, request: Request) -> int:
    """Prompt tokens the prefix cache holds for `request`."""
    return len(scheduler.kv.find_prefix(request).blocks) * scheduler.kv.block_size


def constant(token: int):
    return lambda request: token


def script(**outputs: list[int]):
    """Each request samples its listed tokens in order."""
    return lambda request: outputs[request.request_id][request.num_output_tokens]


# ---- order and budget ------------------------------------------------------------------------


def test_fcfs_chunked_prefill_with_exact_chunks() -> None:
    s = make_scheduler(64, BS, max_num_batched_tokens=10)
    engine = FakeEngine(s, sample=constant(7))
    a = add(s, "a", tokens(25), max_tokens=2)
    b = add(s, "b", tokens(3, start=100), max_tokens=2)
    out = engine.step()
    assert ids(out) == [("a", 10)] and out.num_batched_tokens == 10
    assert a.num_computed_tokens == 10 and a.status is RequestStatus.RUNNING
    assert b.status is RequestStatus.WAITING and list(s.waiting) == [b]
    assert ids(engine.step()) == [("a", 10)]
    out = engine.step()
    assert ids(out) == [("a", 5), ("b", 3)] and out.num_batched_tokens == 8
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    assert ids(engine.step()) == [("a", 1), ("b", 1)]
    assert a.finish_reason == b.finish_reason == "length"
    assert s.num_unfinished == 0 and s.schedule().is_empty
    engine.check_all_released()


def test_a_budget_of_one_token_still_makes_progress() -> None:
    s = make_scheduler(64, BS, max_num_batched_tokens=1)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(3), max_tokens=2)
    b = add(s, "b", tokens(2), max_tokens=1)
    steps = [ids(engine.step()) for _ in range(6)]
    assert steps == [[("a", 1)], [("a", 1)], [("a", 1)], [("a", 1)], [("b", 1)], [("b", 1)]]
    assert a.is_finished and b.is_finished
    engine.check_all_released()


def test_prompt_tokens_are_bounded_while_requests_decode() -> None:
    """max_prefill_with_decodes caps the prompt tokens of a step that has decodes (running
    prefills and admissions alike); a step without decodes takes the whole budget."""
    s = make_scheduler(64, BS, max_num_batched_tokens=40, max_prefill_with_decodes=6)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(20), max_tokens=4)
    assert ids(engine.step()) == [("a", 20)]  # nothing decodes yet: the whole prompt at once
    add(s, "b", tokens(10, start=100), max_tokens=2)
    add(s, "c", tokens(4, start=200), max_tokens=2)
    out = engine.step()
    assert ids(out) == [("a", 1), ("b", 6)] and out.num_batched_tokens == 7
    assert ids(engine.step()) == [("a", 1), ("b", 4), ("c", 2)]  # b's rest and c's start share the 6
    assert ids(engine.step()) == [("a", 1), ("b", 1), ("c", 2)]
    engine.run_until_done()
    engine.check_all_released()


def test_a_short_prompt_gets_a_step_of_its_own_while_requests_decode() -> None:
    """With prefill_alone_threshold, a waiting prompt with at most that many tokens past its cached
    prefix runs alone, one prompt a step, the decodes in the next step; a longer one shares the
    decodes' step as before, and so does any prompt while nothing decodes."""
    s = make_scheduler(64, BS, max_num_batched_tokens=40, prefill_alone_threshold=6)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(9), max_tokens=8)
    add(s, "b", tokens(4, start=100), max_tokens=8)
    assert ids(engine.step()) == [("a", 9), ("b", 4)]  # nothing decodes yet: both share the step
    hit = add(s, "hit", tokens(8) + tokens(5, start=300), max_tokens=2)  # 8 cached, 5 to compute
    short = add(s, "short", tokens(6, start=200), max_tokens=2)
    long = add(s, "long", tokens(7, start=400), max_tokens=2)
    assert ids(engine.step()) == [("hit", 5)]  # the decodes wait one step
    assert hit.num_cached_tokens == 8 and hit.output_token_ids == [7]
    assert ids(engine.step()) == [("short", 6)]  # one prompt a step
    assert ids(engine.step()) == [("a", 1), ("b", 1), ("hit", 1), ("short", 1), ("long", 7)]
    assert long.num_cached_tokens == 0 and short.output_token_ids == [7, 7]
    engine.run_until_done()
    engine.check_all_released()


def test_at_most_two_prompts_alone_in_a_row_then_one_beside_the_decodes() -> None:
    """A burst of short prompts: two run alone, then a step built as usual gives the decodes their
    tokens and admits one more prompt beside them (not the whole rest: their first tokens then
    come one step apart instead of all at the end of one long step), and so on."""
    s = make_scheduler(64, BS, max_num_batched_tokens=40, prefill_alone_threshold=6)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(5), max_tokens=8)
    assert ids(engine.step()) == [("a", 5)]
    for i in range(5):
        add(s, f"p{i}", tokens(3, start=100 * (i + 1)), max_tokens=3)
    assert ids(engine.step()) == [("p0", 3)]
    assert ids(engine.step()) == [("p1", 3)]
    assert ids(engine.step()) == [("a", 1), ("p0", 1), ("p1", 1), ("p2", 3)]
    assert ids(engine.step()) == [("p3", 3)]
    assert ids(engine.step()) == [("p4", 3)]
    assert ids(engine.step()) == [("a", 1), ("p0", 1), ("p1", 1), ("p2", 1), ("p3", 1), ("p4", 1)]
    engine.run_until_done()
    engine.check_all_released()


def test_a_short_remainder_of_a_running_prompt_runs_alone() -> None:
    """A running prompt whose last chunk is within the threshold finishes alone; its earlier
    chunks, longer, shared the decodes' steps under max_prefill_with_decodes."""
    s = make_scheduler(64, BS, max_num_batched_tokens=40, max_prefill_with_decodes=8, prefill_alone_threshold=4)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(3), max_tokens=8)
    assert ids(engine.step()) == [("a", 3)]
    add(s, "p", tokens(11, start=100), max_tokens=2)
    assert ids(engine.step()) == [("a", 1), ("p", 8)]
    assert ids(engine.step()) == [("p", 3)]
    assert ids(engine.step()) == [("a", 1), ("p", 1)]
    engine.run_until_done()
    engine.check_all_released()


def test_a_prompt_alone_that_the_pool_cannot_hold_waits_for_a_usual_step() -> None:
    """Short of blocks, the prompt does not preempt to run alone: the step is built as usual (the
    decodes grow; the prompt is admitted once blocks are free)."""
    s = make_scheduler(4, BS, max_num_batched_tokens=40, prefill_alone_threshold=8)  # 3 usable blocks
    engine = FakeEngine(s, sample=constant(7))
    a = add(s, "a", tokens(2 * BS - 1), max_tokens=2)
    assert ids(engine.step()) == [("a", 2 * BS - 1)]
    b = add(s, "b", tokens(BS + 2, start=100), max_tokens=1)  # 2 blocks: only 1 is free
    assert ids(engine.step()) == [("a", 1)]
    assert a.is_finished and b.status is RequestStatus.WAITING
    assert ids(engine.step()) == [("b", BS + 2)]
    engine.run_until_done()
    engine.check_all_released()


def test_running_requests_come_first_then_admissions_in_order() -> None:
    """No decodes-first sort: the model runner orders its batch for the attention backends."""
    s = make_scheduler(64, BS, max_num_batched_tokens=100)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(9), max_tokens=1)
    engine.run_until_done()
    d = add(s, "d", tokens(3, start=50), max_tokens=5)
    assert ids(engine.step()) == [("d", 3)]
    add(s, "q", tokens(5, start=200), max_tokens=1)
    hit = add(s, "hit", tokens(9), max_tokens=1)  # 8 tokens cached: one token to compute
    out = engine.step()
    assert ids(out) == [("d", 1), ("q", 5), ("hit", 1)]
    assert hit.num_cached_tokens == 8
    engine.run_until_done()
    assert d.output_token_ids == [7] * 5


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make_scheduler(64, BS, max_num_seqs=2)
    engine = FakeEngine(s, sample=constant(7))
    a = add(s, "a", tokens(3), max_tokens=1)
    add(s, "b", tokens(3, start=10), max_tokens=3)
    c = add(s, "c", tokens(3, start=20), max_tokens=1)
    assert ids(engine.step()) == [("a", 3), ("b", 3)]
    assert a.is_finished and c.status is RequestStatus.WAITING
    assert ids(engine.step()) == [("b", 1), ("c", 3)]
    assert ids(engine.step()) == [("b", 1)]
    assert s.num_unfinished == 0
    engine.check_all_released()


# ---- preemption ------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_the_newest_request_is_preempted_and_resumes(caching: bool) -> None:
    # Capacity 4 blocks of 4: a lone max_model_len (16) request fits; two growing ones do not.
    s = make_scheduler(5, BS, caching, max_model_len=16)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(6), ignore_eos=True, max_tokens=6)
    b = add(s, "b", tokens(6, start=20), ignore_eos=True, max_tokens=6)
    assert ids(engine.step()) == [("a", 6), ("b", 6)]
    assert ids(engine.step()) == [("a", 1), ("b", 1)]  # position 6: still in the second block
    assert ids(engine.step()) == [("a", 1), ("b", 1)]  # position 7
    assert s.kv.pool.num_free == 0 and s.stats().num_preemptions == 0
    out = engine.step()  # position 8 needs a third block each: b (newest) goes
    assert ids(out) == [("a", 1)]
    assert s.stats().num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status is RequestStatus.WAITING and list(s.waiting) == [b] and s.running == [a]
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == reference_output(tokens(6, start=20), b.sampling_params, frozenset(), 16)[0][:3]
    if caching:
        # b's two full computed blocks were cached; a's growth evicted one of them.
        assert lookup(s, b) == 4
    else:
        assert s.kv.pool.num_free == 1
    engine.run_until_done()
    for request in (a, b):
        expected = reference_output(request.prompt_token_ids, request.sampling_params, frozenset(), 16)[0]
        assert request.output_token_ids == expected
    assert s.stats().num_preemptions == b.num_preemptions
    engine.check_all_released()


def test_the_request_that_cannot_grow_preempts_itself_when_it_is_the_newest() -> None:
    s = make_scheduler(5, BS, False, max_model_len=16)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(7), ignore_eos=True, max_tokens=5)
    b = add(s, "b", tokens(8, start=50), ignore_eos=True, max_tokens=2)
    assert ids(engine.step()) == [("a", 7), ("b", 8)]
    a_blocks = list(a.block_ids)
    # a's position 7 fits its second block; b's position 8 needs a third block and nobody is newer.
    assert ids(engine.step()) == [("a", 1)]
    assert b.num_preemptions == 1 and b.status is RequestStatus.WAITING and b.output_token_ids != []
    assert a.block_ids == a_blocks and s.running == [a]
    engine.run_until_done()
    assert a.num_preemptions == 0
    for request in (a, b):
        expected = reference_output(request.prompt_token_ids, request.sampling_params, frozenset(), 16)[0]
        assert request.output_token_ids == expected
    engine.check_all_released()


def test_no_admission_in_a_step_that_preempted_and_the_preempted_go_first() -> None:
    s = make_scheduler(5, BS, False, max_model_len=16, max_num_batched_tokens=8)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(4), ignore_eos=True, max_tokens=10)
    b = add(s, "b", tokens(8, start=50), ignore_eos=True, max_tokens=3)
    assert ids(engine.step()) == [("a", 4), ("b", 4)]
    assert ids(engine.step()) == [("a", 1), ("b", 4)]
    assert s.kv.pool.num_free == 0
    c = add(s, "c", tokens(4, start=90), max_tokens=1)
    # b's position 8 needs a third block: b, the newest, preempts itself. Its two blocks would hold
    # its next 7-token chunk, but re-admitting in the same step would only thrash.
    assert ids(engine.step()) == [("a", 1)]
    assert b.num_preemptions == 1 and s.kv.pool.num_free == 2
    assert list(s.waiting) == [b, c]  # the preempted request waits ahead of later arrivals
    assert ids(engine.step()) == [("a", 1), ("b", 7)]
    assert c.status is RequestStatus.WAITING


def test_a_preempted_request_resumes_from_its_cached_blocks() -> None:
    s = make_scheduler(7, BS, True, max_model_len=24)  # capacity 6 blocks
    engine = FakeEngine(s)
    a = add(s, "a", tokens(12), ignore_eos=True, max_tokens=4)
    b = add(s, "b", tokens(11, start=50), ignore_eos=True, max_tokens=3)
    assert ids(engine.step()) == [("a", 12), ("b", 11)]
    hits = s.stats().prefix_cache_hits
    assert ids(engine.step()) == [("a", 1)]  # a needs a fourth block: b is preempted
    assert b.num_preemptions == 1 and b.num_tokens == 12
    assert lookup(s, b) == 8  # its two full computed blocks stay cached
    # b's cached blocks would have to be locked and one more block found: it waits for a.
    assert ids(engine.step()) == [("a", 1)]
    assert ids(engine.step()) == [("a", 1)]
    assert a.finish_reason == "length"
    assert ids(engine.step()) == [("b", 4)]  # 8 tokens from the cache: 3 prompt + 1 output left
    assert b.num_computed_tokens == 12 and b.num_output_tokens == 2
    assert b.num_cached_tokens == 0 and s.stats().prefix_cache_hits == hits  # counted at first admission only
    engine.run_until_done()
    for request in (a, b):
        expected = reference_output(request.prompt_token_ids, request.sampling_params, frozenset(), 24)[0]
        assert request.output_token_ids == expected
    engine.check_all_released()


# ---- aborts ----------------------------------------------------------------------------------


def test_abort_a_waiting_request() -> None:
    s = make_scheduler(64, BS, max_num_seqs=1)
    engine = FakeEngine(s)
    add(s, "a", tokens(5), max_tokens=3)
    b = add(s, "b", tokens(5, start=9), max_tokens=3)
    engine.step()
    s.finish_requests([b.request_id], "abort")
    assert b.finish_reason == "abort" and b.is_finished and list(s.waiting) == []
    s.finish_requests([b.request_id], "abort")  # a second abort is a no-op
    assert b.finish_reason == "abort"
    engine.run_until_done()
    engine.check_all_released()


@pytest.mark.parametrize("caching", [True, False])
def test_abort_a_running_request_frees_its_blocks_at_once(caching: bool) -> None:
    s = make_scheduler(11, BS, caching)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(10), max_tokens=50, ignore_eos=True)
    engine.step()
    engine.step()
    assert len(a.block_ids) == 3 and s.kv.pool.num_free == 7
    s.finish_requests([a.request_id], "abort")
    assert a.finish_reason == "abort" and a.block_ids == [] and s.running == []
    assert s.kv.num_available == 10
    assert s.kv.pool.num_free == (8 if caching else 10)  # two full computed blocks stay cached
    s.kv.check_integrity(s.running)
    assert s.schedule().is_empty


def test_abort_mid_prefill_and_mid_step() -> None:
    s = make_scheduler(64, BS, max_num_batched_tokens=8)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(20), max_tokens=5)
    b = add(s, "b", tokens(3, start=30), max_tokens=2)
    engine.step()
    assert a.is_prefilling and a.num_computed_tokens == 8
    s.finish_requests([a.request_id], "abort")
    assert a.block_ids == [] and a.finish_reason == "abort"
    assert s.kv.cache.num_cached_blocks == 2  # its two computed blocks
    s.kv.check_integrity(s.running)
    assert ids(engine.step(abort_mid_step=(b,))) == [("b", 3)]
    # Aborted while the step ran: the step's result is dropped, nothing was appended.
    assert b.output_token_ids == [] and b.num_computed_tokens == 0 and b.finish_reason == "abort"
    assert s.num_unfinished == 0
    engine.check_all_released()


# ---- finishing -------------------------------------------------------------------------------


def run_one(prompt: list[int], outputs: list[int], eos=frozenset({2}), max_model_len: int = 64, **params) -> Request:
    s = make_scheduler(64, BS, max_model_len=max_model_len)
    engine = FakeEngine(s, sample=script(r=outputs))
    request = add(s, "r", prompt, eos=eos, **params)
    engine.run_until_done()
    engine.check_all_released()
    return request


def test_finish_on_eos() -> None:
    r = run_one(tokens(3), [5, 6, 2, 9], max_tokens=10)
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([5, 6, 2], "stop", None)


def test_finish_on_a_stop_token() -> None:
    r = run_one(tokens(3), [5, 6, 8, 9], max_tokens=10, stop_token_ids=[8])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([5, 6, 8], "stop", 8)


def test_finish_on_max_tokens() -> None:
    r = run_one(tokens(3), [5, 6, 7, 9], max_tokens=3)
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([5, 6, 7], "length", None)


def test_finish_at_max_model_len() -> None:
    r = run_one(tokens(5), [5] * 10, max_model_len=8, max_tokens=None)
    assert (r.output_token_ids, r.finish_reason, r.num_tokens) == ([5, 5, 5], "length", 8)


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    r = run_one(tokens(3), [2, 8, 6, 2, 9], max_tokens=10, min_tokens=3, stop_token_ids=[8])
    assert (r.output_token_ids, r.finish_reason) == ([2, 8, 6, 2], "stop")


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = run_one(tokens(3), [2, 2, 2, 2, 2], max_tokens=4, ignore_eos=True)
    assert (r.output_token_ids, r.finish_reason) == ([2, 2, 2, 2], "length")


def test_ignore_eos_still_honours_stop_tokens() -> None:
    r = run_one(tokens(3), [2, 8, 2], max_tokens=4, ignore_eos=True, stop_token_ids=[8])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([2, 8], "stop", 8)


def test_finish_from_outside() -> None:
    s = make_scheduler(64, BS, max_num_seqs=1)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(9), max_tokens=10, ignore_eos=True)
    b = add(s, "b", tokens(5, start=40), max_tokens=10)
    engine.step()
    s.finish_requests([a.request_id], "stop", "###")  # the engine matched a stop string in a's text
    assert (a.finish_reason, a.stop_reason, a.block_ids, s.running) == ("stop", "###", [], [])
    s.finish_requests([b.request_id], "stop", "!!")
    assert b.is_finished and list(s.waiting) == []
    s.finish_requests([a.request_id], "length")  # already finished: no-op
    assert a.finish_reason == "stop"
    s.kv.check_integrity(s.running)
    engine.check_all_released()


# ---- admission limits ------------------------------------------------------------------------


def test_a_prompt_without_room_for_output_is_rejected() -> None:
    s = make_scheduler(64, BS, max_model_len=32)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens.*requested 32 tokens"):
        add(s, "a", tokens(32))
    add(s, "b", tokens(31))
    assert len(s.waiting) == 1


def test_an_empty_prompt_is_rejected() -> None:
    s = make_scheduler(64, BS)
    with pytest.raises(ValueError, match="empty"):
        add(s, "a", [])
    assert s.num_unfinished == 0


def test_a_full_queue_refuses_requests() -> None:
    s = make_scheduler(64, BS, max_queue=2, max_num_seqs=1)
    engine = FakeEngine(s)
    add(s, "a", tokens(3))
    add(s, "b", tokens(3))
    with pytest.raises(QueueFullError, match="2 requests"):
        add(s, "c", tokens(3))
    assert len(s.waiting) == 2
    engine.step()  # a leaves the queue
    add(s, "c", tokens(3))
    assert [r.request_id for r in s.waiting] == ["b", "c"]


# ---- n > 1 groups ----------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_wait_for_the_parents_prompt_then_share_its_blocks(caching: bool) -> None:
    s = make_scheduler(64, BS, caching, max_num_batched_tokens=4)
    engine = FakeEngine(s)
    p = add(s, "p", tokens(10), max_tokens=3, ignore_eos=True)
    s1 = add(s, "s1", tokens(10), parent=p, max_tokens=3, ignore_eos=True)
    s2 = add(s, "s2", tokens(10), parent=p, max_tokens=3, ignore_eos=True)
    assert ids(engine.step()) == [("p", 4)]
    assert ids(engine.step()) == [("p", 4)]
    assert ids(engine.step()) == [("p", 2)]  # the siblings are not ready yet: budget left unused
    assert ids(engine.step()) == [("p", 1), ("s1", 2), ("s2", 1)]
    shared = p.block_ids[:2]
    assert s1.block_ids[:2] == shared and s2.block_ids[:2] == shared
    assert [s.kv.pool.ref_counts[b] for b in shared] == [3, 3]
    assert s1.num_cached_tokens == s2.num_cached_tokens == 8
    assert s.stats().prefix_cache_hits == 16
    engine.run_until_done()
    for request in (p, s1, s2):
        assert request.output_token_ids == reference_output(tokens(10), request.sampling_params, frozenset(), 64)[0]
    engine.check_all_released()


def test_a_sibling_of_an_aborted_parent_runs_on_its_own() -> None:
    s = make_scheduler(64, BS, False, max_num_batched_tokens=4)
    engine = FakeEngine(s)
    p = add(s, "p", tokens(10), max_tokens=3)
    sib = add(s, "s", tokens(10), parent=p, max_tokens=3)
    engine.step()
    s.finish_requests([p.request_id], "abort")
    assert ids(engine.step()) == [("s", 4)]
    engine.run_until_done()
    assert sib.finish_reason != "abort"
    engine.check_all_released()


# ---- longest-prefix-match policy -------------------------------------------------------------


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    s = make_scheduler(64, BS, max_num_seqs=1, policy="lpm")
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(12), max_tokens=1)
    engine.run_until_done()
    add(s, "none", tokens(9, start=100), max_tokens=1, arrival_time=1.0)
    add(s, "short", tokens(4) + tokens(5, start=200), max_tokens=1, arrival_time=2.0)
    add(s, "long", tokens(8) + tokens(5, start=300), max_tokens=1, arrival_time=3.0)
    add(s, "long2", tokens(8) + tokens(5, start=400), max_tokens=1, arrival_time=4.0)
    order = [ids(engine.step())[0][0] for _ in range(4)]
    assert order == ["long", "long2", "short", "none"]


def test_fcfs_ignores_cached_prefixes() -> None:
    s = make_scheduler(64, BS, max_num_seqs=1, policy="fcfs")
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(12), max_tokens=1)
    engine.run_until_done()
    add(s, "none", tokens(9, start=100), max_tokens=1)
    add(s, "long", tokens(8) + tokens(5, start=300), max_tokens=1)
    assert [ids(engine.step())[0][0] for _ in range(2)] == ["none", "long"]


def test_lpm_does_not_starve_a_request_without_a_cached_prefix() -> None:
    s = make_scheduler(256, BS, max_num_seqs=1, policy="lpm")
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(8), max_tokens=1)
    engine.run_until_done()
    loner = add(s, "loner", tokens(9, start=500), max_tokens=1, arrival_time=1.0)
    for i in range(LPM_MAX_SKIPS + 3):
        add(s, f"c{i}", tokens(8) + [600 + i], max_tokens=1, arrival_time=2.0 + i)
    order = []
    while s.num_unfinished:
        order.append(ids(engine.step())[0][0])
    assert order.index("loner") == LPM_MAX_SKIPS
    assert order[:LPM_MAX_SKIPS] == [f"c{i}" for i in range(LPM_MAX_SKIPS)]
    assert loner.num_skips == LPM_MAX_SKIPS
    engine.check_all_released()


def test_lpm_counts_a_skip_only_when_a_later_request_is_admitted() -> None:
    # The pool is full while "holder" runs: the best candidate (a long cached prefix) cannot be
    # admitted, and nobody is admitted ahead of "x". x must not build up skips meanwhile, or the
    # policy falls back to FCFS and x's admission evicts the prefix "y" was waiting for.
    bs = 32
    s = make_scheduler(5, bs, max_model_len=128, policy="lpm")  # capacity 4 blocks
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(64), max_tokens=1)
    engine.run_until_done()  # two cached blocks
    holder = add(s, "holder", tokens(33, start=1000), ignore_eos=True, max_tokens=LPM_MAX_SKIPS + 4)
    engine.step()
    x = add(s, "x", tokens(33, start=500), max_tokens=1, arrival_time=1.0)
    y = add(s, "y", tokens(64) + [9, 9, 9], max_tokens=1, arrival_time=2.0)
    while not holder.is_finished:
        assert ids(engine.step()) == [("holder", 1)]
    assert x.num_skips == 0
    assert ids(engine.step()) == [("y", 3)]
    assert y.num_cached_tokens == 64 and x.num_skips == 1
    assert ids(engine.step()) == [("x", 33)]
    engine.check_all_released()


# ---- prefix cache through the scheduler -------------------------------------------------------


def test_cached_prefix_is_reused_and_counted() -> None:
    s = make_scheduler(64, BS)
    engine = FakeEngine(s)
    a = add(s, "a", tokens(13), max_tokens=1)
    engine.run_until_done()
    b = add(s, "b", tokens(13), max_tokens=1)
    assert ids(engine.step()) == [("b", 1)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)
    assert (s.stats().prefix_cache_queries, s.stats().prefix_cache_hits) == (26, 12)
    assert b.output_token_ids == a.output_token_ids
    engine.check_all_released()
    assert s.kv.reset_prefix_cache()
    c = add(s, "c", tokens(13), max_tokens=1)
    engine.step()
    assert c.num_cached_tokens == 0


def test_a_lone_request_with_duplicate_blocks_is_not_preempted() -> None:
    # a and b compute the same prompt in one step; a's blocks enter the cache first, so b's are
    # duplicates. b adopts the cached copies and frees its own, so alone it never needs to
    # preempt itself for a third block of a pool that holds 4.
    s = make_scheduler(5, BS, True, max_model_len=16)
    engine = FakeEngine(s)
    add(s, "a", tokens(8), max_tokens=1)
    b = add(s, "b", tokens(8), max_tokens=7, ignore_eos=True)
    assert ids(engine.step()) == [("a", 8), ("b", 8)]
    assert ids(engine.step()) == [("b", 1)]
    assert b.num_preemptions == 0


def test_a_preempted_sibling_does_not_borrow_the_parents_blocks() -> None:
    s = make_scheduler(10, BS, False)
    p = add(s, "p", tokens(10), max_tokens=3)
    sib = add(s, "s", tokens(10), parent=p, max_tokens=3)
    FakeEngine(s).step()
    sib.num_preemptions = 1  # its output so far would follow the prompt: nothing of the parent fits it
    assert s._reusable_prefix(sib).blocks == ()
    sib.num_preemptions = 0
    assert s._reusable_prefix(sib).blocks == tuple(p.block_ids[:2])


def test_prompt_logprobs_reuse_nothing() -> None:
    s = make_scheduler(64, BS, max_num_seqs=1)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "warm", tokens(12), max_tokens=1)
    engine.run_until_done()
    scored = add(s, "scored", tokens(12), max_tokens=1, prompt_logprobs=0)
    assert lookup(s, scored) == 8
    assert ids(engine.step()) == [("scored", 12)]  # every prompt position computed, to score it
    assert scored.num_cached_tokens == 0


def test_update_returns_the_steps_outputs_with_the_counters() -> None:
    s = make_scheduler(64, BS, max_num_batched_tokens=6)
    engine = FakeEngine(s, sample=constant(7))
    a = add(s, "a", tokens(8), max_tokens=2)
    engine.step()  # a's first chunk: no token yet, no output
    assert engine.last_outputs.outputs == [] and engine.last_outputs.stats.num_running == 1
    engine.step()
    (out,) = engine.last_outputs.outputs
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("a", [7], None)
    assert out.metrics.num_prompt_tokens == 8 and out.metrics.first_token_time is not None
    engine.step()
    (out,) = engine.last_outputs.outputs
    assert out.finish_reason == "length" and a.is_finished
    stats = engine.last_outputs.stats
    assert (stats.num_running, stats.num_waiting, stats.num_steps, stats.prefix_cache_queries) == (0, 0, 3, 8)
    assert stats.prefix_cache_blocks == 2 and stats.kv_usage == 0.0


def test_the_runner_hears_of_finished_requests_in_the_next_step() -> None:
    s = make_scheduler(64, BS)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(4), max_tokens=1)
    b = add(s, "b", tokens(4, start=10), max_tokens=3)
    assert engine.step().finished_request_ids == frozenset()  # a finishes in this step
    s.finish_requests([b.request_id], "abort")
    assert s.schedule().is_empty  # an empty step keeps the news for the next real one
    c = add(s, "c", tokens(4, start=20), max_tokens=1)
    assert engine.step().finished_request_ids == {"a", "b"}
    assert c.is_finished


def test_a_request_id_already_in_the_engine_is_refused() -> None:
    s = make_scheduler(64, BS)
    add(s, "a", tokens(4), max_tokens=2)
    with pytest.raises(ValueError, match="already in the engine"):
        add(s, "a", tokens(4, start=9), max_tokens=2)


class RefusingGrammar:
    """A grammar that accepts tokens until it meets `refused` (the mask keeps this from happening)."""

    decides_end, forcing = True, False

    def __init__(self, refused: int) -> None:
        self.refused, self.accepted = refused, []

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.refused:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False


def test_a_token_the_grammar_refuses_ends_the_output_before_it() -> None:
    s = make_scheduler(64, BS)
    engine = FakeEngine(s, sample=script(a=[5, 6, 9, 7]))
    a = make_request("a", tokens(4), max_tokens=10)
    a.grammar = RefusingGrammar(refused=9)
    s.add_request(a)
    engine.run_until_done()
    assert a.output_token_ids == [5, 6] and a.grammar.accepted == [5, 6]
    assert a.finish_reason == "stop"
    (out,) = engine.last_outputs.outputs  # the client hears of the end
    assert out.new_token_ids == [] and out.finish_reason == "stop"
    engine.check_all_released()


def test_stats_count_computed_prompt_tokens_and_sampled_tokens() -> None:
    s = make_scheduler(64, BS, True, max_num_batched_tokens=10)
    engine = FakeEngine(s, sample=constant(7))
    add(s, "a", tokens(25), max_tokens=3, ignore_eos=True)
    engine.step()
    assert (s.stats().prompt_tokens, s.stats().generation_tokens) == (10, 0)  # a chunk: no token yet
    engine.run_until_done()
    assert (s.stats().prompt_tokens, s.stats().generation_tokens) == (25, 3)
    add(s, "b", tokens(25), max_tokens=2, ignore_eos=True)
    engine.run_until_done()
    hit = s.stats().prefix_cache_hits
    assert hit > 0 and s.stats().prompt_tokens == 25 + 25 - hit  # cached prompt tokens are not computed
    assert s.stats().generation_tokens == 5


def test_stats_name_the_lora_adapters_of_running_and_waiting_requests() -> None:
    from pagoda.lora import LoRAAdapter

    s = make_scheduler(64, BS, max_num_seqs=2)
    engine = FakeEngine(s, sample=constant(7))
    ft, other = (LoRAAdapter(name, i, f"/{name}", 8, {}) for i, name in enumerate(("ft", "other"), start=1))
    for request_id, lora in [("a", ft), ("b", None), ("c", ft), ("d", other)]:
        request = make_request(request_id, tokens(3), max_tokens=2)
        request.lora = lora
        s.add_request(request)
    assert (s.stats().running_lora_adapters, s.stats().waiting_lora_adapters) == ((), ("ft", "other"))
    engine.step()  # a and b run (two at most)
    assert (s.stats().running_lora_adapters, s.stats().waiting_lora_adapters) == (("ft",), ("ft", "other"))
    while s.num_unfinished:
        engine.step()
    assert (s.stats().running_lora_adapters, s.stats().waiting_lora_adapters) == ((), ())


def test_priority_policy_admits_the_lowest_priority_then_the_earliest() -> None:
    s = make_scheduler(64, BS, policy="priority", max_num_seqs=1)
    engine = FakeEngine(s, sample=constant(7))
    for request_id, priority in [("a", 5), ("b", 1), ("c", 1), ("d", -2)]:
        add(s, request_id, tokens(3), max_tokens=1).priority = priority
    order = [request.request_id for _ in range(4) for request, _ in engine.step().scheduled]
    assert order == ["d", "b", "c", "a"]


def test_priority_policy_preempts_the_highest_priority_value_not_the_newest() -> None:
    # As test_the_newest_request_is_preempted_and_resumes, but a (the oldest) has the highest value
    s = make_scheduler(5, BS, False, max_model_len=16, policy="priority")
    engine = FakeEngine(s)
    a = add(s, "a", tokens(6), ignore_eos=True, max_tokens=6)
    b = add(s, "b", tokens(6, start=20), ignore_eos=True, max_tokens=6)
    a.priority = 3
    for _ in range(3):
        engine.step()
    out = engine.step()  # position 8 needs a third block each: a goes, not b
    assert ids(out) == [("b", 1)] and a.num_preemptions == 1 and b.num_preemptions == 0
    assert list(s.waiting) == [a] and s.running == [b]
    engine.run_until_done()
    for request in (a, b):
        expected = reference_output(request.prompt_token_ids, request.sampling_params, frozenset(), 16)[0]
        assert request.output_token_ids == expected
    engine.check_all_released()
