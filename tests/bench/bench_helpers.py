"""Helpers shared by the benchmark's tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

STUB = Path(__file__).with_name("bench_stub_server.py")


def stub_command(*args: str, port: int = 0) -> list[str]:
    return [sys.executable, str(STUB), "--port", str(port), *args]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def run_bench(base_url: str, *args: str):
    """`pagoda bench` in-process up to its EngineResult: no report files, no plots."""
    from pagoda.bench.datasets import load_workload
    from pagoda.bench.run import execute
    from pagoda.bench.settings import parse_settings

    settings = parse_settings(["--base-url", base_url, "--no-progress", "--warmup", "0", *args])
    return execute(settings, load_workload(settings.workload), "stub")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def http_server(handler: Handler) -> AsyncIterator[str]:
    """A real HTTP server on a free loopback port that answers every request with `handler`;
    yields its base URL. Run inside the test's event loop."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def sse_handler(chunks: list[bytes], status: int = 200, pause_s: float = 0.0) -> Handler:
    """Streams `chunks` as an event stream, each its own write (`pause_s` apart: separate reads)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, chunk in enumerate(chunks):
            if index and pause_s:
                await asyncio.sleep(pause_s)
            await response.write(chunk)
        await response.write_eof()
        return response

    return handle


def closed_port() -> int:
    """A loopback port nothing listens on (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
