"""Turning a step's logits into tokens: penalties, logit bias, min_tokens, temperature, top-k,
top-p, min-p, and sampling, batched over rows without per-token Python loops.

Sampling inverts each row's cumulative distribution at one float64 uniform (`draw`), which draws
exactly from p (to float64 rounding) and needs one random number a row: the exponential race
(argmax of p / E, E ~ Exp(1)) needs one per vocabulary entry, and torch's exponential_ made that
~50 ms a step for 32 rows of a 49,152-token vocabulary, on the engine's thread while the compute
threads waited. A seeded request draws its uniform from its own generator, and each row takes its way (the
kernels' one pass or torch ops) and its filters by its own parameters, so its tokens do not
depend on what else is in the batch. The `Sampler` owns those generators: one per seeded request, made at its
first sampled token, kept across preemption, dropped when the scheduler says it finished.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.request import Request, TokenLogprob

if TYPE_CHECKING:  # xgrammar is imported only where a request is constrained
    from pagoda.structured.grammar import TokenBitmask


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, kernels: ctypes.CDLL | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator
        self._kernels = kernels  # the CPU kernels (plain rows in one pass), or None

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        bitmask: TokenBitmask | None = None,
        with_logprobs: bool = True,
    ) -> SamplerOutput:
        """logits [B, V] for the requests' next tokens, in order; `bitmask`: the allowed tokens
        of constrained requests (structured outputs); `with_logprobs`: False where the caller
        computes the requests' logprobs itself (all None then)."""
        return sample(logits, requests, self.generator, bitmask, self._kernels, with_logprobs)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' generators."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def generator(self, request: Request, device: torch.device) -> torch.Generator:
        """A seeded request's own generator."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_params.seed
            generator = self._generators[request.request_id] = torch.Generator(device=device).manual_seed(seed)
        return generator


GeneratorOf = Callable[[Request, torch.device], torch.Generator]


def sample(
    logits: torch.Tensor,
    requests: Sequence[Request],
    generator_of: GeneratorOf,
    bitmask: TokenBitmask | None = None,
    kernels: ctypes.CDLL | None = None,
    with_logprobs: bool = True,
) -> SamplerOutput:
    """logits [B, V] for the requests' next tokens, in order; `generator_of` gives a seeded
    request's random generator; `kernels`: the CPU kernels, whose one pass takes a batch of plain
    greedy and plain random rows (cpu.sample_rows: the same rules). Returned logprobs are the
    model's, before any mask (as vLLM's), for the requests that ask, if `with_logprobs`."""
    params = [r.sampling_params for r in requests]
    wants_logprobs = with_logprobs and any(p.logprobs is not None for p in params)
    raw = torch.log_softmax(logits.float(), dim=-1) if wants_logprobs else None
    if bitmask is not None:  # first: penalties, bias and sampling see only allowed tokens
        logits = logits.float()
        bitmask.apply(logits)
    row_uniform = _uniforms(requests, generator_of, logits.device)
    # Each row takes its way by its own parameters, never by its batch's, so that a request's
    # tokens are the same whatever shares its step: plain rows through the kernels' one pass,
    # the rest (penalties, bias, min_tokens, top-k/p, min-p) by torch ops.
    plain = [i for i, (r, p) in enumerate(zip(requests, params)) if _plain_row(r, p)] if kernels is not None else []
    token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
    rest = sorted(set(range(len(params))) - set(plain))
    if plain:
        got = _sample_plain(kernels, logits[plain], [params[i] for i in plain], row_uniform[plain])
        if got is None:  # a row the kernels leave to torch's rules (a NaN, a zero temperature)
            rest = list(range(len(params)))
        else:
            token_ids[plain] = got
    if rest:
        token_ids[rest] = _sample_torch(
            logits[rest], [requests[i] for i in rest], [params[i] for i in rest], row_uniform[rest]
        )
    return SamplerOutput(token_ids.tolist(), _logprobs(raw, token_ids, requests))


def _plain_row(request: Request, params) -> bool:
    """A row the kernels' one pass takes: no penalty, bias or active min_tokens, and greedy or a
    draw from the whole tempered distribution."""
    return _plain(params) and not _min_tokens_active(request) and (params.greedy or not _filters(params))


def _filters(params) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0


def _sample_plain(
    kernels: ctypes.CDLL, logits: torch.Tensor, params: Sequence, row_uniform: torch.Tensor
) -> torch.Tensor | None:
    """The rows' tokens in the kernels' one pass (`row_uniform`: each random row's uniform, 0 for
    greedy rows); None where it cannot take them all (not a CPU float32 or bfloat16 batch, a
    temperature that is 0 in float32, or a row with a NaN or no finite positive total, which the
    torch way decides by its own rules)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows and not bool((temperature[random_rows] > 0).all()):
        return None
    token_ids = cpu_kernels.sample_rows(kernels, logits.contiguous(), temperature, row_uniform.cpu())
    return None if bool((token_ids < 0).any()) else token_ids


def _sample_torch(
    logits: torch.Tensor, requests: Sequence[Request], params: Sequence, row_uniform: torch.Tensor
) -> torch.Tensor:
    """The rows' tokens by torch ops: penalties, bias and min_tokens, then each greedy row's
    argmax and each random row's draw from its filtered probabilities (row by row the same
    whatever the other rows ask for)."""
    edited = not all(_plain(p) for p in params) or any(_min_tokens_active(r) for r in requests)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not edited and not random_rows:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if edited:
        logits = logits.clone()  # edited in place below; the caller's logits stay as they were
        if any(p.uses_penalties for p in params):
            apply_penalties(logits, requests)
        _apply_edits(logits, requests)
    if len(random_rows) < len(params):
        token_ids = logits.argmax(dim=-1)
    else:  # every row drawn: no argmax to compute
        token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits[rows], [params[i] for i in random_rows])
        token_ids[rows] = draw(probs, row_uniform[rows])
    return token_ids


def filtered_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (rows renormalized). Each filter
    touches only the rows that ask for it, so a row's probabilities are the same in any batch
    (a top-p of 1 applied anyway cut a tail where float32's running sum reached 1 early)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    sorting = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if sorting:
        rows = torch.tensor(sorting, device=device)
        logits[rows] = _top_k_top_p(logits[rows], [params[i] for i in sorting])
    probs = logits.softmax(dim=-1)
    thinning = [i for i, p in enumerate(params) if p.min_p > 0]
    if thinning:
        rows = torch.tensor(thinning, device=device)
        kept = probs[rows]
        threshold = torch.tensor([params[i].min_p for i in thinning], device=device)[:, None]
        kept = kept.masked_fill(kept < threshold * kept.max(dim=-1, keepdim=True).values, 0.0)
        probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Tempered logits with the tokens outside each row's top-k, then outside its top-p nucleus,
    set to -inf (the top token always stays); a row without one of them is not touched by it."""
    device = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition penalty (HF: over prompt and output tokens) and OpenAI presence/frequency
    penalties (over output tokens), in place."""
    batch, vocab = logits.shape
    device = logits.device
    outputs = torch.zeros(batch, vocab, device=device)
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    for i, r in enumerate(requests):
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
        outputs[i].index_add_(0, out, torch.ones(len(out), device=device))
        seen[i, torch.tensor(r.token_ids, dtype=torch.long, device=device)] = True
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in requests], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in requests], device=device)[:, None]
    presence = torch.tensor([r.sampling_params.presence_penalty for r in requests], device=device)[:, None]
    logits -= freq * outputs + presence * (outputs > 0)


def _apply_edits(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Each row's logit bias, allowed tokens, banned words and min_tokens' ban on stopping, in place;
    none on a row whose grammar forces its token (a thinking budget's end tag), which they could ban."""
    for i, r in enumerate(requests):
        if r.grammar is not None and r.grammar.forcing:
            continue
        allowed = r.sampling_params.allowed_token_ids
        if allowed is not None:
            keep = torch.tensor(allowed, dtype=torch.long, device=logits.device)
            logits[i] = torch.full_like(logits[i], float("-inf")).index_copy_(0, keep, logits[i, keep])
        banned = _banned_word_ends(r)
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
        bias = r.sampling_params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        if _min_tokens_active(r) and not (r.grammar and r.grammar.decides_end):  # a grammar decides its end
            stoppers = sorted(r.sampling_params.stopping_token_ids(r.eos_token_ids))
            logits[i, torch.tensor(stoppers, dtype=torch.long, device=logits.device)] = float("-inf")


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (rows of non-negative weights, any positive sum) for
    uniforms [B] (float64 in [0, 1)): the first token whose cumulative weight exceeds u * total, in
    float64. That token's own weight is positive: a masked (zero) token is never drawn. A row with
    no finite positive total (NaN or infinite weights, which extreme parameters such as a
    repetition penalty of 1e-308 make) gets its largest weight's token, as argmax takes it."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1]
    point = uniforms.to(cdf) * total  # below the total: u < 1 keeps u * total < total in float64
    tokens = torch.searchsorted(cdf, point[:, None], right=True).squeeze(1)
    degenerate = ~(torch.isfinite(total) & (total > 0))
    if degenerate.any():
        tokens[degenerate] = probs[degenerate].argmax(dim=-1)
    return tokens


def _uniforms(requests: Sequence[Request], generator_of: GeneratorOf, device: torch.device) -> torch.Tensor:
    """One uniform per row (float64; 0 for a greedy row): a seeded random row's from its own generator."""
    uniforms = torch.zeros(len(requests), dtype=torch.float64, device=device)
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if random_rows:
        uniforms[random_rows] = torch.rand(len(random_rows), dtype=torch.float64, device=device)
    for i in random_rows:
        if requests[i].sampling_params.seed is not None:
            own = generator_of(requests[i], device)
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=own, device=device)[0]
    return uniforms


def _logprobs(
    raw: torch.Tensor | None, token_ids: torch.Tensor, requests: Sequence[Request]
) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(requests)
    return [
        token_logprob(raw[i], int(token_ids[i]), r.sampling_params.logprobs)
        if r.sampling_params.logprobs is not None
        else None
        for i, r in enumerate(requests)
    ]


def token_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """logprobs [V] of one position: the chosen token's, its rank, and the top alternatives."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    top = logprobs.topk(num_top) if num_top else None
    alternatives = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
    return TokenLogprob(token_id, float(chosen), rank, alternatives)


def _banned_word_ends(request: Request) -> list[int]:
    """The last tokens of the request's bad words whose earlier tokens end its output so far."""
    output = request.output_token_ids
    return [
        ids[-1]
        for ids in request.bad_words_ids
        if len(ids) == 1 or (len(output) >= len(ids) - 1 and tuple(output[len(output) - len(ids) + 1 :]) == ids[:-1])
    ]


def _plain(params) -> bool:
    return not params.uses_penalties and not params.edits_logits


def _min_tokens_active(request: Request) -> bool:
    return request.num_output_tokens < request.sampling_params.min_tokens
