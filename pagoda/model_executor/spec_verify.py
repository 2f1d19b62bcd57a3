"""Speculative decoding, the runner's side: verifying a request's draft tokens against the target
model's logits at the 1 + k positions it computed (its last token, then each draft).

Greedy requests accept the longest prefix of drafts equal to the target's argmax, then take the
argmax after it: exactly the tokens decoding one at a time would give.

Sampled requests use rejection sampling, so that every emitted token is distributed exactly as the
target's (after temperature, top-k, top-p, min-p). An n-gram draft is a point mass q = 1 at draft
token d, so draft i is accepted with probability min(1, p_i(d) / q(d)) = p_i(d); on rejection the
token is drawn from the residual max(p_i - q, 0) normalized, which is p_i with d removed. When every
draft is accepted, one more token is drawn from p_k. A seeded request draws all of this from its
own generator, so it is reproducible (not equal to its output without speculation).

A constrained request's rows are masked by its grammar first (row i: the tokens allowed after
drafts 0..i-1), so both rules see the distribution the sampler would draw from at that position;
logprobs stay the model's, before the mask, as the sampler's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.model_executor.sampler import draw, filtered_probs, token_logprob
from pagoda.request import Request, TokenLogprob

if TYPE_CHECKING:  # xgrammar is imported only where a request is constrained
    from pagoda.structured.grammar import TokenBitmask

GeneratorOf = Callable[[Request, torch.device], torch.Generator]


@dataclass(frozen=True)
class Verified:
    accepted: list[int]  # the drafts accepted, a prefix of the proposal
    token: int  # the target's own token after them
    logprobs: list[TokenLogprob | None]  # of accepted + [token], from the target (None: not asked)


def verify(
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[list[int]],
    generator_of: GeneratorOf,
    bitmask: TokenBitmask | None = None,
) -> list[Verified]:
    """logits [sum(1 + len(d)), V]: each request's rows in order, row j scoring the token after
    its j-th query token; `bitmask`: the allowed tokens of constrained requests' rows. Returns
    each request's verdict."""
    allowed = logits
    if bitmask is not None:
        allowed = logits.float().clone()
        bitmask.apply(allowed)
    greedy_tokens = allowed.argmax(dim=-1).tolist()
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + len(draft) + 1)
    probs = _target_probs(allowed, requests, starts)
    results = []
    for request, draft, start in zip(requests, drafts, starts):
        rows = logits[start : start + len(draft) + 1]
        params = request.sampling_params
        if params.greedy:
            accepted, token = _greedy(greedy_tokens[start : start + len(draft) + 1], draft)
        else:
            accepted, token = _rejection_sample(probs[start : start + len(draft) + 1], draft, request, generator_of)
        logprobs: list[TokenLogprob | None] = [None] * (len(accepted) + 1)
        if params.logprobs is not None:
            raw = torch.log_softmax(rows[: len(accepted) + 1].float(), dim=-1)
            logprobs = [token_logprob(raw[j], t, params.logprobs) for j, t in enumerate([*accepted, token])]
        results.append(Verified(accepted, token, logprobs))
    return results


def _target_probs(logits: torch.Tensor, requests: Sequence[Request], starts: list[int]) -> torch.Tensor:
    """The sampled requests' target distributions, all their rows in one call (rows of greedy
    requests are left zero)."""
    probs = torch.zeros_like(logits, dtype=torch.float32)
    rows = [j for i, r in enumerate(requests) if not r.sampling_params.greedy for j in range(starts[i], starts[i + 1])]
    if rows:
        owners = [r.sampling_params for i, r in enumerate(requests) for _ in range(starts[i], starts[i + 1])]
        index = torch.tensor(rows, device=logits.device)
        probs[index] = filtered_probs(logits[index].float(), [owners[j] for j in rows])
    return probs


def _greedy(targets: list[int], draft: list[int]) -> tuple[list[int], int]:
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return draft[:n], targets[n]


def _rejection_sample(
    probs: torch.Tensor, draft: list[int], request: Request, generator_of: GeneratorOf
) -> tuple[list[int], int]:
    """probs [1 + k, V]: the target's distribution at each position."""
    generator = generator_of(request, probs.device) if request.sampling_params.seed is not None else None

    def sample(row: torch.Tensor) -> int:
        return int(draw(row[None], torch.rand(1, dtype=torch.float64, generator=generator, device=row.device))[0])

    uniforms = torch.rand(len(draft), generator=generator, device=probs.device).tolist()
    for i, (d, u) in enumerate(zip(draft, uniforms)):
        if u >= float(probs[i, d]):  # rejected: sample the residual, p_i without d
            residual = probs[i].clone()
            residual[d] = 0.0
            return draft[:i], sample(residual)
    return list(draft), sample(probs[len(draft)])
