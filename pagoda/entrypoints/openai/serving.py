"""What every generation endpoint shares: the server's state, tokenization off the event loop,
launching a Generation, waiting for it while watching for a disconnect, and SSE framing."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagoda.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, advance, candidate_ranks, step_beams
from pagoda.core.outputs import RequestMetrics
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.errors import NOT_GENERATING, APIError, ClientDisconnected, bad_request
from pagoda.entrypoints.openai.logprobs import TokenIdTexts, TokenNames, TokenTexts
from pagoda.entrypoints.openai.params import ModelLimits, constraint_field
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, unsupported_fields
from pagoda.entrypoints.openai.recording import RecordSinks, RequestRecorder, TraceContext
from pagoda.entrypoints.openai.response_store import ResponseStore
from pagoda.entrypoints.openai.stats_log import DEFAULT_INTERVAL_S
from pagoda.entrypoints.openai.streams import Generation
from pagoda.entrypoints.openai.tool_calls import ToolSettings
from pagoda.entrypoints.openai.tracing import trace_headers
from pagoda.lora import LoRAAdapter, LoRAError, LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.request import TokenLogprob
from pagoda.sampling_params import MAX_LOGPROBS, ReasoningSpan, SamplingParams, StructuredOutputsParams
from pagoda.structured.compiler import GrammarError
from pagoda.tools.reasoning import REASONING_PARSERS, ReasoningTokenCounter

T = TypeVar("T")
logger = logging.getLogger("pagoda.requests")

LONG_PROMPT_CHARS = 4096  # longer texts are tokenized on a worker thread, not the event loop
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class CrossOrigin:
    """Which browser pages on other origins may call the API (CORS; vLLM's flags). No origins: none."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True)
class ServerConfig:
    api_keys: tuple[str, ...] = ()  # any of them authorizes a request; none: no key needed
    chat_template: str | None = None  # template text; None: the model's own
    trust_request_chat_template: bool = False  # a chat request may bring its own (vLLM's flag of that name)
    chat_template_content_format: str = "auto"  # model_files.CONTENT_FORMATS (vLLM's --chat-template-content-format)
    request_log: Path | None = None
    log_prompts: bool = False
    log_outputs: bool = False  # the per-request log line has the output text (vLLM's --enable-log-outputs)
    default_template_kwargs: dict = field(default_factory=dict)  # under a chat request's chat_template_kwargs
    max_log_len: int | None = None  # --log-prompts' text cut to this many characters (None: whole)
    api_docs: bool = True  # /docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs turns them off)
    log_requests: bool = False  # a log line per arrival: id, endpoint, sampling parameters; never prompt text
    max_logprobs: int = MAX_LOGPROBS  # cap on logprobs / top_logprobs / prompt_logprobs per request
    generation_defaults: dict | None = None  # sampling defaults; None: the model's generation_config.json
    generation_overrides: dict = field(default_factory=dict)  # over those (--override-generation-config)
    tools: ToolSettings = field(default_factory=ToolSettings)
    log_stats: bool = True  # the periodic engine line (stats_log.py)
    log_stats_interval_s: float = DEFAULT_INTERVAL_S
    reset_wait_s: float = 10.0  # how long POST /reset_prefix_cache waits for running requests to finish
    reports: Path | None = None  # --reports: bench result folders the console renders
    cors: CrossOrigin = field(default_factory=CrossOrigin)
    # other names a request's `model` may give: --served-model-name's further names (served and
    # listed, as vLLM's), and without that flag the model argument as given (vLLM's id for it, which
    # its clients send; taken, not listed)
    served_names: tuple[str, ...] = ()
    model_argument: str | None = None
    otlp_traces_endpoint: str | None = None  # a span per finished prompt goes there (tracing.py)
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N" where a request does not say
    response_role: str = "assistant"  # a reply's role after a generation prompt (vLLM's --response-role)
    request_id_headers: bool = False  # every response carries X-Request-Id (vLLM's --enable-request-id-headers)
    fingerprint_mode: str = "full"  # answers' system_fingerprint (vLLM's modes): full, hash, custom, none
    fingerprint_value: str | None = None  # custom's
    lora_modules: tuple[LoRARequest, ...] = ()  # adapters served as model names (--lora-modules)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    runtime_lora_updating: bool = False
    metrics_prefix: str = "pagoda"  # /metrics' names: pagoda:* or vllm:* (--metrics-prefix)
    store_responses: bool = False  # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: the Responses API keeps responses
    force_include_usage: bool = False  # every stream ends with its usage (vLLM's --enable-force-include-usage)
    max_loras: int | None = None  # vLLM's --max-loras: only the lora metric's max_lora (a step mixes any number)
    root_path: str = ""  # a reverse proxy's path prefix (--root-path): routes answer with it and without it

    def sampling_defaults(self, model_defaults: dict) -> dict:
        """What a request's unset sampling values take: the model's generation_config.json values
        (or --generation-config's), then --override-generation-config's over them (vLLM's order)."""
        chosen = model_defaults if self.generation_defaults is None else self.generation_defaults
        return {**chosen, **self.generation_overrides}


@dataclass
class InFlight:
    """How many generation (or embedding) requests are in flight (vLLM's server load)."""

    count: int = 0


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    limits: ModelLimits
    sinks: RecordSinks
    token_texts: TokenTexts
    system_fingerprint: str | None = None  # on every chat and completion answer
    reasoning_counter: ReasoningTokenCounter | None = None  # with --reasoning-parser: usage counts reasoning tokens
    # by model name: --lora-modules' and those loaded while serving (the engine holds their reads)
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    response_store: ResponseStore | None = None  # the Responses API's (VLLM_ENABLE_RESPONSES_API_STORE)
    load: InFlight = field(default_factory=lambda: InFlight())  # GET /load's: counted by api.ServerLoad

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def reasoning(self) -> ReasoningSpan | None:
        """Where the model thinks in its output, as --reasoning-parser reads it (None without one)."""
        name = self.config.tools.reasoning_parser
        return REASONING_PARSERS[name].span if name else None

    def answer_head(self, request_id: str, kind: str, model: str | None) -> dict:
        """A chat or completion answer's fields before its choices (its chunks' too); `model`: the
        request's (an adapter's name is the answer's model, as vLLM's)."""
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.answering_model(model),
            "system_fingerprint": self.system_fingerprint,
        }

    def logprob_tokens(self, body: CompletionRequest | ChatCompletionRequest) -> TokenNames:
        """How the request's logprobs show tokens: as their text, or as ids where it asks."""
        as_ids = body.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.config.return_tokens_as_token_ids
        return TokenIdTexts(self.token_texts) if as_ids else self.token_texts

    @property
    def served_names(self) -> tuple[str, ...]:
        """The base model's names /v1/models lists: every --served-model-name, as vLLM lists them."""
        return (self.model_name, *self.config.served_names)

    @property
    def base_names(self) -> tuple[str | None, ...]:
        """The names a request's `model` may give the base model: the served ones, and the model
        argument as given (taken, not listed; None with --served-model-name)."""
        return (*self.served_names, self.config.model_argument)

    def answering_model(self, model: str | None) -> str:
        """The model an answer names: the adapter a request asked for, else the served model."""
        return model if model in self.adapters else self.model_name

    def check_model(self, model: str | None) -> None:
        if model and model not in (*self.base_names, *self.adapters):  # none or "": the served model (vLLM's rule)
            names = ", ".join(f"`{name}`" for name in self.adapters)
            adapters = f" and the LoRA adapters {names}" if names else ""
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`{adapters}.",
                "model",
                "model_not_found",
            )

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What every generation endpoint refuses before reading the prompt."""
        self.check_model(body.model)
        if self.engine.config.pooler is not None:  # as vLLM, which routes only its model's tasks: 404
            raise APIError(404, NOT_GENERATING, code="unsupported_endpoint")
        if (field := unsupported_fields(body)) is not None:
            raise bad_request(f"`{field}` is not supported by this server", field)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if body.stream and body.prompt_logprobs:  # no chunk carries them; 0 is vLLM's harmless value
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    async def check_constraint(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        parts: Sequence[tuple[str, StructuredOutputsParams]] = (),
        field: str | None = None,
    ) -> None:
        """Compile the request's output constraint now, on a worker thread (the result is cached for
        the engine), so that one the library refuses, or that compiles too slowly, is a 400 naming
        the field that held it. `parts`: the pieces a constraint was built of (the tools a grammar
        holds calls to, a response_format beside them), each named by its field: a strict one is
        compiled alone first, as strictly (the library's warnings on the whole cannot be told apart
        by part), and where the whole fails, each alone, to name the one that does; else the whole
        is named by `field` (default: the request's own constraint's)."""
        if params.structured_outputs is None:
            return
        await self._refused_part([(name, part) for name, part in parts if part.strict])
        try:
            await self.engine.compile_grammar_async(params.structured_outputs)
        except GrammarError as exc:
            await self._refused_part(parts)
            field = field or constraint_field(body)
            raise bad_request(f"{field}: {exc}", field) from None

    async def _refused_part(self, parts: Sequence[tuple[str, StructuredOutputsParams]]) -> None:
        """A 400 naming the first of `parts` the library refuses on its own; nothing where none is."""
        for name, part in parts:
            try:
                await self.engine.compile_grammar_async(part)
            except GrammarError as refused:
                raise bad_request(f"{name}: {refused}", name) from None

    async def off_loop(self, work: Callable[..., T], *args, size: int = 0) -> T:
        """Run tokenizer work of `size` characters inline when short, on a thread when long."""
        if size < LONG_PROMPT_CHARS:
            return work(*args)
        return await asyncio.to_thread(work, *args)

    async def launch(
        self,
        http: Request,
        endpoint: str,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None,
        model: str | None,
        priority: int = 0,
        logged: bool = True,
    ) -> Generation:
        """Submit the prompts (in the prefix cache namespace `cache_salt`, with the adapter `model`
        names, if it names one, at vLLM's `priority`); returns once the engine has accepted all of
        them. `logged`: each prompt has its log line and request log record when done."""
        body = await http.json() if self.sinks.request_log is not None else None
        request_ids = Generation.prompt_request_ids(request_id, len(prompts))
        if self.config.log_requests:
            logger.info("received %s %s: %d prompt(s), %r", request_id, endpoint, len(prompts), params)
        trace = None
        if self.sinks.tracer is not None:
            trace = TraceContext(trace_headers(http.headers), self.answering_model(model))
        recorder = RequestRecorder(self.sinks, endpoint, request_ids, prompts, params, body, logged, trace)
        engine_ids = [Generation.engine_id(name) for name in request_ids]
        lora = await self._adapter(model)
        generation = Generation(self.engine, engine_ids, prompts, params, cache_salt, lora, recorder, priority)
        await cancel_on_disconnect(http, generation.start())
        return generation

    async def beam_search(
        self,
        http: Request,
        endpoint: str,
        request_id: str,
        prompts: list[list[int]],
        params: BeamSearchParams,
        cache_salt: str | None,
        model: str | None,
        top_logprobs: int = 0,
    ) -> list[list[SequenceOutput]]:
        """Each prompt's best params.beam_width beams (pagoda/beam_search.py), best first, as its
        sequences, each token's logprob with its `top_logprobs` likeliest alternatives: every step
        one engine request per running beam of every prompt (each counted in the metrics, as vLLM's;
        the search has one log line)."""
        model = self.engine.config.model
        searches = [BeamSearch(ids, params, frozenset(model.eos_token_ids), model.max_model_len) for ids in prompts]
        step, started = params.step_params(), time.monotonic()
        for number in itertools.count():
            beams = step_beams(searches)
            if not beams:
                break
            step_id, step_prompts = f"{request_id}-beam{number}", [beam.tokens for _, beam in beams]
            generation = await self.launch(http, endpoint, step_id, step_prompts, step, cache_salt, model, logged=False)
            advance(beams, [_candidates(outs[0]) for outs in await self.collect(http, generation)])
        logger.info(
            "%s %s: beam search of %d prompt(s), %d beams, %d steps, e2e=%.3fs",
            request_id, endpoint, len(prompts), params.beam_width, number, time.monotonic() - started,
        )  # fmt: skip
        return [
            [self._beam_output(request_id, i, search, beam, top_logprobs) for i, beam in enumerate(search.best())]
            for search in searches
        ]

    def _beam_output(
        self, request_id: str, index: int, search: BeamSearch, beam: BeamSearchSequence, top_logprobs: int
    ) -> SequenceOutput:
        tokens = search.new_tokens(beam)
        logprobs = []
        for token, candidates in zip(tokens, beam.logprobs):  # a chosen token is one of its step's candidates
            ranked = sorted(candidates.items(), key=lambda item: item[1], reverse=True)  # most likely first
            rank = candidate_ranks(candidates)[token]
            logprobs.append(TokenLogprob(token, candidates[token], rank, dict(ranked[:top_logprobs])))
        skip = search.params.skip_special_tokens
        return SequenceOutput(
            request_id,
            index,
            text=self.tokenizer.decode(tokens, skip_special_tokens=skip),
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason,
            metrics=RequestMetrics(num_prompt_tokens=search.prompt_len),
        )

    async def _adapter(self, model: str | None) -> LoRAAdapter | None:
        """The adapter the model name names, if any: the engine's read of it, or (dropped past
        max_cpu_loras) read again from its folder."""
        request = self.adapters.get(model)
        if request is None:
            return None
        held = self.engine.held_adapter(request)  # no file read: on the loop
        if held is not None:
            return held
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(None, self.engine.adapter, request)
        except LoRAError as exc:  # its folder changed since it was loaded
            raise bad_request(f"Loading LoRA adapter {request.lora_name!r} failed: {exc}", "model") from None
        if self.adapters.get(model) is not request:  # unloaded or replaced while it was read
            self.engine.forget_adapter(request.lora_int_id)  # it serves this request, then leaves
        return adapter

    async def collect(self, http: Request, generation: Generation) -> list[list[SequenceOutput]]:
        try:
            return await cancel_on_disconnect(http, generation.collect())
        finally:
            generation.close()


def answer_id(http: Request, prefix: str, given: str | None) -> str:
    """A chat or completion answer's id, vLLM's rule: the endpoint's prefix, then the request's
    X-Request-Id header, else its body's request_id, else a new random id. A header with a control
    character (it would reach log lines) is a 400, as the body's request_id is (protocol.py)."""
    header = http.headers.get("x-request-id")
    if header and not header.isprintable():
        raise bad_request("the X-Request-Id header must hold printable characters only", "X-Request-Id")
    return prefix + (header or given or uuid.uuid4().hex)


async def cancel_on_disconnect(http: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnected (with `work` cancelled) if the client goes away first.
    The request body has been read by now, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientDisconnected
    return task.result()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(events: AsyncIterator[str], generation: Generation | FinishedGeneration) -> StreamingResponse:
    """An SSE response. An error after the stream began is sent as an error event; however the
    stream ends (finished, failed, or cancelled by a disconnect), the generation is closed."""

    async def framed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield sse(exc.body())
            yield DONE
        finally:
            generation.close()

    return StreamingResponse(
        framed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def chunk_usage(
    body: CompletionRequest | ChatCompletionRequest,
    reasoning_counter: ReasoningTokenCounter | None = None,
    forced: bool = False,
) -> Callable[[int, SequenceOutput | None], dict | None] | None:
    """What a stream's chunks carry as `usage` given a choice's prompt tokens and its latest update
    (None before it has one): None without include_usage (no field); with it, null, or with vLLM's
    continuous_usage_stats the counts so far, the reasoning tokens too with a `reasoning_counter`
    (as the last chunk's usage). `forced` (vLLM's --enable-force-include-usage): include_usage on
    every stream."""
    options = body.stream_options
    if not (forced or (options is not None and options.include_usage)):
        return None
    if options is None or not options.continuous_usage_stats:
        return lambda prompt, update: None

    def counts(prompt: int, update: SequenceOutput | None) -> dict:
        completion = 0 if update is None else len(update.token_ids)
        shown = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if reasoning_counter is not None:
            thought = 0 if update is None else reasoning_counter.count(update.token_ids, update.text)
            shown["completion_tokens_details"] = {"reasoning_tokens": thought}
        return shown

    return counts


def usage(outputs: list[list[SequenceOutput]], reasoning_counter: ReasoningTokenCounter | None = None) -> dict:
    """OpenAI usage over every prompt (counted once) and every sequence; with a `reasoning_counter` (a
    server with a reasoning parser, as vLLM), the completion's reasoning tokens too."""
    prompt = sum(outs[0].metrics.num_prompt_tokens for outs in outputs if outs)
    cached = sum(outs[0].metrics.num_cached_tokens for outs in outputs if outs)
    completion = sum(len(out.token_ids) for outs in outputs for out in outs)
    counts = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_counter is not None:
        thought = sum(reasoning_counter.count(out.token_ids, out.text) for outs in outputs for out in outs)
        counts["completion_tokens_details"] = {"reasoning_tokens": thought}
    return counts


def beam_search_params(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> BeamSearchParams:
    """vLLM's beam search of a request with use_beam_search (its n beams, the sampling values it
    takes); a 400 naming the field for what a search cannot serve: a completion's stream (a chat's
    streams the finished beams, as vLLM's), echo, prompt logprobs, an output constraint. The other
    sampling fields change nothing, as in vLLM."""
    for name, refused in [
        ("stream", body.stream and isinstance(body, CompletionRequest)),
        ("echo", getattr(body, "echo", False)),
        ("prompt_logprobs", body.prompt_logprobs is not None),
    ]:
        if refused:
            raise bad_request(f"use_beam_search does not take {name}", name)
    if params.structured_outputs is not None:
        field = constraint_field(body) or "tool_choice"  # else a forced tool call's grammar
        raise bad_request("use_beam_search cannot keep to an output constraint", field)
    try:
        return BeamSearchParams(
            beam_width=body.n,
            max_tokens=params.max_tokens,
            ignore_eos=body.ignore_eos,
            temperature=params.temperature,
            length_penalty=body.length_penalty,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as exc:  # the beam width is the one value not checked as a sampling value already
        raise bad_request(f"use_beam_search with n={body.n}: {exc}", "n") from None


class FinishedGeneration:
    """Sequences already whole (a beam search's) as a Generation's updates: each in one update."""

    def __init__(self, outputs: list[list[SequenceOutput]]) -> None:
        self.outputs = outputs

    async def updates(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        for i, outs in enumerate(self.outputs):
            for out in outs:
                yield i, replace(out, text_delta=out.text, token_ids_delta=out.token_ids, logprobs_delta=out.logprobs)

    def close(self) -> None:
        pass


def _candidates(step: SequenceOutput) -> dict[int, float]:
    """A beam's next tokens and their logprobs, most likely first, from its one-token request."""
    chosen = step.logprobs[0]
    return {**chosen.top, chosen.token_id: chosen.logprob}
