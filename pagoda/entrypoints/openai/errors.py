"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} for every failure,
FastAPI's own 422 and 404 included, so clients' error handling works unchanged."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
rejections = logging.getLogger("pagoda.requests")

MAX_REASON_CHARS = 300  # a reason quotes at most a field's name or a short value, never a prompt

RETRY_AFTER_S = 1
STATUS_CLIENT_CLOSED = 499  # nginx's convention; nobody reads it


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; the request has been aborted."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def queue_full(message: str) -> APIError:
    return APIError(
        503,
        f"The server is busy: {message}. Retry later.",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def param_of(loc: tuple) -> str | None:
    """`messages[0].content` from pydantic's ("body", "messages", 0, "content"). pydantic also puts
    the member of a union it tried into loc ("str", "list[int]", a class name); those are not
    fields the client sent, so they are left out."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _is_field_name(item):
            parts.append(f".{item}" if parts else item)
    return "".join(parts) or None


def _is_field_name(item: str) -> bool:
    return item.isidentifier() and item.islower() and item not in ("str", "int", "float", "bool", "dict", "list")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(Exception, _internal_error)


def rejected(request: Request, error: APIError) -> Response:
    """The error's response, and one log line saying which request was refused and why."""
    log_rejection(request, error)
    return error_response(error)


def log_rejection(request: Request, error: APIError) -> None:
    reason = error.message if len(error.message) <= MAX_REASON_CHARS else error.message[:MAX_REASON_CHARS] + "..."
    rejections.info("rejected %s %s: %d %s", request.method, request.url.path, error.status, reason)


def renamed(error: APIError, param: str) -> APIError:
    """The error with its field named `param` (as another API's request names it), in its message
    too where the message starts with the field."""
    old = error.param or ""
    message = error.message.replace(old, param, 1) if old and error.message.startswith(old) else error.message
    return APIError(error.status, message, param, error.code, error.headers)


async def _api_error(request: Request, exc: APIError) -> Response:
    return rejected(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    content_type = request.headers.get("content-type", "")
    about_body = any(tuple(error.get("loc", ()))[:1] == ("body",) for error in exc.errors())
    media = content_type.split(";")[0].strip().lower()
    is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    if about_body and not is_json:  # a 400, as vLLM answers it (FastAPI parses application/*+json too)
        shown = f"`{content_type[:100]}`" if content_type else "none"
        message = f"The body must be JSON, sent with Content-Type: application/json (this request's: {shown})"
        return rejected(request, bad_request(message))
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = param_of(tuple(first.get("loc", ())))
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return rejected(request, bad_request("The request body is empty: send a JSON object"))
    if first.get("type") == "json_invalid":
        return rejected(request, bad_request(f"The body is not valid JSON: {first.get('msg')}"))
    reason = first["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
    if "param" in first.get("ctx", {}):  # a validator that names the place within its field, in its message too
        outer = param_of(tuple(first.get("loc", ()))[:-1])  # the object the field is in, if nested
        inner = first["ctx"]["param"]
        if outer:
            return rejected(request, bad_request(f"{outer}.{reason}", f"{outer}.{inner}"))
        return rejected(request, bad_request(reason, inner))
    message = f"{param}: {reason}" if param else f"Invalid request body: {reason}"
    return rejected(request, bad_request(message, param))


# OpenAI routes Pagoda does not serve, and what to use instead: their 404 says so (a bare "Not Found"
# leaves a client, or an SDK that picked the route itself, guessing)
UNSERVED = {
    "/v1/embeddings": "Embeddings are not served by this server (it generates text: /v1/chat/completions, "
    "/v1/completions); an embedding model is served with --runner pooling",
    "/score": "Scores are not served by this server (it generates text); an embedding model scores pairs of texts "
    "when served with --runner pooling",
    "/rerank": "Reranking is not served by this server (it generates text); an embedding model ranks documents "
    "when served with --runner pooling",
}
# what an embedding server (--runner pooling) answers on the routes that generate text
NOT_GENERATING = (
    "Text generation is not served by this server: it runs an embedding model (--runner pooling) and serves "
    "/v1/embeddings"
)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    path = request.url.path.removeprefix(request.scope.get("root_path", "")).rstrip("/")
    if exc.status_code == 404 and (message := UNSERVED.get(path)) is not None:
        return rejected(request, APIError(404, message, code="unsupported_endpoint"))
    return rejected(request, APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))


async def _client_disconnected(request: Request, _: ClientDisconnected) -> Response:
    # The response goes nowhere (so no access-log line): the log says what became of the request.
    rejections.info("client closed %s %s before its response: aborted", request.method, request.url.path)
    return Response(status_code=STATUS_CLIENT_CLOSED)


async def _internal_error(_: Request, exc: Exception) -> Response:
    """A 500 that closes its connection: Starlette sends it, then re-raises the exception to the
    server, which drops the connection, so a client told nothing would send its next request there."""
    logger.exception("internal error while serving a request")
    error = APIError(500, f"Internal server error: {type(exc).__name__}", headers={"Connection": "close"})
    return error_response(error)
