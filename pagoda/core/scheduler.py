"""Iteration-level scheduling under one token budget per step. Pure Python.

There is no prefill phase: every step, running requests get their next tokens (one for a decode,
a chunk for a prefill) in arrival order, then waiting requests are admitted while the budget,
`max_num_seqs` and the KV pool allow. When a running request cannot grow, the newest running
request is preempted by recompute: its blocks are released (what it computed stays in the prefix
cache) and it waits at the head of the queue, its output so far kept. Under the priority policy
(vLLM's) waiting requests are admitted lowest `priority` first (then earliest), and the running
request preempted is the one of the highest priority value (then the latest) among those not yet
given tokens this step.

One exception to mixing (`prefill_alone_threshold`): while requests decode, a prompt with few
tokens left to compute (a short prompt, or a prefix-cache hit's remainder) runs in a step of its
own, one prompt a step. On a CPU a step costs about its rows' compute, so the decodes' rows and
attention would add to that prompt's time to first token as much as it then delays them: alone,
its first token costs its own rows only, and prompts that arrive together finish one after another
instead of all at the end of one longer step. At most PROMPTS_ALONE_IN_A_ROW such steps follow each
other; the step built as usual after them admits at most one new prompt beside the decodes, so a
burst of short prompts goes on one a step (two alone, one beside the decodes, ..) and no decode
waits longer than two short steps and its own.

The scheduler owns every request's state (status, computed tokens, blocks, outputs); the KV cache
manager hands it blocks and the model runner reads the step it is given.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import (
    STEP_TOKEN_BOUNDS,
    CoreOutput,
    ModelRunnerOutput,
    RequestMetrics,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from pagoda.core.prefix_cache import PrefixMatch
from pagoda.core.spec_decode import Proposer, SpecCounters
from pagoda.pooling_params import too_long
from pagoda.request import Request, RequestStatus, TokenLogprob

LPM_WINDOW = 128  # waiting requests the longest-prefix-match policy looks at
LPM_MAX_SKIPS = 16  # a request passed over this often is admitted next (no starvation)
# consecutive steps of a prompt alone before one built as usual (which then admits one prompt at
# most): requests that ended in the same step send their next prompts together, and these then
# run one after the other
PROMPTS_ALONE_IN_A_ROW = 2


class QueueFullError(RuntimeError):
    pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.kv = kv
        self.proposer = proposer  # None: no speculative decoding
        self._spec = SpecCounters()
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # ended since the last step handed to the runner
        self._num_preemptions = 0
        self._prompts_alone = 0  # steps of a prompt alone since the last step built as usual
        self._num_steps = 0
        self._prompt_tokens = 0  # prompt tokens computed (prefix-cache hits are not computed)
        self._generation_tokens = 0  # tokens sampled
        self._step_token_counts = [0] * (len(STEP_TOKEN_BOUNDS) + 1)  # SchedulerStats.step_token_counts
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._lora_requests = 0  # unfinished requests that run a LoRA adapter

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens == 0:
            raise ValueError("The prompt is empty: at least one prompt token is needed to generate from.")
        if request.pooling is not None and request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                too_long(request.num_prompt_tokens, self.config.max_model_len)
            )  # no room for output needed
        if request.pooling is None and request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {request.num_prompt_tokens} tokens in the prompt, leaving no room for output."
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if self.config.max_queue is not None and len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
        self.waiting.append(request)
        self.requests[request.request_id] = request
        self._lora_requests += request.lora is not None

    def finish_requests(self, request_ids: list[str], reason: str, stop_reason: int | str | None = None) -> None:
        """End requests from outside the step: "abort" (the client went away) or "stop" (a stop
        string matched in the text). Unknown or already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.stop_reason = stop_reason
            self._finish(request, reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while any request is unfinished."""
        return not self.num_unfinished and self.kv.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            prefix_cache_blocks=self.kv.cache.num_cached_blocks,
            num_steps=self._num_steps,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            step_token_counts=tuple(self._step_token_counts),
            spec_num_drafts=self._spec.num_drafts,
            spec_num_draft_tokens=self._spec.num_draft_tokens,
            spec_num_accepted_tokens=self._spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(self._spec.accepted_per_position),
            running_lora_adapters=self._adapter_names(self.running),
            waiting_lora_adapters=self._adapter_names(self.waiting),
        )

    def _adapter_names(self, requests: Iterable[Request]) -> tuple[str, ...]:
        """The LoRA adapters the requests run, each once, in the requests' order."""
        if not self._lora_requests:
            return ()
        return tuple(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        capped = self._prompts_alone >= PROMPTS_ALONE_IN_A_ROW
        alone = None if capped else self._schedule_prompt_alone()
        if alone is not None:
            self._prompts_alone += 1
            finished, self._finished_ids = frozenset(self._finished_ids), []
            return SchedulerOutput((alone,), alone[1], finished)
        self._prompts_alone = 0
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        scheduled: list[tuple[Request, int]] = []
        drafts: dict[str, list[int]] = {}
        speculate = self.proposer is not None and len(self.running) <= self.proposer.config.max_batch_size
        # drafted for every decoding request at once (a draft model runs them as one batch); a
        # request's drafts are cut to the step's budget where it takes them
        proposals = self.proposer.propose(self.running) if speculate else {}
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget) if remaining == 1 else min(remaining, budget, prefill_budget)
            if num_new == 0:  # a prefill, and this step's prompt tokens are spent
                index += 1
                continue
            draft = proposals.get(request.request_id, [])[: budget - 1]  # budget >= 1 here
            num_new += len(draft)
            while (blocks := self.kv.grow(request, num_new)) is None:
                if draft:  # drafts are the first thing to give up when the pool is short
                    num_new -= len(draft)
                    draft = []
                    continue
                victim = self.running.pop(self._victim(index))
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                request.block_ids += blocks
                scheduled.append((request, num_new))
                if draft:
                    drafts[request.request_id] = draft
                budget -= num_new
                if remaining > 1:
                    prefill_budget -= num_new
                index += 1
        if not preempted:
            # after prompts alone, one more beside the decodes: a burst's rest would otherwise all
            # wait for one long step (6 hits beside 2 decodes: TTFT p50 0.64x, benchmarks/prompt_burst.py)
            self._admit_waiting(scheduled, min(budget, prefill_budget), 1 if capped else len(self.waiting))
        if not scheduled:
            return SchedulerOutput((), 0)
        finished, self._finished_ids = frozenset(self._finished_ids), []
        num_tokens = sum(n for _, n in scheduled)
        return SchedulerOutput(tuple(scheduled), num_tokens, finished, drafts)

    def _schedule_prompt_alone(self) -> tuple[Request, int] | None:
        """The prompt that gets this step to itself, with its tokens to compute, its blocks taken:
        while a running request decodes, the first running prompt if it has at most
        prefill_alone_threshold tokens left, else (no prompt running) the next waiting request if
        its tokens past its reusable prefix are that few. None: the step is built as usual."""
        threshold = self.config.prefill_alone_threshold
        if threshold is None or not self._any_decoding():
            return None
        threshold = min(threshold, self.config.max_num_batched_tokens)
        prompt = next((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1), None)
        if prompt is not None:
            remaining = prompt.num_tokens - prompt.num_computed_tokens
            if remaining > threshold or (blocks := self.kv.grow(prompt, remaining)) is None:
                return None
            prompt.block_ids += blocks
            return prompt, remaining
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        request, passed_over = self._next_waiting()
        if request is None:
            return None
        prefix = self._reusable_prefix(request)
        if request.num_tokens - len(prefix.blocks) * self.kv.block_size > threshold:
            return None
        num_new = self._admit(request, prefix, threshold, passed_over)
        return None if num_new is None else (request, num_new)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may take: max_prefill_with_decodes while a running request
        decodes, else the whole step budget."""
        cap = self.config.max_prefill_with_decodes
        if cap is not None and self._any_decoding():
            return cap
        return self.config.max_num_batched_tokens

    def _any_decoding(self) -> bool:
        """Whether a running request has one token to compute: it decodes this step (an embedding
        request's last prompt token is no decode)."""
        return any(r.num_tokens - r.num_computed_tokens == 1 and r.pooling is None for r in self.running)

    def update(self, step: SchedulerOutput, result: ModelRunnerOutput) -> StepOutputs:
        """Apply a step's results: computed tokens advance and sampled tokens are appended.
        Returns the progress of every request that got a token, finished or got prompt logprobs,
        in the step's order, with the counters after the step."""
        now = time.monotonic()
        outputs = []
        tokens_before = self._prompt_tokens + self._generation_tokens
        embeddings = result.embeddings or [None] * len(step.scheduled)
        for i, ((request, num_new), token, logprob, prompt_logprobs, embedding) in enumerate(
            zip(step.scheduled, result.token_ids, result.logprobs, result.prompt_logprobs, embeddings)
        ):
            if request.is_finished:  # ended from outside while the step ran
                continue
            self._prompt_tokens += max(0, min(num_new, request.num_prompt_tokens - request.num_computed_tokens))
            tokens: list[int] = [] if token is None else [token]
            logprobs: list[TokenLogprob | None] = [logprob]
            num_drafts = len(step.draft_token_ids.get(request.request_id, ()))
            if num_drafts:
                assert result.accepted_drafts is not None and result.accepted_logprobs is not None
                accepted = result.accepted_drafts[i]
                self._spec.record(num_drafts, len(accepted))
                num_new -= num_drafts - len(accepted)  # rejected drafts' KV is not computed: rolled back
                tokens, logprobs = accepted + tokens, result.accepted_logprobs[i] + logprobs
            request.num_computed_tokens += num_new
            if prompt_logprobs:
                request.num_prompt_logprobs += len(prompt_logprobs)
            new_tokens, new_logprobs = self._append(request, tokens, logprobs, now)
            if not request.is_finished:
                request.block_ids = self.kv.cache_blocks(request)
            if embedding is not None:  # an embedding request's prompt is computed: its answer
                request.first_token_time = now
                self.running.remove(request)
                self._finish(request, "stop")
            if new_tokens or prompt_logprobs is not None or request.is_finished:
                outputs.append(_core_output(request, new_tokens, new_logprobs, prompt_logprobs, embedding))
        self._num_steps += 1
        step_tokens = self._prompt_tokens + self._generation_tokens - tokens_before
        self._step_token_counts[bisect.bisect_left(STEP_TOKEN_BOUNDS, step_tokens)] += 1
        return StepOutputs(outputs, self.stats())

    def _append(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprob | None], now: float
    ) -> tuple[list[int], list[TokenLogprob]]:
        """Append a step's tokens one at a time, as many as the request takes before it stops
        (an accepted draft may be followed by a stop token, or reach max_tokens). Returns those
        tokens and their logprobs."""
        appended: list[int] = []
        kept: list[TokenLogprob] = []
        for token, logprob in zip(tokens, logprobs):
            if request.grammar is not None and not request.grammar.accept_token(token):
                # the mask makes this unreachable; were it reached, the output ends before it
                self.running.remove(request)
                self._finish(request, "stop")
                break
            self._generation_tokens += 1
            request.append_token(token)
            appended.append(token)
            if logprob is not None:
                kept.append(logprob)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.check_stop()
            if reason is not None:
                # tokens after the stop were computed but are not the request's: no KV beyond its tokens
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                self.running.remove(request)
                self._finish(request, reason)
                break
        return appended, kept

    # ---- helpers ---------------------------------------------------------------------------
    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int, most: int) -> None:
        """Admits waiting requests, at most `most` of them, while the budget, max_num_seqs and the
        pool allow."""
        for _ in range(most):
            if not (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
                break
            request, passed_over = self._next_waiting()
            if request is None:
                break
            num_new = self._admit(request, self._reusable_prefix(request), budget, passed_over)
            if num_new is None:
                break
            scheduled.append((request, num_new))
            budget -= num_new

    def _admit(
        self, request: Request, prefix: PrefixMatch[object], budget: int, passed_over: list[Request]
    ) -> int | None:
        """Moves a waiting request to running from its reusable prefix, with up to `budget` tokens
        to compute this step; returns how many, or None (it stays waiting) if the pool cannot hold them."""
        num_reused = len(prefix.blocks) * self.kv.block_size
        num_new = min(request.num_tokens - num_reused, budget)
        blocks = self.kv.admit(request.request_id, prefix, num_reused + num_new)
        if blocks is None:
            return None
        for earlier in passed_over:
            earlier.num_skips += 1
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.block_ids = blocks
        request.num_computed_tokens = num_reused
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_reused
            self._prefix_queries += request.num_prompt_tokens
            self._prefix_hits += num_reused
        self.running.append(request)
        return num_new

    def _reusable_prefix(self, request: Request) -> PrefixMatch[object]:
        """KV blocks a waiting request can start from: a prefix-cache hit, else (caching off) the
        prompt blocks its n > 1 sibling computed."""
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixMatch(())  # every prompt position must be computed to score it
        if request.pooling is not None and request.pooling.every_row:
            return PrefixMatch(())  # every prompt position must be computed to pool it
        hit = self.kv.find_prefix(request)
        parent = request.parent
        if hit.blocks or parent is None or not parent.block_ids or request.num_preemptions:
            return hit
        shareable = min(parent.num_computed_tokens, request.num_prompt_tokens - 1) // self.kv.block_size
        return PrefixMatch(tuple(parent.block_ids[:shareable]))

    def _victim(self, index: int) -> int:
        """Where the running request to preempt for running[index] (itself among them) is: of those
        not given tokens this step, the newest, or under the priority policy the one of the highest
        priority value, then the latest."""
        if self.config.policy != "priority":
            return len(self.running) - 1
        candidates = range(index, len(self.running))
        return max(candidates, key=lambda i: (self.running[i].priority, self.running[i].arrival_time))

    def _next_waiting(self) -> tuple[Request | None, list[Request]]:
        """The request to admit next, and the earlier arrivals it would pass over (whose skips
        count only if it is in fact admitted)."""
        ready = [r for r in self.waiting if _ready(r)]
        if not ready:
            return None, []
        if self.config.policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival_time)), []
        if self.config.policy == "fcfs" or ready[0].num_skips >= LPM_MAX_SKIPS:
            return ready[0], []
        window = ready[:LPM_WINDOW]
        best = max(window, key=lambda r: (len(self.kv.find_prefix(r).blocks), -window.index(r)))
        return best, [r for r in window if r is not best and r.arrival_time < best.arrival_time]

    def _preempt(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.finished(request.request_id)
        self.kv.free(request)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self._num_preemptions += 1

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.proposer is not None:
            self.proposer.finished(request.request_id)
        self.kv.free(request)
        request.block_ids = []
        del self.requests[request.request_id]
        self._lora_requests -= request.lora is not None
        self._finished_ids.append(request.request_id)


def _core_output(
    request: Request,
    tokens: list[int],
    logprobs: list[TokenLogprob],
    prompt_logprobs: list[TokenLogprob] | None,
    embedding: list[float] | None = None,
) -> CoreOutput:
    return CoreOutput(
        request_id=request.request_id,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        metrics=RequestMetrics(
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            num_preemptions=request.num_preemptions,
        ),
        prompt_logprobs=prompt_logprobs,
        embedding=embedding,
    )


def _ready(request: Request) -> bool:
    """An n>1 sibling waits until the first of its group has computed the shared prompt."""
    parent = request.parent
    return parent is None or parent.is_finished or not parent.is_prefilling
