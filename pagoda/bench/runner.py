"""The load generator: sends a session stream at one concurrency level and collects exchanges.

Concurrency bounds the sessions in progress (for single-turn workloads, the requests in
flight, as vLLM's --max-concurrency); a multi-turn session keeps its slot through its think
times, like a user in a conversation. With a request rate, sessions start at Poisson arrival
times (gamma-distributed gaps when bursty) and still wait for a free slot.

A request whose tool calls are graded can be sent again without streaming once its level is
over (`resend_whole`), so that its calls can be compared with the streamed ones; the re-sends
count in no timing, as the level's clock stopped at its last streamed completion.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from pagoda.bench.client import StreamResult, Target, WholeResult, request_body, stream_request, whole_request
from pagoda.bench.datasets import Prompt, Session, next_turn
from pagoda.bench.metrics import RequestRecord
from pagoda.bench.schemas import grade
from pagoda.bench.tokens import LazyTokenizer
from pagoda.bench.tool_calls import compare_calls, grade_calls


@dataclass(frozen=True)
class Load:
    concurrency: int
    request_rate: float = math.inf  # sessions started per second; inf: as fast as slots free up
    burstiness: float = 1.0  # gamma shape of the arrival gaps; 1 is Poisson, below 1 burstier
    duration_s: float | None = None  # no session or turn due after this starts


@dataclass(frozen=True)
class Exchange:
    index: int  # send order within the level
    session: int
    turn: int
    prompt: Prompt
    result: StreamResult
    finished_at: float  # time.perf_counter() clock, as the result's times
    whole: WholeResult | None = None  # the same request answered without streaming, when re-sent


def arrival_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """Seconds to the next session start: gamma with mean 1/rate (vLLM's arrival model)."""
    if math.isinf(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def run_level(
    http: aiohttp.ClientSession,
    target: Target,
    stream: Iterable[Session],
    load: Load,
    rng: random.Random,
    exchanges: list[Exchange],
    on_done: Callable[[], None] = lambda: None,
) -> float:
    """Send every session of `stream`, appending each finished exchange to `exchanges` (so an
    interruption keeps what finished). Returns the level's start on the perf_counter clock."""
    slots = asyncio.Semaphore(load.concurrency)
    start = time.perf_counter()
    deadline = start + load.duration_s if load.duration_s else math.inf
    sender = _Sender(http, target, itertools.count(), exchanges, on_done, deadline)
    next_start = start
    async with asyncio.TaskGroup() as group:
        for number, session in enumerate(stream):
            if next_start >= deadline:  # due after the duration
                break
            await asyncio.sleep(max(0.0, next_start - time.perf_counter()))
            # A session due within the duration starts however late this client wakes for it (so
            # a seeded run sends the same sessions on a slow machine), unless it waits for a slot:
            # then it is due when one frees, which may be past the duration.
            waits_for_slot = slots.locked()
            await slots.acquire()
            if waits_for_slot and time.perf_counter() >= deadline:
                slots.release()
                break
            group.create_task(sender.run(number, session, slots))
            next_start += arrival_gap(rng, load.request_rate, load.burstiness)
    return start


@dataclass(frozen=True)
class _Sender:
    http: aiohttp.ClientSession
    target: Target
    indices: itertools.count[int]
    exchanges: list[Exchange]
    on_done: Callable[[], None]
    deadline: float

    async def run(self, number: int, session: Session, slots: asyncio.Semaphore) -> None:
        try:
            prompt, reply = session.first, ""
            for turn in range(session.num_requests):
                if turn:
                    due = time.perf_counter() + session.think_time_s
                    if due >= self.deadline:
                        return
                    await asyncio.sleep(session.think_time_s)
                    prompt = next_turn(prompt, reply, session.follow_ups[turn - 1])
                index = next(self.indices)
                result = await stream_request(self.http, self.target, prompt)
                reply = result.text
                self.exchanges.append(Exchange(index, number, turn, prompt, result, time.perf_counter()))
                self.on_done()
                if result.error:
                    return
        finally:
            slots.release()


def compares_calls(exchange: Exchange, target: Target) -> bool:
    """Whether an exchange is re-sent without streaming: it completed, its calls are graded, and
    it was sent at temperature 0, where both answers should be the same."""
    prompt = exchange.prompt
    return (
        exchange.result.error is None and prompt.tools is not None and request_body(prompt, target)["temperature"] == 0
    )


async def resend_whole(
    http: aiohttp.ClientSession, target: Target, exchanges: Sequence[Exchange], concurrency: int
) -> list[Exchange]:
    """`exchanges` with the non-streamed answer attached to those `compares_calls` picks, sent
    `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def again(exchange: Exchange) -> Exchange:
        if not compares_calls(exchange, target):
            return exchange
        async with slots:
            return replace(exchange, whole=await whole_request(http, target, exchange.prompt))

    return list(await asyncio.gather(*(again(x) for x in exchanges)))


def to_record(
    exchange: Exchange, level_start: float, tokenizer: LazyTokenizer, keep_text: bool = False
) -> RequestRecord:
    """Timing from the stream; token counts from the server's usage, else the tokenizer, else
    (no tokenizer) one token per text chunk; the answer graded when the prompt has a schema or
    expects tool calls, and its calls compared with the non-streamed answer's when there is one;
    its text kept where `keep_text`."""
    result = exchange.result
    common = dict(
        index=exchange.index, session=exchange.session, turn=exchange.turn, start_s=result.sent_at - level_start
    )
    if result.error is not None:
        return RequestRecord(
            **common,
            ttft_s=None,
            latency_s=None,
            itl_s=(),
            prompt_tokens=None,
            output_tokens=None,
            token_source="none",
            error=result.error,
        )
    times = result.token_times
    output_tokens, source = result.completion_tokens, "usage"
    if output_tokens is None:
        tok = tokenizer.get()
        output_tokens, source = (len(tok.encode(result.text)), "tokenizer") if tok else (len(times), "chunks")
    return RequestRecord(
        **common,
        ttft_s=times[0] - result.sent_at,
        latency_s=times[-1] - result.sent_at,
        itl_s=tuple(later - earlier for earlier, later in itertools.pairwise(times)),
        prompt_tokens=_prompt_tokens(exchange, tokenizer),
        output_tokens=output_tokens,
        token_source=source,
        **_graded(exchange),
        output_text=result.answer if keep_text else None,
    )


def _graded(exchange: Exchange) -> dict[str, Any]:
    result, cut = exchange.result, exchange.result.finish_reason == "length"
    graded: dict[str, Any] = {}
    schema = exchange.prompt.schema
    if schema is not None:
        problem = grade(result.answer, schema, cut)
        graded |= {"schema_valid": problem is None, "schema_error": problem}
    tools = exchange.prompt.tools
    if tools is not None:
        problem = grade_calls(result.tool_calls, tools, cut)
        graded |= {"tool_calls_valid": problem is None, "tool_calls_error": problem}
    whole = exchange.whole
    if whole is not None:
        difference = f"the request without streaming failed: {whole.error}" if whole.error else None
        difference = difference or compare_calls(result.tool_calls, whole.tool_calls)
        graded |= {"tool_calls_agree": difference is None, "tool_calls_difference": difference}
    return graded


def _prompt_tokens(exchange: Exchange, tokenizer: LazyTokenizer) -> int | None:
    if exchange.result.prompt_tokens is not None:
        return exchange.result.prompt_tokens
    if exchange.prompt.token_ids is not None:
        return len(exchange.prompt.token_ids)
    tok = tokenizer.get()
    return len(tok.prompt_ids(exchange.prompt.body)) if tok else None
