"""Speculative decoding, the runner's side: verifying a request's draft tokens against the target
model's logits at the 1 + k positions it computed (its last token, then each draft).

Greedy requests accept the longest prefix of drafts equal to the target's argmax, then take the
argmax after it: exactly the tokens decoding one at a time would give.

Sampled requests draw each position's token as decoding one at a time would: the sampler's own
draw for that row (temperature, top-k, top-p, min-p) with the request's next uniform, one uniform a
position, drawn only as far as tokens are emitted. Draft i is accepted where that token equals it,
and the first token that differs is the one emitted there. So every emitted token is the token
plain decoding emits with the same uniforms: distributed exactly as the target's, and for a seeded
request the very same tokens with speculation on or off, whatever the load (a batch too large to
speculate decodes one at a time). An n-gram or draft-model draft is one token, so draft i is
accepted with probability p_i(d), as rejection sampling would accept it.

A constrained request's rows are masked by its grammar first (row i: the tokens allowed after
drafts 0..i-1), so argmax and the sampler see what plain decoding would at that position;
logprobs stay the model's, before the mask, as the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.model_executor.sampler import Sampler, token_logprob
from pagoda.request import Request, TokenLogprob

if TYPE_CHECKING:  # xgrammar is imported only where a request is constrained
    from pagoda.structured.grammar import TokenBitmask


@dataclass(frozen=True)
class Verified:
    accepted: list[int]  # the drafts accepted, a prefix of the proposal
    token: int  # the target's own token after them
    logprobs: list[TokenLogprob | None]  # of accepted + [token], from the target (None: not asked)


def verify(
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[list[int]],
    sampler: Sampler,
    bitmask: TokenBitmask | None = None,
) -> list[Verified]:
    """logits [sum(1 + len(d)), V]: each request's rows in order, row j scoring the token after
    its j-th query token; `sampler`: the one plain decoding draws with (its generators, its
    kernels); `bitmask`: the allowed tokens of constrained requests' rows. Returns each request's
    verdict."""
    allowed = logits
    if bitmask is not None:
        allowed = logits.float().clone()
        bitmask.apply(allowed)
    greedy_tokens = allowed.argmax(dim=-1).tolist()
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + len(draft) + 1)
    results = []
    for request, draft, start in zip(requests, drafts, starts):
        rows = logits[start : start + len(draft) + 1]
        params = request.sampling_params
        if params.greedy:
            accepted, token = _greedy(greedy_tokens[start : start + len(draft) + 1], draft)
        else:
            accepted, token = _sampled(allowed[start : start + len(draft) + 1], draft, request, sampler)
        logprobs: list[TokenLogprob | None] = [None] * (len(accepted) + 1)
        if params.logprobs is not None:
            raw = torch.log_softmax(rows[: len(accepted) + 1].float(), dim=-1)
            logprobs = [token_logprob(raw[j], t, params.logprobs) for j, t in enumerate([*accepted, token])]
        results.append(Verified(accepted, token, logprobs))
    return results


def _greedy(targets: list[int], draft: list[int]) -> tuple[list[int], int]:
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return draft[:n], targets[n]


def _sampled(rows: torch.Tensor, draft: list[int], request: Request, sampler: Sampler) -> tuple[list[int], int]:
    """rows [1 + k, V]: the target's (masked) logits at each position. Each position's token is the
    sampler's own for that row alone, one uniform each, until one differs from its draft (the
    logprobs are verify's, of the unmasked rows, so the sampler computes none)."""
    for i, d in enumerate(draft):
        token = sampler.sample(rows[i : i + 1], [request], with_logprobs=False).token_ids[0]
        if token != d:
            return draft[:i], token
    return list(draft), sampler.sample(rows[len(draft) :], [request], with_logprobs=False).token_ids[0]
