"""A constrained request's grammar state, and the step's token bitmask that applies it.

The scheduler advances each request's matcher with its sampled token (`accept_token`) and ends the
request when the grammar is complete (`is_terminated`); the model runner fills one bitmask row per
constrained request (`fill_bitmask`) and the sampler applies the rows to the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from pagoda.request import Request


class RequestGrammar:
    """One request's position in its grammar (each of n > 1 sequences has its own)."""

    def __init__(self, compiled: Any) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


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


def step_bitmask(requests: Sequence[Request], vocab_size: int) -> TokenBitmask:
    """The bitmask for the requests sampling this step, in order (at least one is constrained)."""
    rows = [i for i, request in enumerate(requests) if request.grammar is not None]
    bits = xgrammar.allocate_token_bitmask(len(requests), vocab_size)
    for i in rows:
        grammar = requests[i].grammar
        assert isinstance(grammar, RequestGrammar)
        grammar.fill_bitmask(bits, i)
    return TokenBitmask(bits, rows, vocab_size)
