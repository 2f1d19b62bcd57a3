"""A constrained request's grammar state, and the step's token bitmask that applies it. A request
is constrained by a structured-output grammar, a thinking budget, or both.

The scheduler advances each request's matcher with its sampled token (`accept_token`) and ends the
request when the grammar is complete (`is_terminated`); the model runner fills one bitmask row per
constrained request (`fill_bitmask`) and the sampler applies the rows to the logits.

With speculative decoding the scheduler cuts a request's drafts at the first the grammar refuses
(`valid_prefix`), and the runner fills one row per verified position (`fill_bitmasks`): row i holds
what the grammar allows after drafts 0..i-1. Both try the drafts and roll back, so the state only
ever advances by the tokens the scheduler appends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from pagoda.request import Request


class RequestGrammar:
    """One request's position in its output's grammar (each of n > 1 sequences has its own): the
    answer's (`compiled`, a structured-output constraint; None: any answer), and the thinking's.

    For a reasoning model the constraint applies to the answer only: with `think_end` set, the
    output thinks until those tokens appear. With `think_start` set too, it thinks only if it opens
    with those tokens: before its first token, the mask allows the constraint's tokens and the first
    token of `think_start`; once that is taken, the rest of `think_start` is forced (with no
    constraint, nothing is: an output that leaves the tag answers). A `budget` bounds the thinking:
    once it has taken that many tokens (the start tag not counted) without ending, the tokens of
    `think_end` are forced, one after another (vLLM's thinking_token_budget).
    """

    def __init__(
        self,
        compiled: Any | None,
        think_start: tuple[int, ...] = (),
        think_end: tuple[int, ...] = (),
        budget: int | None = None,
    ) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled) if compiled is not None else None
        self._think_start, self._think_end = think_start, think_end
        self._budget = budget
        self._opened = 0  # tokens of think_start taken so far
        self._thought = 0  # tokens of thinking so far
        self._closed = 0  # tokens of think_end forced so far
        # the thinking's last tokens, to spot think_end; rebound, never mutated (_tentative keeps a reference)
        self._recent: list[int] = []
        self._matched = 0  # tokens the matcher accepted (what `_tentative` rolls back is counted here)
        self._state = "answer"
        if think_end:
            self._state = "opening" if think_start else self._thinking()

    @property
    def decides_end(self) -> bool:
        """Whether the answer's constraint decides where the output ends (min_tokens yields to it)."""
        return self._matcher is not None

    @property
    def forcing(self) -> bool:
        """Whether the next token is forced (a tag's rest): no other setting may ban it."""
        return self._state == "closing" or (self._state == "opening" and self._opened > 0 and self._matcher is not None)

    def _thinking(self) -> str:
        """The state while thinking: "closing" once the budget is spent, the end tag's tokens the
        thinking already ends with (a tag the model has begun) counted as forced."""
        if self._budget is None or self._thought < self._budget:
            return "thinking"
        end = list(self._think_end)
        self._closed = next(k for k in range(len(end) - 1, -1, -1) if self._recent[len(self._recent) - k :] == end[:k])
        return "closing"

    def accept_token(self, token_id: int) -> bool:
        if self._state == "answer":
            return self._match(token_id)
        if self._state == "opening":
            if token_id != self._think_start[self._opened]:
                self._state = "answer"  # it answers at once: the constraint takes this token
                return self._match(token_id)
            self._opened += 1
            if self._opened == len(self._think_start):
                self._state = self._thinking()
            return True
        if self._state == "closing":
            if token_id != self._think_end[self._closed]:
                return False  # the mask forced another
            self._closed += 1
            if self._closed == len(self._think_end):
                self._state = "answer"
            return True
        self._thought += 1
        self._recent = (self._recent + [token_id])[-len(self._think_end) :]
        self._state = "answer" if self._recent == list(self._think_end) else self._thinking()
        return True

    def _match(self, token_id: int) -> bool:
        if self._matcher is None:
            return True
        accepted = bool(self._matcher.accept_token(token_id))
        self._matched += accepted
        return accepted

    def is_terminated(self) -> bool:
        return self._state == "answer" and self._matcher is not None and bool(self._matcher.is_terminated())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts one after another from here, none past one
        that completes it (a speculative proposal's part that may be verified). The state is
        left as it was."""
        n = 0
        with self._tentative():
            while n < len(tokens) and not self.is_terminated() and self.accept_token(tokens[n]):
                n += 1
        return n

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> list[int]:
        """Fill row `row + i` with the tokens allowed after drafts[:i], for i = 0..len(drafts):
        the masks of a verification's positions. Returns the rows masked; the state is left as it
        was. Rows past a draft the grammar refuses or one that completes it stay unmasked: the
        scheduler proposes no such drafts, and were one there, its own row (masked) rejects it,
        so no later row can decide a token."""
        masked = []
        with self._tentative():
            for i in range(len(drafts) + 1):
                if self.fill_bitmask(bitmask, row + i):
                    masked.append(row + i)
                if i == len(drafts) or not self.accept_token(drafts[i]) or self.is_terminated():
                    break
        return masked

    @contextmanager
    def _tentative(self) -> Iterator[None]:
        """Tokens accepted inside are rolled back on leaving."""
        saved = (self._state, self._opened, self._thought, self._closed, self._recent, self._matched)
        try:
            yield
        finally:
            if self._matcher is not None and self._matched > saved[-1]:
                self._matcher.rollback(self._matched - saved[-1])
            self._state, self._opened, self._thought, self._closed, self._recent, self._matched = saved

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Fill row `row` with the allowed tokens; False when nothing is masked (thinking, or an
        answer with no constraint)."""
        if self._state == "closing":
            bitmask[row] = 0
            token = self._think_end[self._closed]
            bitmask[row, token // 32] |= _bit(token % 32)
            return True
        if self._state == "thinking" or self._matcher is None:
            return False
        if self._state == "opening" and self._opened:
            bitmask[row] = 0
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._state == "opening":
            token = self._think_start[self._opened]
            bitmask[row, token // 32] |= _bit(token % 32)
        return True


@dataclass(frozen=True)
class TokenBitmask:
    """Allowed tokens of a step's constrained rows: one bit per token id (xgrammar's layout)."""

    bits: torch.Tensor  # int32 [num rows sampled this step, ceil(vocab / 32)], on the CPU
    rows: list[int]  # the constrained rows; the others are not masked
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits become -inf, in place."""
        bits = self.bits.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bits, vocab_size=self.vocab_size, indices=self.rows)


def step_bitmask(
    requests: Sequence[Request], vocab_size: int, drafts: Sequence[Sequence[int]] | None = None
) -> TokenBitmask | None:
    """The bitmask for the requests' rows this step, in order: one row per request sampling, or,
    with `drafts`, 1 + len(draft) rows per request verifying its drafts. None when none is masked."""
    drafts = drafts if drafts is not None else [()] * len(requests)
    bits = xgrammar.allocate_token_bitmask(sum(1 + len(d) for d in drafts), vocab_size)
    rows: list[int] = []
    start = 0
    for request, draft in zip(requests, drafts):
        grammar = request.grammar
        if isinstance(grammar, RequestGrammar):
            rows += grammar.fill_bitmasks(bits, start, draft)
        start += 1 + len(draft)
    return TokenBitmask(bits, rows, vocab_size) if rows else None


def _bit(position: int) -> int:
    """The int32 whose bit `position` alone is set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
