"""Request bodies of the OpenAI API and vLLM's extensions, as pydantic models.

Unknown fields are ignored (as vLLM does), so clients that send newer fields still work. Fields
Pagoda cannot honour are declared here only so that `unsupported_fields` can name them in a 400:
silently ignoring `functions` would hand back an answer the client did not ask for.
Responses are plain dicts built by chat.py, completions.py and responses.py.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagoda.sampling_params import INT64_MAX, INT64_MIN

MAX_N = 128  # OpenAI's own limit on choices per request
TruncationSide = typing.Literal["left", "right"]
ReasoningEffort = typing.Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
MAX_CACHE_SALT = 128  # vLLM's limits on a cache_salt: its length, and characters it refuses
CACHE_SALT_REFUSED = frozenset("@/\\\0")


def _checked_cache_salt(salt: str | None) -> str | None:
    """vLLM's checks, in its words."""
    if salt is None:
        return salt
    if not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > MAX_CACHE_SALT or CACHE_SALT_REFUSED & set(salt):
        raise ValueError(
            f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT} characters and must not contain "
            "'@', '/', '\\\\', or NUL."
        )
    return salt


# vLLM's: the request's prefix cache namespace (only requests with the same salt share cached KV)
CacheSalt = Annotated[str | None, AfterValidator(_checked_cache_salt)]


def _checked_request_id(request_id: str | None) -> str | None:
    if request_id is not None and (not request_id or not request_id.isprintable()):
        raise ValueError("request_id must be a non-empty string of printable characters")  # it reaches log lines
    return request_id


# vLLM's: the id the answer carries (after the endpoint's prefix, where it has one)
RequestId = Annotated[str | None, AfterValidator(_checked_request_id)]


class _Body(BaseModel):
    # inf and NaN would reach the sampler's tensors: refused like any other invalid number
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for an optional field whose type has no None (n, stream, ...) takes its
        default, as OpenAI's nullable fields do; a required field's null is still refused."""
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_on_null(cls)
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}

    @field_validator("*")
    @classmethod
    def _text_is_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer, grammar compiler or
        UTF-8 encoder takes: refused here rather than failing deep inside one."""
        field = cls.model_fields[info.field_name] if info.field_name else None
        where = _lone_surrogate(value, (field.alias if field else None) or info.field_name or "")
        if where is not None:  # the 400's param is the place itself (errors.py reads it from the context)
            raise PydanticCustomError(
                "lone_surrogate",
                "{place} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)",
                {"place": where, "param": where.removesuffix(" (a key)")},
            )
        return value


@functools.cache
def _defaulted_on_null(cls: type[BaseModel]) -> frozenset[str]:
    """The fields (as the client spells them) whose null means their default: optional, and of a type
    without None. Once per request class, not per request."""
    return frozenset(
        field.alias or name
        for name, field in cls.model_fields.items()
        if not field.is_required() and not _admits_none(field.annotation)
    )


def _admits_none(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in typing.get_args(annotation)


def _lone_surrogate(value: Any, path: str) -> str | None:
    """Where in value (a parsed JSON value, at `path`) a string or key holds a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = _lone_surrogate(key, f"{path} (a key)") or _lone_surrogate(item, f"{path}.{key}")
            if where is not None:
                return where
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            where = _lone_surrogate(item, f"{path}[{i}]")
            if where is not None:
                return where
    return None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` object: one constraint (checked in params.py)."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None


class _SamplingFields(_Body):
    """Fields shared by chat and completions; None means "the default"."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=INT64_MAX)  # the sampler makes an int64 tensor of it
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    # vLLM's: the prompt's last N tokens (-1: all but one of the context), its first N with
    # truncation_side "right"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: TruncationSide | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # vLLM's: logprobs name tokens as "token_id:N"; None: the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: CacheSalt = None
    request_id: RequestId = None  # the answer's id is "chatcmpl-" or "cmpl-" and this (serving.answer_id)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # vLLM's: lower first under --scheduling-policy priority
    # vLLM's beam search: n beams (pagoda/beam_search.py), ranked by cumulative logprob over
    # length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's, refused where set (see unsupported_fields): logprobs of chosen token ids, repetition
    # detection
    logprob_token_ids: list[int] | None = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: Any = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    # required, but checked after unsupported_fields: vLLM's clients send prompt_embeds without it
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int = 16  # null is 16 too (OpenAI's legacy API, vLLM), not "up to the context"
    echo: bool = False
    logprobs: int | None = None
    # refused unless harmless (see unsupported_fields)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # OpenAI's: the best n of this many samples
    prompt_embeds: Any = None  # vLLM's


class ChatCompletionRequest(_SamplingFields):
    # roles and content parts are checked by chat.py, so that a 400 can name messages[i].content[j]
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables, e.g. enable_thinking
    # vLLM's, template variables too (over chat_template_kwargs'): documents for a RAG template, and
    # reasoning_effort, which also sets enable_thinking ("none": false) unless chat_template_kwargs does
    documents: list[dict[str, str]] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out (tools.md)
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True  # vLLM's: the header of a new assistant turn after the messages
    continue_final_message: bool = False  # vLLM's: the last message left open, for the model to continue
    echo: bool = False  # vLLM's: the reply starts with the last message's content where it has the reply's role
    tools: Any = None  # checked by tool_calls.py, so that a 400 can name tools[i].function.parameters
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # refused unless harmless (see unsupported_fields)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    chat_template: str | None = None  # vLLM's: the request's own, only with --trust-request-chat-template


class VllmResponsesFields(_Body):
    """vLLM's extensions of the Responses API, each passed on to the chat request as it is (None:
    the chat path's default)."""

    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    include_reasoning: bool | None = None
    cache_salt: CacheSalt = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # lower first under --scheduling-policy priority


class ResponsesRequest(VllmResponsesFields):
    """OpenAI's Responses API (POST /v1/responses), the fields of it Pagoda serves; responses.py
    checks `input`, `tools`, `tool_choice` and `text` item by item, so that a 400 names the part."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=INT64_MAX)  # vLLM's
    min_p: float | None = None  # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True  # kept only with the server's response store (VLLM_ENABLE_RESPONSES_API_STORE)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None  # bounds built-in tools' calls; function calls come back to the client
    top_logprobs: int | None = Field(None, ge=0)  # with include ["message.output_text.logprobs"]
    request_id: RequestId = None  # vLLM's: the response's id, as it is
    # refused where set (responses.py)
    include: list[str] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool = False
    prompt: Any = None


class AnthropicCountTokensRequest(_Body):
    """Anthropic's count_tokens body: the fields of a Messages request that make its prompt.
    messages.py checks messages, blocks and tools one by one, so that a 400 names the place."""

    model: str | None = None  # none: the served model
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: dict[str, Any] | None = None  # format (a JSON schema) and effort
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """Anthropic's Messages API (POST /v1/messages), the fields of it Pagoda serves."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=INT64_MAX)
    metadata: dict[str, Any] | None = None  # user_id: the chat request's user
    cache_salt: CacheSalt = None  # vLLM's


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)  # a chat template needs a message
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    # with messages, rendered as a chat request renders them (vLLM's tokenize does likewise)
    tools: Any = None
    chat_template: str | None = None  # as a chat request's
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM's: the tokens' own strings (the vocabulary's, e.g. "Ġhello") too


class EmbeddingRequest(_Body):
    """OpenAI's embeddings (POST /v1/embeddings) and vLLM's extensions of it: `input` as text or
    token ids, one or many, or vLLM's `messages`, one conversation rendered by the chat template
    (as /tokenize renders it)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    encoding_format: typing.Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: TruncationSide | None = None
    add_special_tokens: bool | None = None  # default: True for input, False for messages
    use_activation: bool | None = None  # the vector scaled to unit length; None: the server's pooler's
    embed_dtype: typing.Literal["float32", "float16", "bfloat16"] = "float32"  # base64's values
    endianness: typing.Literal["native", "big", "little"] = "native"  # base64's bytes
    request_id: RequestId = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: CacheSalt = None
    # with messages, as a chat request's (vLLM: no generation prompt by default)
    tools: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    # refused (embeddings.py): vLLM's removed `normalize` (use_activation now), and padding to a length
    normalize: Any = None
    padding: Any = None


class _ScoringFields(_Body):
    """vLLM's fields of its scoring routes (/score, /rerank) that an embedding model serves."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: TruncationSide | None = None
    request_id: RequestId = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: CacheSalt = None


class ScoreRequest(_ScoringFields):
    """vLLM's POST /score: the similarity of each pair of texts, the first side one text (paired
    with each of the second's) or as many as the second; its sides under any of vLLM's names."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None


class RerankRequest(_ScoringFields):
    """vLLM's POST /rerank (Jina's and Cohere's shape): the documents ranked by their similarity to
    the query, the `top_n` first (0: all)."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(0, ge=0)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):  # vLLM's /v1/load_lora_adapter
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace the weights an adapter of this name has


class UnloadLoRAAdapterRequest(_Body):  # vLLM's /v1/unload_lora_adapter
    lora_name: str = ""


def unsupported_fields(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The first field set to something Pagoda cannot do, or None."""
    if request.logprob_token_ids not in (None, []):
        return "logprob_token_ids"
    detection = request.repetition_detection
    if detection is not None and not (isinstance(detection, dict) and not detection.get("max_pattern_size")):
        return "repetition_detection"  # on: a max_pattern_size above vLLM's 0, "off"
    if isinstance(request, CompletionRequest):
        if request.suffix:
            return "suffix"
        if request.prompt_embeds is not None:
            return "prompt_embeds"
        return None
    for name in ("functions", "function_call", "audio", "prediction", "web_search_options"):
        if getattr(request, name) not in (None, []):
            return name
    if request.modalities not in (None, ["text"]):
        return "modalities"
    return None
