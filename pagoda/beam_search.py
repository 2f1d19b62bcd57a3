"""Beam search as vLLM does it: outside the engine, one token a step.

A search keeps up to `beam_width` beams (the prompt's tokens and those chosen so far). Each step
asks the engine for one token of every beam with the logprobs of its 2 x beam_width most likely
next tokens (the prefix cache serves each beam's earlier tokens), extends every beam by each of
those candidates, moves a candidate that is an end-of-sequence token to the finished beams
(unless ignore_eos), and keeps the beam_width extensions of highest cumulative logprob. After
max_tokens steps (or once no beam is left) the best beam_width of the finished and the running
beams are the answer, ranked by cumulative logprob / length ** length_penalty, the length counting
the prompt (vLLM's and transformers' score).

`BeamSearch` is one prompt's search, driven by `LLM.beam_search` offline and by the server for
`use_beam_search` requests: each step both ask `step_beams` for the beams to extend, run them, and
hand `advance` their candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: beam_width beams, at most max_tokens new tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # passed to each step's request; the candidates' logprobs are the model's own
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a beam that ended keeps its end-of-sequence token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if 2 * self.beam_width > MAX_LOGPROBS:  # vLLM's bound too, by its default max_logprobs
            raise ValueError(
                f"beam_width must be at most {MAX_LOGPROBS // 2} (each step asks the logprobs of 2 x beam_width "
                f"tokens, at most {MAX_LOGPROBS}), got {self.beam_width}"
            )

    def step_params(self) -> SamplingParams:
        """One step of every beam: one token and its 2 x beam_width most likely alternatives."""
        return SamplingParams(
            max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width, ignore_eos=True, detokenize=False
        )


@dataclass
class BeamSearchSequence:
    """vLLM's: a beam. `tokens` hold the prompt's and the new ones; `logprobs` one dict per new
    token, the candidates' logprobs at that step (token id -> logprob)."""

    tokens: list[int]
    # token id -> logprob: a float while searching; vLLM's Logprob in LLM.beam_search's answers
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # filled in for the answer
    finish_reason: str | None = None  # "stop" (the end-of-sequence token) or "length"
    stop_reason: int | None = None  # the end-of-sequence token that ended it


@dataclass(frozen=True)
class BeamSearchOutput:
    """vLLM's: one prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search. Its running beams grow a token a step, all alike, until max_tokens or until
    they fill `max_model_len` (the context: a beam's next step is a request with the beam as its prompt),
    where they end as "length", as generate's sequences end there."""

    def __init__(
        self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.params = params
        self.prompt_len = len(prompt_ids)
        self._eos = eos_token_ids
        self._max_len = max_model_len
        self.beams = [BeamSearchSequence(list(prompt_ids))]  # running, to be extended next step
        self._finished: list[BeamSearchSequence] = []
        self._steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self._steps >= self.params.max_tokens or len(self.beams[0].tokens) >= self._max_len

    def advance(self, candidates: list[dict[int, float]]) -> None:
        """One step: `candidates[i]` the next tokens of beam i and their logprobs."""
        assert len(candidates) == len(self.beams), "one set of candidates per running beam"
        extended: list[BeamSearchSequence] = []
        for beam, options in zip(self.beams, candidates):
            for token, logprob in options.items():
                ended = token in self._eos and not self.params.ignore_eos
                grown = BeamSearchSequence(
                    beam.tokens + ([token] if not ended or self.params.include_stop_str_in_output else []),
                    beam.logprobs + [options],
                    beam.cum_logprob + logprob,
                )
                if ended:
                    grown.finish_reason, grown.stop_reason = "stop", token
                    self._finished.append(grown)
                else:
                    extended.append(grown)
        # sorted is stable: candidates of equal logprob keep the order they came in
        self.beams = sorted(extended, key=lambda b: b.cum_logprob, reverse=True)[: self.params.beam_width]
        self._steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The answer: the best beam_width of the finished and running beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self._finished + self.beams, key=self._score, reverse=True)
        return ranked[: self.params.beam_width]

    def new_tokens(self, beam: BeamSearchSequence) -> list[int]:
        return beam.tokens[self.prompt_len :]

    def _score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self._eos)  # an end token kept does not count
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty


def candidate_ranks(candidates: dict[int, float]) -> dict[int, int]:
    """Each of a step's candidates' rank (1: the likeliest; equal logprobs share one)."""
    return {token: 1 + sum(other > value for other in candidates.values()) for token, value in candidates.items()}


Beams = list[tuple[BeamSearch, BeamSearchSequence]]


def step_beams(searches: list[BeamSearch]) -> Beams:
    """The beams one step extends: every beam of each search not done, search by search (none: the
    searches are over)."""
    return [(search, beam) for search in searches if not search.done for beam in search.beams]


def advance(beams: Beams, candidates: list[dict[int, float]]) -> None:
    """One step of each search in `beams` (step_beams'): `candidates[i]` beam i's next tokens and
    their logprobs."""
    by_search: dict[int, tuple[BeamSearch, list[dict[int, float]]]] = {}
    for (search, _), options in zip(beams, candidates, strict=True):
        by_search.setdefault(id(search), (search, []))[1].append(options)
    for search, options in by_search.values():
        search.advance(options)
