"""Iteration-level scheduling under one token budget per step. Pure Python.

There is no prefill phase: every step, running requests get their next tokens (one for a decode,
a chunk for a prefill) in arrival order, then waiting requests are admitted while the budget,
`max_num_seqs` and the KV pool allow. When a running request cannot grow, the newest running
request is preempted by recompute: its blocks are released (what it computed stays in the prefix
cache) and it waits at the head of the queue, its output so far kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request, RequestStatus

LPM_WINDOW = 128  # waiting requests the longest-prefix-match policy looks at
LPM_MAX_SKIPS = 16  # a request passed over this often is admitted next (no starvation)


class QueueFullError(RuntimeError):
    pass


@dataclass(frozen=True)
class SchedulerOutput:
    """The requests of one step and how many new tokens each computes; decodes (1 token) first."""

    scheduled: tuple[tuple[Request, int], ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens == 0:
            raise ValueError("The prompt is empty: at least one prompt token is needed to generate from.")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {request.num_prompt_tokens} tokens in the prompt, leaving no room for output."
            )
        if self.config.max_queue is not None and len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, "abort")

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.grow(request, num_new):
                self._preempt(self.running.pop())
                preempted = True
                if index >= len(self.running):
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        return SchedulerOutput(tuple(scheduled), self.config.max_num_batched_tokens - budget)

    def update(self, output: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Apply a step's results: computed tokens advance and sampled tokens are appended.
        Returns the requests that got a token or finished, in the step's order."""
        now = time.monotonic()
        changed = []
        for (request, num_new), token in zip(output.scheduled, sampled):
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_new
            if token is None:
                self.kv.cache_computed_blocks(request)
                continue
            request.append_token(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = request.check_stop()
            if reason is None:
                self.kv.cache_computed_blocks(request)
            else:
                self.running.remove(request)
                self._finish(request, reason)
            changed.append(request)
        return changed

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running request from outside the step (a stop string matched in its text)."""
        if request.is_finished:
            return
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)

    # ---- helpers ---------------------------------------------------------------------------
    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request, passed_over = self._next_waiting()
            if request is None:
                break
            num_new = self.kv.admit(request, budget)
            if num_new is None:
                break
            for earlier in passed_over:
                earlier.num_skips += 1
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _next_waiting(self) -> tuple[Request | None, list[Request]]:
        """The request to admit next, and the earlier arrivals it would pass over (whose skips
        count only if it is in fact admitted)."""
        ready = [r for r in self.waiting if _ready(r)]
        if not ready:
            return None, []
        if self.config.policy == "fcfs" or ready[0].num_skips >= LPM_MAX_SKIPS:
            return ready[0], []
        window = ready[:LPM_WINDOW]
        best = max(window, key=lambda r: (self.kv.lookup(r), -window.index(r)))
        return best, [r for r in window if r is not best and r.arrival_time < best.arrival_time]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request)


def _ready(request: Request) -> bool:
    """An n>1 sibling waits until the first of its group has computed the shared prompt."""
    parent = request.parent
    return parent is None or parent.is_finished or not parent.is_prefilling
