"""Per-request sampling parameters, validated on construction (and again as a request takes a copy
into the engine: their fields may be changed in between, as vLLM's)."""

from __future__ import annotations

import copy
import enum
import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per position (vLLM's default cap too)
LOGPROBS_RANGE = f"must be in [0, {MAX_LOGPROBS}]"


class RequestOutputKind(enum.Enum):
    """vLLM's: what each output of a request carries (offline answers come whole either way)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a reasoning model thinks in its output: from `start` (only when the output opens with
    it; None: from the very start) to `end`. A constraint applies to what comes after; a thinking
    budget bounds what comes between."""

    end: str
    start: str | None = None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output: exactly one of a JSON schema, any JSON object, a regular
    expression, a choice among strings, an EBNF grammar, or a structural tag (xgrammar's JSON
    description of text with constrained parts, vLLM's `structural_tag`: a `{"type":
    "structural_tag", "format": {...}}`, or the older `{"structures": [...], "triggers": [...]}`)
    (vLLM's `structured_outputs`).

    `strict` (OpenAI's word): all of it enforced, or the request refused naming what cannot be
    (a JSON schema keyword such as `uniqueItems`, a pattern beside `minLength`); without it, as
    vLLM serves it, what the grammar cannot enforce is left unenforced and the rest holds."""

    json: dict[str, Any] | None = None  # a JSON schema (JSON text is parsed on construction)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF, as xgrammar and llama.cpp's GBNF read it
    structural_tag: str | None = None  # JSON text (a dict is written as such on construction)
    strict: bool = False
    # vLLM's options, taken for its scripts: what the first two ask is what Pagoda always does
    # (JSON written compactly; objects hold only a schema's properties), whatever their value
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # vLLM's for other backends than xgrammar: refused

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise SamplingParamsError(
                "structured_outputs",
                "whitespace_pattern is not supported: JSON is written compactly, one space after ':' and ','",
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except (ValueError, RecursionError) as exc:
                raise SamplingParamsError("structured_outputs", f"the JSON schema is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise SamplingParamsError("structured_outputs", "a JSON schema must be a JSON object")
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _structural_tag_text(self.structural_tag))
        set_ = [name for name in CONSTRAINT_KINDS if name != "json_object" and getattr(self, name) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"structured_outputs takes exactly one of {', '.join(CONSTRAINT_KINDS)}; got {set_ or 'none'}",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs.choice must be a non-empty list of strings"
            )

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(name for name in CONSTRAINT_KINDS if name != "json_object" and getattr(self, name) is not None)

    @property
    def key(self) -> str:
        """The constraint as one text: equal constraints have equal keys. A schema keeps its order
        (xgrammar writes properties in it), so `{b, a}` and `{a, b}` are different constraints; a
        strict one is another constraint than the same without (one may be refused, not the other)."""
        value = None if self.kind == "json_object" else getattr(self, self.kind)
        strict = " strict" if self.strict else ""
        return f"{self.kind}{strict}\n{json.dumps(value, separators=(',', ':'), ensure_ascii=False)}"


def _structural_tag_of_structures(value: dict[str, Any]) -> dict[str, Any]:
    """The older form of a structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`:
    free text in which a trigger opens one of the tags) in the newer one, which means the same."""
    structures, triggers = value.get("structures"), value.get("triggers")
    fields = ("begin", "schema", "end")
    if not (
        isinstance(structures, list)
        and all(isinstance(s, dict) and all(f in s for f in fields) for s in structures)
        and isinstance(triggers, list)
        and all(isinstance(t, str) for t in triggers)
    ):
        raise SamplingParamsError(
            "structured_outputs",
            'a structural tag\'s "structures" must be a list of {"begin", "schema", "end"}, its "triggers" a '
            "list of strings",
        )
    tags = [
        {
            "type": "tag",
            "begin": s["begin"],
            "content": {"type": "json_schema", "json_schema": s["schema"]},
            "end": s["end"],
        }
        for s in structures
    ]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _structural_tag_text(value: Any) -> str:
    """A structural tag as compact JSON text: an object, given as one or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise SamplingParamsError("structured_outputs", f"the structural tag is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SamplingParamsError("structured_outputs", "a structural tag must be a JSON object")
    if "format" in value and "structures" in value:
        raise SamplingParamsError("structured_outputs", 'a structural tag has a "format" or "structures", not both')
    if "structures" in value:
        value = _structural_tag_of_structures(value)
    if "format" not in value:
        raise SamplingParamsError(
            "structured_outputs", 'a structural tag needs a "format", or "structures" and "triggers"'
        )
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling): disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a string: one
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's: False leaves the output's text empty and its logprobs' decoded tokens None (token ids only)
    detokenize: bool = True
    # vLLM's: with skip_special_tokens=False, whether adjacent added special tokens are written with a
    # space between them. Taken and ignored: the text is the tokenizer's decode either way (the same
    # as vLLM's for byte-level tokenizers, the default model's among them)
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the only tokens that may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated; each, as its tokens with and without a leading space, has its
    # last token banned wherever the output so far ends with the tokens before it
    bad_words: list[str] = field(default_factory=list)
    # where the model thinks in its output (a server sets it from its reasoning parser): a
    # structured-output constraint applies to the answer after it
    reasoning: ReasoningSpan | None = None
    # vLLM's: the most tokens the thinking may take (None or -1: no bound); the model's next tokens
    # are then the span's end, forced. Needs `reasoning`
    thinking_token_budget: int | None = None
    # vLLM's, taken for its scripts: its offline API answers whole (FINAL_ONLY) whatever this asks,
    # as Pagoda's does; extra_args are a plugin's, kept and unused
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, empty in _EMPTY_WHEN_NONE.items():  # vLLM takes None for these as "none"
            if getattr(self, name) is None:
                setattr(self, name, empty())
        for name in (*_INTS, *_NUMBERS):  # numpy's scalars (a sweep's np.linspace) as Python's
            setattr(self, name, _plain(getattr(self, name)))
        if isinstance(self.logit_bias, dict):  # JSON's string keys, as vLLM takes them
            self.logit_bias = {_plain(_id_of(k)): _plain(v) for k, v in self.logit_bias.items()}
        for name in ("stop_token_ids", "allowed_token_ids"):  # numpy's ints (an np.array) as Python's
            ids = getattr(self, name)
            if ids is not None and not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__"):
                setattr(self, name, [_plain(t) for t in ids])
        self._check_types()
        # each a list of its own, so that a copy's (the engine's) does not change with the caller's
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _check_types(self) -> None:
        """Each field's type, so that a wrong one is refused here, naming it, rather than failing in
        the sampler's tensors after the request has joined the engine."""
        for name in _INTS:
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in _OPTIONAL)):
                raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
        for name in _NUMBERS:
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)):
                raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise SamplingParamsError("seed", f"seed must fit in 64 bits, got {self.seed}")
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise SamplingParamsError(
                "stop_token_ids", f"stop_token_ids must be token ids (integers >= 0), got {ids!r}"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple)) or not allowed or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise SamplingParamsError(
                "allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r:.200}"
            )
        words = self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise SamplingParamsError("bad_words", f"bad_words must be a list of non-blank strings, got {words!r:.200}")
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(
            _is_int(k) and k >= 0 and (_is_int(v) or (isinstance(v, float) and math.isfinite(v)))
            for k, v in bias.items()
        ):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias must map token ids (integers >= 0) to finite numbers, got {bias!r:.200}"
            )

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),  # OpenAI's and vLLM's range
            (all(self.stop), "stop", "must not contain an empty string"),
            (self.detokenize or not self.stop, "stop", "needs detokenize=True (stop strings are found in the text)"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be 0 or -1 (both: disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", LOGPROBS_RANGE),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                LOGPROBS_RANGE,
            ),
            (
                self.thinking_token_budget is None or self.thinking_token_budget >= -1,
                "thinking_token_budget",
                "must be a non-negative integer or -1 (no bound)",
            ),
            (
                self.thinking_budget is None or self.reasoning is not None,
                "thinking_token_budget",
                "needs to know where the model thinks: a server's --reasoning-parser, or `reasoning` offline",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(param, f"{param} {message}, got {getattr(self, param)!r}")

    def clone(self) -> SamplingParams:
        """A copy (vLLM's method)."""
        return copy.deepcopy(self)

    @property
    def thinking_budget(self) -> int | None:
        """The thinking token budget, None where there is none (unset, or -1 as vLLM spells it)."""
        return None if self.thinking_token_budget in (None, -1) else self.thinking_token_budget

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes the model's logits for this request beyond its penalties:
        a logit bias, allowed tokens, or banned words."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def stopping_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end this request (and that min_tokens bans until it is reached): its
        stop_token_ids, and the model's EOS tokens unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the sampler's int64 tensors and torch generators hold
_INTS = ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs", "prompt_logprobs", "thinking_token_budget")
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "thinking_token_budget")
_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


_EMPTY_WHEN_NONE = {"stop": list, "stop_token_ids": list, "bad_words": list, "logit_bias": dict}


def _plain(value: object) -> object:
    """A number of another library's type (numpy's) as Python's int or float; anything else as it is."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _id_of(key: object) -> object:
    """A logit_bias key as a token id where it is one written as a string ("504"), else as it is."""
    return int(key) if isinstance(key, str) and key.isdigit() and key.isascii() else key


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Iterable[object], vocab_size: int, param: str) -> None:
    """SamplingParamsError naming `param` where an id is not a token of the vocabulary."""
    bad = next((t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)), None)
    if bad is not None and not _is_int(bad):
        raise SamplingParamsError(param, f"{param} must hold integer token ids, got {bad!r:.50}")
    if bad is not None:
        raise SamplingParamsError(param, f"{param} holds token id {bad}, outside the vocabulary (0..{vocab_size - 1})")


def truncated_prompt(ids: list[int], keep: int | None, side: str | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens, or with truncation_side
    "right" its first (None: all of them; -1: as many as leave room for one token of output, as
    vLLM keeps)."""
    if keep is None:
        return ids
    if keep == 0:
        raise SamplingParamsError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1, got 0")
    if keep > max_model_len:
        message = f"truncate_prompt_tokens={keep} cannot be greater than max_model_len={max_model_len}"
        raise SamplingParamsError("truncate_prompt_tokens", message)
    keep = max_model_len - 1 if keep == -1 else keep
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]
