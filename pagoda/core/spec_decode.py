"""Speculative decoding, the scheduler's side: n-gram prompt lookup proposes draft tokens, and the
counters of how many were accepted. Pure Python.

A step that speculates for a decoding request computes 1 + k query tokens for it: its last token
and k drafts. The runner verifies them (pagoda/model_executor/spec_verify.py) and returns the
accepted drafts followed by one token of its own, so every step still yields at least one token.
Only verified tokens ever count as computed: the KV of rejected drafts lies past
`num_computed_tokens`, is overwritten by the next step, and never reaches the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.config import SpeculativeConfig
from pagoda.request import Request


def ngram_proposal(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the longest earlier occurrence (of min_n..max_n tokens) of the
    sequence's own suffix; among equally long matches the most recent wins. [] if none."""
    length = len(tokens)
    if length <= min_n:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    # candidates: earlier positions holding the last token, newest first (the suffix itself excluded)
    for end in range(length - 2, -1, -1):
        if tokens[end] != last:
            continue
        n = 1
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_end = n, end
            if n == max_n:
                break
    if best_len < min_n:
        return []
    return list(tokens[best_end + 1 : best_end + 1 + k])


class Proposer:
    """Drafts for decoding requests, bounded so that they never run past what a request may still
    generate (max_tokens, max_model_len). A method implements `draft` (one request) or
    `draft_batch` (all of a step's requests at once); the scheduler calls `propose` while it
    schedules and `finished` when a request ends or is preempted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts by request id, at most num_speculative_tokens each, for those of `requests`
        that can speculate. A constrained request's drafts end before the first its grammar
        refuses and after one that completes it: the rest could never be accepted."""
        wanted = [(r, k) for r in requests if (k := self._num_drafts(r)) > 0]
        drafts = self.draft_batch(wanted) if wanted else {}
        for request, _ in wanted:
            draft = drafts.get(request.request_id)
            if draft and request.grammar is not None:
                drafts[request.request_id] = draft[: request.grammar.valid_prefix(draft)]
        return drafts

    def _num_drafts(self, request: Request) -> int:
        decoding = not request.is_prefilling and request.num_tokens - request.num_computed_tokens == 1
        if not decoding or not can_speculate(request):
            return 0
        room = request.max_model_len - request.num_tokens
        if request.sampling_params.max_tokens is not None:
            room = min(room, request.sampling_params.max_tokens - request.num_output_tokens)
        return min(self.config.num_speculative_tokens, room - 1)  # the step's own token needs room too

    def draft_batch(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k guesses of each request's next tokens, for each (request, k) in `wanted`."""
        return {request.request_id: self.draft(request, k) for request, k in wanted}

    def draft(self, request: Request, k: int) -> list[int]:
        """Up to k guesses of the request's next tokens."""
        raise NotImplementedError

    def finished(self, request_id: str) -> None:
        """The request ended or was preempted: drop what the proposer keeps for it."""

    def check_integrity(self) -> None:
        """Assert the invariants of what the proposer keeps (the tests call it every step)."""


class NgramProposer(Proposer):
    def draft(self, request: Request, k: int) -> list[int]:
        c = self.config
        # the window bounds the search's cost on long sequences; a match further back is rarely useful
        window = request.token_ids[-SEARCH_WINDOW:]
        return ngram_proposal(window, k, c.prompt_lookup_min, c.prompt_lookup_max)


SEARCH_WINDOW = 4096  # trailing tokens searched for a match


def can_speculate(request: Request) -> bool:
    """Requests whose next tokens can be verified position by position from the target's logits
    and, for a constrained request, its grammar's mask at each position (the runner fills one per
    draft). Penalties and an active min_tokens change the distribution with each accepted token,
    and a logit bias, allowed tokens and bad words are applied by the sampler alone; those requests
    decode one token at a time (min_tokens does not act on a constrained request: its grammar
    decides where it ends)."""
    params = request.sampling_params
    return (
        not params.uses_penalties
        and not params.edits_logits
        and ((request.grammar and request.grammar.decides_end) or request.num_output_tokens >= params.min_tokens)
    )


@dataclass
class SpecCounters:
    """Cumulative counts, as vLLM's spec-decode metrics: drafts (requests that speculated in a
    step), draft tokens proposed, accepted drafts, and acceptances per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
