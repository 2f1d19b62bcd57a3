"""`pagoda serve [MODEL]`: the OpenAI-compatible server. Flags are spelled as vLLM's.

Startup: load the model (the port is not open yet), start uvicorn, whose lifespan starts the
engine thread, then log "ready" once the socket accepts. SIGTERM or Ctrl-C: stop accepting, let
in-flight requests finish for --shutdown-timeout seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("pagoda.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagoda serve", description="Serve a model over the OpenAI API.")
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: from the path)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens in one step")
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV cache size in GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"])
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="waiting requests beyond this are refused with 503 (default: unbounded)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu or cuda")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="GPU: the share of its memory the engine may use; the KV pool gets what is left",
    )
    p.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="GPU (compute capability >= 8.9): fp8 weights")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's config, for timing without weights",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template: a file path or the template itself")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (also env PAGODA_API_KEY)")
    p.add_argument(
        "--request-log",
        type=Path,
        default=None,
        help="append one JSON line per finished request to this file (holds users' prompts)",
    )
    p.add_argument("--log-prompts", action="store_true", help="put prompt text in the per-request log line")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish after SIGTERM before they are aborted",
    )
    return p.parse_args(argv)


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
    args = parse_args(argv)  # before any heavy import: --help stays instant
    from pagoda.config import ConfigError

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    started = time.monotonic()
    try:
        chat_template = read_chat_template(args.chat_template)
        engine = load_engine(args)
    except ConfigError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 1
    from pagoda.entrypoints.openai.api import build_app
    from pagoda.entrypoints.openai.serving import ServerConfig

    config = ServerConfig(
        api_key=args.api_key or os.environ.get("PAGODA_API_KEY") or None,
        chat_template=chat_template,
        request_log=args.request_log,
        log_prompts=args.log_prompts,
    )
    if config.request_log is not None:
        logger.warning("request log %s records every request's prompt and output", config.request_log)
    app = build_app(engine, config)
    return asyncio.run(_serve(app, args, engine.config.model.name, started))


def load_engine(args: argparse.Namespace):
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine

    engine_args = EngineArgs(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        max_queue=args.max_queue,
        seed=args.seed,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        load_format=args.load_format,
    )
    logger.info("loading %s", args.model or "the default model")
    loaded = time.monotonic()
    engine = AsyncEngine(engine_args)
    m = engine.config.model
    logger.info(
        "loaded %s (%s, %s, max_model_len %d) in %.1f s",
        m.name,
        m.architecture,
        str(m.dtype).removeprefix("torch."),
        m.max_model_len,
        time.monotonic() - loaded,
    )
    return engine


async def _serve(app, args: argparse.Namespace, model_name: str, started: float) -> int:
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    announce = asyncio.create_task(_announce_ready(server, args, model_name, started))
    with _absorb_reraised_signals():
        await server.serve()
    announce.cancel()
    return 0 if server.started else 1


async def _announce_ready(server, args: argparse.Namespace, model_name: str, started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info(
        "ready: serving %s at http://%s:%d (started in %.1f s)",
        model_name,
        args.host,
        args.port,
        time.monotonic() - started,
    )


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
