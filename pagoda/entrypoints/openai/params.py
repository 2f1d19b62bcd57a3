"""From a request body to SamplingParams, and the checks that keep user input from ever reaching
the engine thread in a shape it would fail on (an out-of-vocabulary id, a prompt that cannot fit)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda import sampling_params as sampling
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TruncationSide
from pagoda.sampling_params import (
    MAX_LOGPROBS,
    ReasoningSpan,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

LOGIT_BIAS_LIMIT = 100.0


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    generation_defaults: dict  # sampling values from generation_config.json (generation_config.SAMPLING_KEYS, as vLLM)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    limits: ModelLimits,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    renames: dict[str, str],
    reasoning: ReasoningSpan | None = None,
) -> SamplingParams:
    """`renames` maps SamplingParams' names to the body's where they differ (chat: top_logprobs);
    `reasoning`: where the model thinks, from the server's reasoning parser (None: it has none)."""
    defaults = limits.generation_defaults
    if request.thinking_token_budget not in (None, -1) and reasoning is None:  # vLLM's rule, -1 its "none"
        raise bad_request(
            "thinking_token_budget needs a reasoning model's thinking: start the server with --reasoning-parser",
            "thinking_token_budget",
        )
    for name, asked in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if asked is not None and asked > limits.max_logprobs:
            param = renames.get(name, name)
            raise bad_request(f"`{param}` is {asked}; this server returns at most {limits.max_logprobs}", param)
    check_token_ids(request.stop_token_ids or [], limits.vocab_size, "stop_token_ids")
    check_token_ids(request.allowed_token_ids or [], limits.vocab_size, "allowed_token_ids")
    try:
        return SamplingParams(
            n=request.n,
            temperature=_pick(request.temperature, defaults.get("temperature"), 1.0),
            top_p=_pick(request.top_p, defaults.get("top_p"), 1.0),
            top_k=_pick(request.top_k, defaults.get("top_k"), 0),
            min_p=_pick(request.min_p, defaults.get("min_p"), 0.0),
            repetition_penalty=_pick(request.repetition_penalty, defaults.get("repetition_penalty"), 1.0),
            presence_penalty=_pick(request.presence_penalty, defaults.get("presence_penalty"), 0.0),
            frequency_penalty=_pick(request.frequency_penalty, defaults.get("frequency_penalty"), 0.0),
            logit_bias=_logit_bias(request.logit_bias, limits.vocab_size),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=_stop(request.stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=tuple(request.bad_words or ()),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured_outputs(request),
            reasoning=reasoning,
            thinking_token_budget=request.thinking_token_budget,
        )
    except SamplingParamsError as exc:
        param = renames.get(exc.param, exc.param)
        raise bad_request(str(exc).replace(exc.param, param, 1), param) from None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_field(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The body field that holds the request's output constraint; 400 when there are several."""
    fields = [name for name in GUIDED_FIELDS if getattr(request, name) is not None]
    if request.structured_outputs is not None:
        fields.insert(0, "structured_outputs")
    if request.response_format not in (None, {"type": "text"}):
        fields.insert(0, "response_format")
    if len(fields) > 1:
        raise bad_request(f"A request takes at most one output constraint; got {', '.join(fields)}", fields[1])
    return fields[0] if fields else None


def structured_outputs(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever spelling it used (one at most)."""
    field = constraint_field(request)
    try:
        if field is None:
            return None
        if field == "response_format":
            return _response_format(request.response_format)
        if field == "structured_outputs":
            body = request.structured_outputs
            assert body is not None
            return StructuredOutputsParams(
                json=body.json_schema,
                json_object=bool(body.json_object),
                regex=body.regex,
                choice=body.choice,
                grammar=body.grammar,
                structural_tag=body.structural_tag,
            )
        return StructuredOutputsParams(**{GUIDED_FIELDS[field]: getattr(request, field)})
    except SamplingParamsError as exc:
        raise bad_request(f"{field}: {exc}", field) from None


def _response_format(value: object) -> StructuredOutputsParams:
    """OpenAI's response_format: json_object, or json_schema with its schema, whose `strict: true`
    has every keyword enforced or the request refused (else, as vLLM, what the grammar cannot
    enforce is left unenforced); or vLLM's structural_tag (xgrammar's `{"type": "structural_tag",
    "format": {...}}`, or the older `"structures"` and `"triggers"`), taken whole."""
    if not isinstance(value, dict):
        raise bad_request(
            f'response_format must be an object such as {{"type": "json_object"}}, got {value!r:.80}', "response_format"
        )
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":  # its form is checked as every structural tag's (sampling_params)
        return StructuredOutputsParams(structural_tag=value)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        # OpenAI's and vLLM's json_schema requires its name
        raise bad_request(
            'response_format.json_schema must be an object with a "name" string and a "schema"',
            "response_format.json_schema",
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return StructuredOutputsParams(json=schema, strict=spec.get("strict") is True)


def _pick(value, model_default, api_default):
    if value is not None:
        return value
    return model_default if model_default is not None else api_default


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    result = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias"
            )
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        result[token] = value
    return result


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """The engine's own check (sampling_params.check_token_ids), as a 400 before the request is queued."""
    try:
        sampling.check_token_ids(ids, vocab_size, param)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param) from None


def truncated(ids: list[int], keep: int | None, side: TruncationSide | None, max_model_len: int) -> list[int]:
    """sampling_params.truncated_prompt, its refusal a 400."""
    try:
        return sampling.truncated_prompt(ids, keep, side, max_model_len)
    except sampling.SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None


def check_context(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str,
    max_param: str = "max_tokens",
    min_tokens: int = 0,
) -> None:
    """vLLM's rules for the context: the prompt has a token and leaves room for one more (and for
    min_tokens), and max_tokens is no more than the whole context. A prompt plus max_tokens past
    the context is served, the answer ending where the context does (finish_reason "length"), as
    vLLM shortens max_tokens to the room left. Checked here so the engine never refuses what was
    accepted. `param`: the prompt's field; `max_param`: max_tokens' (named where it alone is too large)."""
    if num_prompt_tokens == 0:
        raise bad_request("The prompt is empty: at least one token is needed to generate from.", param)
    if max_tokens is not None and max_tokens > max_model_len:
        raise bad_request(
            f"{max_param}={max_tokens} is more than this model's maximum context length of {max_model_len} tokens.",
            max_param,
        )
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens} tokens in the {param}, which leaves no room for a completion. "
            f"Please reduce the length of the {param}.",
            param,
        )
    room = max_model_len - num_prompt_tokens
    if min_tokens > room:
        raise bad_request(
            f"min_tokens={min_tokens} is more than the {room} tokens this model's maximum context length of "
            f"{max_model_len} leaves after the {num_prompt_tokens} in the {param}.",
            "min_tokens",
        )
