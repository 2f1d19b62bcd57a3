"""The FastAPI app: routes over one AsyncEngine. All state is explicit, built here and held by
the route closures; nothing is global, so tests can build several apps in one process.

Auth (--api-key): every /v1 route and the admin routes need `Authorization: Bearer KEY` (or,
as Anthropic's clients send it, `X-Api-Key: KEY`);
/health, /load, /version, /metrics, /tokenize, /detokenize and the gateway's load and info routes
(gateway.py) stay open (as in vLLM and SGLang). The web console (console/) serves its page
openly and its data under the same key as /v1.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, MutableHeaders

from pagoda import __version__
from pagoda.config import EngineConfig
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai import chat, completions, embeddings, messages, responses, scores
from pagoda.entrypoints.openai.console.feed import EngineFeed, RecentRequests
from pagoda.entrypoints.openai.console.page import route_path
from pagoda.entrypoints.openai.console.routes import data_routes, page_routes
from pagoda.entrypoints.openai.errors import APIError, bad_request, install_handlers
from pagoda.entrypoints.openai.gateway import gateway_routes
from pagoda.entrypoints.openai.logprobs import TokenTexts
from pagoda.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.entrypoints.openai.params import ModelLimits, check_token_ids
from pagoda.entrypoints.openai.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.recording import RecordSinks
from pagoda.entrypoints.openai.request_log import RequestLogWriter
from pagoda.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.serving import InFlight, ServerConfig, ServerState
from pagoda.entrypoints.openai.stats_log import log_stats
from pagoda.entrypoints.openai.tracing import RequestTracer
from pagoda.lora import LoRAError, LoRANotFoundError, LoRARequest
from pagoda.tools.reasoning import REASONING_PARSERS, ReasoningTokenCounter

logger = logging.getLogger(__name__)

RESET_POLL_S = 0.05


def build_state(engine: AsyncEngine, config: ServerConfig) -> ServerState:
    model = engine.config.model
    adapters = {module.lora_name: module for module in config.lora_modules}
    for module in config.lora_modules:  # each read at startup (LoRAError stops it)
        engine.adapter(module)
    # vLLM's max_lora label: --max-loras where given, else the adapters served (a step mixes any number)
    lora_slots = (lambda: config.max_loras or len(adapters)) if engine.config.enable_lora else None
    # under vLLM's names, vLLM's model_name label too: the MODEL argument as given where no
    # --served-model-name is (dashboards and alerts name the model as vLLM labelled it)
    vllm_label = config.metrics_prefix == "vllm" and config.model_argument
    metrics_model = config.model_argument if vllm_label else model.name
    metrics = ServerMetrics(lambda: engine.stats, metrics_model, model.max_model_len, lora_slots, config.metrics_prefix)
    request_log = RequestLogWriter(config.request_log) if config.request_log is not None else None
    return ServerState(
        engine=engine,
        config=config,
        model_name=model.name,
        limits=ModelLimits(
            model.max_model_len,
            model.vocab_size,
            config.sampling_defaults(model.generation_defaults),
            config.max_logprobs,
        ),
        sinks=RecordSinks(
            metrics,
            request_log,
            config.log_prompts,
            engine.tokenizer,
            RecentRequests(),
            config.max_log_len,
            RequestTracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None,
            config.log_outputs,
        ),
        token_texts=TokenTexts(engine.tokenizer),
        system_fingerprint=system_fingerprint(engine.config, config.fingerprint_mode, config.fingerprint_value),
        reasoning_counter=ReasoningTokenCounter.of(REASONING_PARSERS[config.tools.reasoning_parser], engine.tokenizer)
        if config.tools.reasoning_parser
        else None,
        adapters=adapters,
        response_store=ResponseStore() if config.store_responses else None,
    )


def system_fingerprint(config: EngineConfig, mode: str, value: str | None) -> str | None:
    """vLLM's modes: full and hash give pagoda-VERSION-HASH8, HASH8 of what decides a request's
    outputs (a replica has no parallelism of its own for full to name); custom the value; none None.
    With a seed, equal fingerprints mean the same backend (OpenAI's meaning of the field)."""
    if mode == "none":
        return None
    if mode == "custom":
        return value
    decides = (
        config.model,  # path, name, architecture, dtype, shapes, tokenizer, quantization
        config.cache.kv_cache_dtype,
        config.device.type,
        config.attention_backend,
        config.deterministic,
        config.speculative,
        config.enforce_eager,
    )
    return f"pagoda-{__version__}-{hashlib.sha256(repr(decides).encode()).hexdigest()[:8]}"


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The engine thread starts with the app (in its event loop) and stops with it."""
    state = build_state(engine, config)
    feed = EngineFeed(lambda: engine.stats, state.sinks.recent)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats = asyncio.create_task(_log_stats(engine, config)) if config.log_stats else None
        sampling = asyncio.create_task(feed.run())
        try:
            yield
        finally:
            sampling.cancel()
            if stats is not None:
                stats.cancel()
            # joined off the loop, so that cancelled requests still send their aborts meanwhile
            await asyncio.to_thread(engine.shutdown)
            if state.sinks.request_log is not None:
                await asyncio.to_thread(state.sinks.request_log.close)
            if state.sinks.tracer is not None:  # the spans still queued go out
                await asyncio.to_thread(state.sinks.tracer.shutdown)

    docs = {} if config.api_docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="Pagoda", version=__version__, lifespan=lifespan, **docs)
    # the root path on the app (as vLLM sets it), not uvicorn's: a path with the prefix and one a
    # proxy stripped of it both find their route (set after: FastAPI's argument is deprecated)
    app.root_path = config.root_path
    cors = config.cors
    # outermost: a preflight is answered before the key check, and errors carry the CORS headers too
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.origins),
        allow_methods=list(cors.methods),
        allow_headers=list(cors.headers),
        allow_credentials=cors.credentials,
    )
    if config.request_id_headers:  # outside CORS: a preflight's answer carries it too
        app.add_middleware(RequestIdHeader)
    app.add_middleware(ServerLoad, load=state.load)
    # vLLM's HTTP series on /metrics (http_requests_total{handler,method,status}, durations, sizes),
    # by the library vLLM uses, with the routes it leaves out
    Instrumentator(excluded_handlers=UNCOUNTED_HTTP_ROUTES, registry=state.sinks.metrics.registry).instrument(app)
    install_handlers(app)
    authorized = [Depends(_require_key(config.api_keys))]
    app.include_router(_v1_routes(state), dependencies=authorized)
    app.include_router(_admin_routes(state), dependencies=authorized)
    app.include_router(_invocation_routes(state), dependencies=authorized)
    app.include_router(_scoring_routes(state), dependencies=authorized)
    if config.runtime_lora_updating and not engine.config.enable_lora:
        logger.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is set but --enable-lora is not: no adapter routes")
    elif config.runtime_lora_updating:
        logger.warning("LoRA adapters may be loaded and unloaded while serving (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
        app.include_router(_lora_routes(state), dependencies=authorized)
    app.include_router(_open_routes(state))
    app.include_router(gateway_routes(state))
    app.include_router(data_routes(state, feed, config.reports), dependencies=authorized)
    app.include_router(page_routes())
    return app


async def _log_stats(engine: AsyncEngine, config: ServerConfig) -> None:
    device = engine.config.device.type
    await log_stats(lambda: engine.stats, "GPU" if device == "cuda" else device.upper(), config.log_stats_interval_s)


class RequestIdHeader:
    """ASGI middleware: every HTTP response carries `X-Request-Id`, the request's own header where it
    sent one, else a new random hex id (vLLM's --enable-request-id-headers)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


# the routes whose requests vLLM's /metrics leaves out of its HTTP series (regular expressions)
UNCOUNTED_HTTP_ROUTES = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]
# the routes whose requests vLLM counts as its server load (GET /load): generation, and an
# embedding model's (its embeddings, scores and rankings)
LOAD_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations"}
    | {"/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"}
)


class ServerLoad:
    """ASGI middleware: counts the requests of LOAD_PATHS in flight into `load`, each from its arrival
    until its answer's last byte is sent or its client has gone (a stream's handler returns only
    then), refused ones included while they are answered, as vLLM counts them."""

    def __init__(self, app, load: InFlight) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope, receive, send) -> None:
        path = route_path(scope.get("path", ""), scope.get("root_path", ""))
        if scope["type"] != "http" or scope["method"] != "POST" or path not in LOAD_PATHS:
            return await self.app(scope, receive, send)
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


def _require_key(api_keys: tuple[str, ...]):
    async def check(authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> None:
        if not api_keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # Anthropic's clients send the key as X-Api-Key
        sent = (token.strip() if scheme.lower() == "bearer" else (x_api_key or "")).encode()
        # every key compared, in constant time each: which one matched leaks nothing either
        matches = [hmac.compare_digest(sent, key.encode()) for key in api_keys]
        if not sent or not any(matches):
            raise APIError(
                401,
                "Missing or incorrect API key: send `Authorization: Bearer KEY` (or `X-Api-Key: KEY`).",
                code="invalid_api_key",
            )

    return check


def _v1_routes(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())

    def card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagoda",
            # as vLLM's: the model it loaded (a .gguf file itself, not the folder Pagoda converts it to)
            "root": state.engine.config.model.gguf_file or state.engine.config.model.path,
            "parent": None,  # vLLM's: an adapter's card names the model it adapts
            "max_model_len": state.limits.max_model_len,
            # batch-invariant kernels: equal requests get bitwise-equal logprobs (docs/determinism.md)
            "deterministic": state.engine.config.deterministic,
        }

    def adapter_card(name: str) -> dict:
        """An adapter's card, as vLLM lists one: its folder as `root`, the model it adapts as `parent`."""
        adapter = state.adapters[name]
        parent = adapter.base_model_name if adapter.base_model_name in state.served_names else state.model_name
        return {**card(name), "root": adapter.lora_path, "parent": parent}  # parent: as vLLM's

    @router.get("/models")
    async def models() -> dict:
        cards = [card(name) for name in state.served_names] + [adapter_card(name) for name in state.adapters]
        return {"object": "list", "data": cards}

    @router.get("/models/{model:path}")  # OpenAI's retrieve (a name may hold slashes)
    async def model_card(model: str) -> dict:
        if not model:  # "/v1/models/": the list, as before this route
            return await models()
        state.check_model(model)  # 404 model_not_found for a name this server does not take
        return adapter_card(model) if model in state.adapters else card(model)

    @router.post("/completions")
    async def create_completion(body: CompletionRequest, http: Request) -> Response:
        return await completions.create_completion(state, body, http)

    @router.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, http: Request) -> Response:
        return await chat.create_chat_completion(state, body, http)

    @router.post("/embeddings")
    async def create_embedding(body: EmbeddingRequest, http: Request) -> Response:
        return await embeddings.create_embedding(state, body, http)

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, http: Request) -> Response:
        return await responses.create_response(state, body, http)

    @router.post("/messages")  # Anthropic's Messages API, as vLLM serves it
    async def create_message(body: AnthropicMessagesRequest, http: Request) -> Response:
        return await messages.create_message(state, body, http)

    @router.post("/messages/count_tokens")
    async def count_message_tokens(body: AnthropicCountTokensRequest, http: Request) -> Response:
        return await messages.count_tokens(state, body, http)

    # a stored response's routes; without the store every id is unknown (vLLM's 404 without its store)
    def stored(response_id: str) -> StoredResponse:
        found = state.response_store.get(response_id) if state.response_store is not None else None
        if found is None:
            raise responses.not_stored(response_id)
        return found

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return stored(response_id).response

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        stored(response_id)
        state.response_store.delete(response_id)  # type: ignore[union-attr]: stored() found it there
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, order: Literal["asc", "desc"] = "desc", limit: int = Query(20, ge=1, le=100), after: str = ""
    ) -> dict:
        """OpenAI's list: `limit` items in `order` (newest first by default), from after the item `after`."""
        items = stored(response_id).input_items
        items = items[::-1] if order == "desc" else items
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else 0
        page = items[start : start + limit]
        more = start + limit < len(items)
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": more}

    @router.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        stored(response_id)
        raise bad_request("Only background responses can be cancelled; this server runs none", "response_id")

    return router


def _scoring_routes(state: ServerState) -> APIRouter:
    """vLLM's scoring routes, under each of its paths for them; an embedding model serves them."""
    router = APIRouter()

    @router.post("/score")
    @router.post("/v1/score", include_in_schema=False)  # the aliases are vLLM's too, not listed twice
    async def score(body: ScoreRequest, http: Request) -> Response:
        return await scores.create_score(state, body, http)

    @router.post("/rerank")
    @router.post("/v1/rerank", include_in_schema=False)
    @router.post("/v2/rerank", include_in_schema=False)
    async def rerank(body: RerankRequest, http: Request) -> Response:
        return await scores.create_rerank(state, body, http)

    return router


def _invocation_routes(state: ServerState) -> APIRouter:
    """SageMaker's inference route, as vLLM serves it (with /ping): the body's kind picks the
    endpoint. Unlike vLLM's, it takes the API key as /v1 does."""
    router = APIRouter()

    @router.post("/invocations")
    async def invocations(http: Request) -> Response:
        try:
            body = await http.json()
        except ValueError as exc:
            raise bad_request(f"JSON decode error: {exc}") from None
        if (
            isinstance(body, dict)
            and state.engine.config.pooler is not None
            and ("input" in body or "messages" in body)
        ):
            return await embeddings.create_embedding(state, _validated(EmbeddingRequest, body), http)
        if isinstance(body, dict) and "messages" in body:
            return await chat.create_chat_completion(state, _validated(ChatCompletionRequest, body), http)
        if isinstance(body, dict) and "prompt" in body:
            return await completions.create_completion(state, _validated(CompletionRequest, body), http)
        raise bad_request(
            "Cannot find suitable handler for request. Expected one of: ChatCompletionRequest (messages), "
            "CompletionRequest (prompt), EmbeddingRequest (input, with --runner pooling)"
        )

    return router


def _validated(kind: type[BaseModel], body: dict) -> Any:
    """The body as `kind`; its errors as the 400 a /v1 route gives for them."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]) from None


def _admin_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/reset_prefix_cache")
    @router.post("/flush_cache")  # SGLang's name, which a gateway's /flush_cache sends to every worker
    async def reset_prefix_cache() -> Response:
        wait_s = state.config.reset_wait_s
        if not await _reset_when_idle(state.engine, wait_s):
            raise APIError(
                409,
                f"Requests were still running after {wait_s:g} s; reset the prefix cache when the server is idle.",
                code="requests_running",
            )
        return JSONResponse({"status": "ok"})

    return router


def _lora_routes(state: ServerState) -> APIRouter:
    """vLLM's runtime adapter routes: an adapter loaded becomes a model name, one unloaded stops
    being one (requests running it finish with it) and its weights leave the model. Every load
    takes a new adapter id (the engine reads an id's folder once), and each read of an adapter is
    its own prefix cache namespace, so a reload under a name never meets its earlier weights' KV
    (vLLM keeps it and warns)."""
    router = APIRouter()
    lock = asyncio.Lock()
    ids = itertools.count(len(state.config.lora_modules) + 1)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        if not name or not body.lora_path:
            missing = "lora_name" if not name else "lora_path"
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", missing)
        if name in state.base_names:
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model name.", "lora_name")
        async with lock:
            previous = state.adapters.get(name)
            if previous is not None and not body.load_inplace:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            request = LoRARequest(name, next(ids), body.lora_path)
            try:
                await asyncio.get_running_loop().run_in_executor(None, state.engine.adapter, request)
            except LoRANotFoundError as exc:
                raise APIError(404, str(exc), "lora_path", "not_found") from None
            except LoRAError as exc:
                raise bad_request(str(exc), "lora_path") from None
            state.adapters[name] = request
            if previous is not None:
                state.engine.forget_adapter(previous.lora_int_id)
        logger.info("LoRA adapter %r loaded from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with lock:
            adapter = state.adapters.pop(name, None)
            if adapter is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
            state.engine.forget_adapter(adapter.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router


async def _reset_when_idle(engine: AsyncEngine, wait_s: float) -> bool:
    """Reset the prefix cache once no request is in flight, waiting up to `wait_s` for the running
    ones to finish (a client that has just read its last token may ask before its request has
    left the engine); False if requests still run then."""
    deadline = time.monotonic() + wait_s
    while True:
        if engine.num_in_flight == 0 and await engine.reset_prefix_cache():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(RESET_POLL_S)


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    @router.get("/ping")  # vLLM's (SageMaker's health check), both methods
    @router.post("/ping")  # (one route of two methods would give /openapi.json one operation id twice)
    async def health() -> Response:
        return Response(status_code=200 if state.engine.is_alive else 503)

    @router.get("/load")
    async def load() -> dict:  # vLLM's
        return {"server_load": state.load.count}

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.sinks.metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        ids = await _tokenize(state, body)
        answer = {"tokens": ids, "count": len(ids), "max_model_len": state.limits.max_model_len}
        if body.return_token_strs:
            answer["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return answer

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        check_token_ids(body.tokens, state.limits.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return router


async def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of `prompt` and `messages`.", "prompt")
    if body.messages is not None:
        return await chat.render_body_messages(state, body)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return await state.off_loop(
        lambda: state.tokenizer.encode(body.prompt, add_special_tokens=add_special), size=len(body.prompt)
    )
