"""How `pagoda serve` starts: the port is bound before anything loads (a busy port fails at once),
the app answers 503 while the engine loads, and once it has loaded the real app serves.

The engine and its app are built on a loader thread, and the model itself on AsyncEngine's engine
thread, so the event loop stays free to answer (503 with Retry-After) and to report progress;
nothing is loaded or run on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import Future
from typing import Any, TypeVar

from pagoda.entrypoints.openai.console.page import NO_STORE, page_file, route_path
from pagoda.entrypoints.openai.errors import RETRY_AFTER_S, APIError, error_response
from pagoda.errors import ConfigError

T = TypeVar("T")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("pagoda.serve")

QUIET_S = 4.0  # the longest a load step goes without a log line


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; ConfigError saying why when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        hint = " (is another server running on it?)" if exc.errno == errno.EADDRINUSE else ""
        if exc.errno is not None and exc.errno < 0:  # getaddrinfo's code: the host does not resolve
            reason, hint = exc.strerror.split(" (while")[0], f" (--host {host} does not resolve to an address)"
        else:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}{hint}") from None
    # Connections accepted from it inherit TCP_NODELAY (Linux). asyncio sets it only on sockets made
    # with proto IPPROTO_TCP, which these are not, and uvicorn not at all; without it the body of a
    # response waits for the client to acknowledge its headers, which a kept-alive client delays by
    # 40 ms (a non-streaming request sent right after another took 65 ms where 25 were the engine's).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class StartingApp:
    """An ASGI app that answers every HTTP request with 503 until `serve(app)` hands it the loaded
    app, and forwards everything to that app after; only the console page's own files are served
    meanwhile (the page waits for the engine). It owns the lifespan: uvicorn starts it at once,
    and at shutdown it ends the served app's lifespan (which stops the engine)."""

    def __init__(self, root_path: str = "") -> None:
        self._app: ASGIApp | None = None
        self._root_path = root_path
        self._lifespans = contextlib.AsyncExitStack()

    async def serve(self, app: Any) -> None:
        """Start `app`'s lifespan (a FastAPI app's: it starts the engine), then route to it."""
        await self._lifespans.enter_async_context(app.router.lifespan_context(app))
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self._app is not None:
            await self._app(scope, receive, send)
        elif scope["type"] == "http":
            await self._while_loading(scope)(scope, receive, send)

    def _while_loading(self, scope: Scope) -> ASGIApp:
        """A console page file (GET, with the root path or without, as the app routes them), else 503."""
        path = route_path(scope["path"], self._root_path)
        found = page_file(path) if scope["method"] in ("GET", "HEAD") else None
        if found is None:
            return loading_response()
        from starlette.responses import FileResponse

        return FileResponse(found[0], media_type=found[1], headers=NO_STORE)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        try:
            await self._lifespans.aclose()
        finally:
            await send({"type": "lifespan.shutdown.complete"})


def loading_response() -> Any:
    error = APIError(
        503,
        "The model is still loading; retry shortly.",
        code="model_loading",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
    return error_response(error)


async def in_daemon_thread(work: Callable[[], T]) -> T:
    """`work()`'s result, computed on a daemon thread: a SIGTERM during a load need not wait for it."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            done.set_exception(exc)

    threading.Thread(target=run, name="pagoda-load", daemon=True).start()
    return await asyncio.wrap_future(done)


class LoadProgress(logging.Handler):
    """Watches the `pagoda` loggers during the load: `watch()` logs which step is still running
    whenever `quiet_s` pass without a line, so no step of a long load is silent for longer."""

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        super().__init__()
        self.quiet_s = quiet_s
        self.started = time.monotonic()
        self.last_line = self.started
        self.step = "starting the loader"

    def emit(self, record: logging.LogRecord) -> None:
        self.last_line = time.monotonic()
        if record.levelno == logging.INFO and not getattr(record, "heartbeat", False):  # a step, not a warning
            self.step = record.getMessage()

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.quiet_s / 4)
            now = time.monotonic()
            if now - self.last_line >= self.quiet_s:
                logger.info(
                    "still loading (%.0f s so far): %s", now - self.started, self.step, extra={"heartbeat": True}
                )

    @contextlib.asynccontextmanager
    async def reporting(self, package: str = "pagoda") -> Any:
        """Watches `package`'s log records while the block runs."""
        source = logging.getLogger(package)
        source.addHandler(self)
        watcher = asyncio.create_task(self.watch())
        try:
            yield self
        finally:
            watcher.cancel()
            source.removeHandler(self)
