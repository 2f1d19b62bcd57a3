"""`pagoda serve [MODEL]`: the OpenAI-compatible server. Flags are spelled as vLLM's; the engine's
come from EngineArgs.

Startup: bind the port (a busy one fails at once), serve 503s while the engine loads on threads of
its own (startup.py), then serve the API and log "ready". SIGTERM or Ctrl-C: stop accepting, let
in-flight requests finish for --shutdown-timeout seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pagoda.entrypoints.openai.serving import ServerConfig

logger = logging.getLogger("pagoda.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    from pagoda.engine.args import EngineArgs  # imports no torch
    from pagoda.tools.parsers import PARSERS as TOOL_PARSERS  # pure Python
    from pagoda.tools.reasoning import REASONING_PARSERS

    p = argparse.ArgumentParser(prog="pagoda serve", description="Serve a model over the OpenAI API.")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file path or the template itself (default: the model's)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (default: env PAGODA_API_KEY, else none)",
    )
    p.add_argument(
        "--request-log",
        type=Path,
        default=None,
        help="append one JSON line per finished request to this file; it holds users' prompts (default: off)",
    )
    p.add_argument(
        "--log-prompts", action="store_true", help="put prompt text in the per-request log line (default: %(default)s)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log record shown (default: %(default)s)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic engine line (throughput, requests, KV cache usage) in the log (default: %(default)s)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="one log line per HTTP request: client, method, path, status (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM before they are aborted "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call tools (tool_choice "auto") (default: %(default)s)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in (default: detected from the chat template, else generic)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move the model's <think> section into message.reasoning (default: none)",
    )
    EngineArgs.add_cli_args(p, positional_model=True)
    return p


def read_chat_template(value: str | None) -> str | None:
    """A file's contents when `value` names a file, else `value` itself (an inline template)."""
    from pagoda.config import ConfigError

    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read the chat template {path}: {exc}") from None
    if "{" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # before any heavy import: --help stays instant
    from pagoda.entrypoints.openai.startup import bind_socket
    from pagoda.errors import ConfigError

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    started = time.monotonic()
    try:
        chat_template = read_chat_template(args.chat_template)
        sock = bind_socket(args.host, args.port)  # first: a busy port fails before the long load
    except ConfigError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 1
    with sock:
        return asyncio.run(_serve(sock, args, chat_template, started))


def server_config(args: argparse.Namespace, chat_template: str | None) -> ServerConfig:
    from pagoda.entrypoints.openai.serving import ServerConfig
    from pagoda.entrypoints.openai.tool_calls import ToolSettings

    config = ServerConfig(
        api_key=args.api_key or os.environ.get("PAGODA_API_KEY") or None,
        chat_template=chat_template,
        request_log=args.request_log,
        log_prompts=args.log_prompts,
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser),
        log_stats=not args.disable_log_stats,
    )
    if config.request_log is not None:
        logger.warning("request log %s records every request's prompt and output", config.request_log)
    return config


def load_app(args: argparse.Namespace, chat_template: str | None) -> tuple[FastAPI, str]:
    """The engine (its model loaded on its engine thread), its FastAPI app and the served model's
    name; run on the loader thread, since the server's modules import torch (seconds)."""
    logger.info("loading %s", args.model or "the default model")
    loaded = time.monotonic()
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.openai.api import build_app

    config = server_config(args, chat_template)
    engine = AsyncEngine(EngineArgs.from_cli_args(args))
    m = engine.config.model
    logger.info(
        "loaded %s (%s, %s, max_model_len %d) in %.1f s",
        m.name,
        m.architecture,
        str(m.dtype).removeprefix("torch."),
        m.max_model_len,
        time.monotonic() - loaded,
    )
    return build_app(engine, config), m.name


async def _serve(sock: socket.socket, args: argparse.Namespace, chat_template: str | None, started: float) -> int:
    """Serve 503s on `sock` while the engine loads, then the API; the exit code."""
    import uvicorn

    from pagoda.entrypoints.openai.startup import LoadProgress, StartingApp, in_daemon_thread

    starting = StartingApp()
    server = uvicorn.Server(
        uvicorn.Config(
            starting,
            log_config=None,
            access_log=args.access_log,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            lifespan="on",
        )
    )
    with _absorb_reraised_signals():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        async with LoadProgress().reporting():
            loading = asyncio.ensure_future(in_daemon_thread(lambda: load_app(args, chat_template)))
            await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():  # stopped (SIGTERM, Ctrl-C) while loading
            loading.cancel()
            return 0 if server.started else 1
        if (failure := _load_failure(loading)) is not None:
            print(f"pagoda serve: {failure}", file=sys.stderr)
            server.should_exit = True
            await serving
            return 1
        api, model_name = loading.result()
        await starting.serve(api)
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        announce = asyncio.create_task(_announce_ready(server, model_name, url, started))
        await serving
        announce.cancel()
    return 0


def _load_failure(loading: asyncio.Future) -> str | None:
    """The one line that says why the load failed (the traceback only at --log-level debug)."""
    from pagoda.errors import ConfigError

    exc = loading.exception()
    if exc is None:
        return None
    if isinstance(exc, ConfigError):
        return str(exc)
    logger.debug("the load failed", exc_info=exc)
    return f"loading the model failed: {type(exc).__name__}: {exc}"


async def _announce_ready(server, model_name: str, url: str, started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("ready: serving %s at %s (started in %.1f s)", model_name, url, time.monotonic() - started)


@contextlib.contextmanager
def _absorb_reraised_signals() -> Iterator[None]:
    """uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal to the handler that was
    in place before it, which by default would kill the process just after a clean shutdown.
    A no-op handler there lets the shutdown end in exit code 0."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
