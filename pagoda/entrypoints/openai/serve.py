"""`pagoda serve [MODEL]`: the OpenAI-compatible server. Flags are spelled as vLLM's; the engine's
come from EngineArgs.

`--data-parallel-size N` starts N such servers behind SGLang Model Gateway instead
(data_parallel.py).

Startup: bind the port (a busy one fails at once), serve 503s while the engine loads on threads of
its own (startup.py), then serve the API and log "ready". SIGTERM or Ctrl-C: stop accepting, let
in-flight requests finish for --shutdown-timeout seconds, end the rest with an error (a 503 body,
or an error event on a stream), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.entrypoints import LOG_FORMAT
from pagoda.entrypoints.parsing import Parser
from pagoda.generation_config import sampling_defaults
from pagoda.sampling_params import MAX_LOGPROBS

logger = logging.getLogger("pagoda.serve")

STOP_POLL_S = 0.1  # how often the stop watcher reads uvicorn's should_exit (its own main loop's tick)
ABORT_ANSWER_S = 5.0  # after the abort at --shutdown-timeout, for handlers to send their errors

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.openai.serving import ServerConfig
    from pagoda.lora import LoRARequest


_TLS = "Pagoda serves plain HTTP: put a TLS-terminating proxy (nginx, Caddy) in front"
_NO_HUB = "Pagoda downloads nothing: the model is a local folder or .gguf file"
_ONE_DEVICE = "a replica runs on one device; scale out with --data-parallel-size"
_ONE_MACHINE = (
    "--data-parallel-size N starts N replicas on this machine behind a gateway; across machines, run a server on each"
)
_CORES = "the compute threads are --threads (or PAGODA_NUM_THREADS, OMP_NUM_THREADS), pinned with --bind-cores"
_GRAPH_SIZES = "CUDA graphs are captured for the batch sizes Pagoda picks (or none: --enforce-eager)"
_SPECULATIVE = 'speculative decoding is --speculative-config \'{"method": ..., "num_speculative_tokens": N}\''
# vLLM serve flags Pagoda does not take, with why and what to do instead (parsing.Parser says so)
VLLM_FLAGS_NOT_TAKEN = {
    "--ssl-keyfile": _TLS,
    "--ssl-certfile": _TLS,
    "--ssl-ca-certs": _TLS,
    "--ssl-cert-reqs": _TLS,
    "--middleware": "no custom ASGI middleware: put a proxy in front",
    "--pipeline-parallel-size": _ONE_DEVICE,
    "--distributed-executor-backend": _ONE_DEVICE,
    "--cpu-offload-gb": "weights stay on the device that runs the model",
    "--hf-overrides": "no config overrides: edit the model folder's config.json",
    "--revision": _NO_HUB,
    "--code-revision": _NO_HUB,
    "--download-dir": _NO_HUB,
    "--tokenizer-mode": "the model's own (fast) tokenizer only",
    "--compilation-config": "no torch.compile settings (CUDA graphs: on unless --enforce-eager)",
    "--structured-outputs-config": "structured outputs always use xgrammar",
    "--guided-decoding-backend": "structured outputs always use xgrammar",
    "--limit-mm-per-prompt": "text only: no multimodal inputs",
    "--swap-space": "a preempted request recomputes its KV cache; nothing swaps to CPU memory",
    "--no-enable-chunked-prefill": "prompts are always prefilled in chunks (their size: --max-num-batched-tokens)",
    "--fully-sharded-loras": _ONE_DEVICE,
    "--lora-target-modules": "an adapter's updates apply to every projection its file holds",
    "--max-lora-extra-vocab-size": "adapters add no tokens: they share the base model's vocabulary",
    "--lora-extra-vocab-size": "adapters add no tokens: they share the base model's vocabulary",
    "--enable-sleep-mode": "no sleep mode: a server holds its weights until it stops; stop it and start it "
    "again (a cold start takes seconds)",
    "--hf-token": _NO_HUB,
    "--tokenizer-revision": _NO_HUB,
    "--data-parallel-rank": _ONE_MACHINE,
    "--data-parallel-start-rank": _ONE_MACHINE,
    "--data-parallel-size-local": _ONE_MACHINE,
    "--data-parallel-address": _ONE_MACHINE,
    "--data-parallel-rpc-port": _ONE_MACHINE,
    "--data-parallel-backend": _ONE_MACHINE,
    "--data-parallel-hybrid-lb": _ONE_MACHINE,
    "--data-parallel-external-lb": _ONE_MACHINE,
    "--headless": _ONE_MACHINE,
    "--numa-bind": _CORES,
    "--numa-bind-nodes": _CORES,
    "--numa-bind-cpus": _CORES,
    "--enable-prompt-embeds": "prompts are text or token ids; no embeddings",
    "--async-scheduling": "a step is scheduled once the one before it has been read",
    "--cudagraph-capture-sizes": _GRAPH_SIZES,
    "--max-cudagraph-capture-size": _GRAPH_SIZES,
    "--stream-interval": "a stream sends each step's tokens as they come",
    "--logits-processors": "no custom logits processors: the sampler's parameters are vLLM's request fields",
    "--convert": "no model conversion: --runner pooling makes embeddings (vLLM's convert embed); no "
    "classification or reward models",
    "--kv-transfer-config": "no disaggregated prefill: one server prefills and decodes",
    "--kv-offloading-size": "the KV cache lives in one pool (--kv-cache-memory); nothing is offloaded",
    "--kv-offloading-backend": "the KV cache lives in one pool (--kv-cache-memory); nothing is offloaded",
    "--grpc": "HTTP only: the OpenAI and Anthropic APIs",
    "--uds": "a TCP port only (--host, --port): put a proxy in front for a unix socket",
    "--collect-detailed-traces": "a request's span has its queue, prefill and decode times, not each step's "
    "model and worker timings",
    "--tool-parser-plugin": "no parser plugins: --tool-call-parser names a built-in format",
    "--reasoning-parser-plugin": "no parser plugins: --reasoning-parser names a built-in format",
    "--spec-method": _SPECULATIVE,
    "--spec-model": _SPECULATIVE,
    "--spec-tokens": _SPECULATIVE,
    "--long-prefill-token-threshold": "the nearest is --max-prefill-with-decodes N: a step's prompt tokens while "
    "decodes run",
    "--num-gpu-blocks-override": "the KV pool is sized by --gpu-memory-utilization on a GPU, --kv-cache-memory "
    "on a CPU",
    "--max-parallel-loading-workers": "weights load in one pass; a cold start takes seconds",
    "--model-impl": "Pagoda's own model code (Llama, Mistral, Qwen2, Qwen3) runs every model",
    "--ignore-patterns": _NO_HUB,
    "--hf-config-path": "the model folder's own config.json is read",
    "--skip-tokenizer-init": "the model's tokenizer is always loaded: prompts are text or token ids",
    "--mm-processor-kwargs": "text only: no multimodal inputs",
    "--tool-server": "no built-in tools (browsing, code, MCP): function tools only",
}


def build_parser() -> argparse.ArgumentParser:
    from pagoda.engine.args import EngineArgs, add_option_flags  # imports no torch
    from pagoda.entrypoints.openai.data_parallel import ScaleArgs
    from pagoda.model_files import CONTENT_FORMATS
    from pagoda.tools.parsers import PARSERS as TOOL_PARSERS  # pure Python
    from pagoda.tools.reasoning import REASONING_PARSERS
    from pagoda.tools.tags import TOOL_STRICT_LEVELS

    p = Parser(
        prog="pagoda serve",
        description="Serve a model over the OpenAI API.",
        foreign=VLLM_FLAGS_NOT_TAKEN,
        config_file=True,
    )
    p.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        help="vLLM's spelling of the MODEL argument; both given must agree (default: the MODEL argument)",
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file path or the template itself (default: the model's)",
    )
    p.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMATS,
        help="how message content reaches the chat template: a string (text parts joined by newlines), or "
        "openai's list of text parts; auto: the list where the template loops over content (default: %(default)s)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="take a chat request's own chat_template (and /tokenize's), rendered in transformers' Jinja "
        "sandbox; without it such a request is a 400 (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        help="require `Authorization: Bearer KEY`, any of the keys given (default: env PAGODA_API_KEY, "
        "else vLLM's VLLM_API_KEY, else none)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_json_strings("--allowed-origins"),
        default=[],
        help="origins a browser page may call the API from, a JSON list such as '[\"https://app.example\"]' "
        '(["*"]: any); vLLM\'s flag; without it no cross-origin calls (default: none)',
    )
    p.add_argument(
        "--allowed-methods",
        type=_json_strings("--allowed-methods"),
        default=["*"],
        help="HTTP methods cross-origin calls may use, a JSON list (default: all)",
    )
    p.add_argument(
        "--allowed-headers",
        type=_json_strings("--allowed-headers"),
        default=["*"],
        help="request headers cross-origin calls may send, a JSON list (default: all)",
    )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let cross-origin calls carry cookies and HTTP authentication (default: %(default)s)",
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix under which a reverse proxy serves the server, e.g. /pagoda: every route answers "
        "with it and without it (a proxy that strips it or not), as vLLM's; the web console's links are relative, "
        "so it works there (default: none)",
    )
    p.add_argument(
        "--request-log",
        type=Path,
        default=None,
        help="append one JSON line per finished request to this file; it holds users' prompts (default: off)",
    )
    p.add_argument(
        "--reports",
        type=Path,
        default=None,
        metavar="DIR",
        help="show the `pagoda bench` / `pagoda bakeoff` result folders in DIR on the console's Reports page "
        "(default: none)",
    )
    p.add_argument(
        "--log-prompts", action="store_true", help="put prompt text in the per-request log line (default: %(default)s)"
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="cut --log-prompts' prompt text to its first N characters (default: whole)",
    )
    p.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no API docs: /docs, /redoc and /openapi.json answer 404 (default: %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log record shown (default: %(default)s)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["trace", "debug", "info", "warning", "error", "critical"],
        help="uvicorn's own loggers (default: --log-level's)",
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, endpoint and sampling parameters as it arrives, no prompt text "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no log line per request: none as it arrives (the default), and none as it is refused or "
        "finishes (default: %(default)s)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="accepted for vLLM's command lines: prompts are always prefilled in chunks (default: %(default)s)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="accepted for vLLM's command lines: no access log is the default, see --access-log (default: %(default)s)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic engine statistics line in the log (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-prefix",
        choices=("pagoda", "vllm"),
        default="pagoda",
        help="the prefix of /metrics' names: vllm gives vLLM's own names (vllm:num_requests_waiting, ..), which "
        "dashboards and autoscalers built for vLLM read (default: %(default)s)",
    )
    p.add_argument(
        "--log-config-file",
        default=None,
        metavar="JSON",
        help="Python logging's dictConfig as a JSON file, in place of the default handler, format and --log-level "
        "(vLLM's) (default: env VLLM_LOGGING_CONFIG_PATH, else none)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send an OpenTelemetry span per finished request to this OTLP collector (gRPC; HTTP with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), as vLLM's; needs pip install 'pagoda[tracing]' "
        "(default: off)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="accepted for vLLM's command lines: a step is scheduled once the one before it has been read "
        "(default: %(default)s)",
    )
    for flag, why in (
        ("--disable-custom-all-reduce", "tensor parallelism's all-reduce is torch.distributed's (NCCL)"),
        ("--disable-cascade-attn", "there is no cascade attention"),
        ("--disable-sliding-window", "a model with a sliding window is served within it (max_model_len capped)"),
    ):
        p.add_argument(
            flag, action="store_true", help=f"accepted for vLLM's command lines: {why} (default: %(default)s)"
        )
    p.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=("raw_logprobs",),
        help="accepted for vLLM's command lines: logprobs are the model's own, before any sampling parameter "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="accepted for vLLM's command lines: GET /load always counts the generation requests in flight "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="one log line per HTTP request: client, method, path, status (default: %(default)s)",
    )
    p.add_argument(
        "--response-role",
        default="assistant",
        help="the role of a chat reply after the generation prompt (without one, a reply continues the last "
        "message and takes its role) (default: %(default)s)",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name their tokens "token_id:N" unless a request sets return_tokens_as_token_ids '
        "(default: %(default)s)",
    )
    p.add_argument(
        "--fingerprint-mode",
        choices=("full", "hash", "custom", "none"),
        default="full",
        help="the system_fingerprint of chat and completion answers: full and hash, pagoda-VERSION-HASH8 (a hash "
        "of what decides the outputs: model, dtype, quantization, KV cache, attention backend, deterministic "
        "mode, speculation); custom, --fingerprint-value; none, null (vLLM's flag) (default: %(default)s)",
    )
    p.add_argument(
        "--fingerprint-value", help="the system_fingerprint with --fingerprint-mode custom (default: %(default)s)"
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with a usage chunk, as if it asked stream_options.include_usage (vLLM's flag) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="accepted for vLLM's command lines: usage always has prompt_tokens_details.cached_tokens "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries an X-Request-Id header: the request's own, else a new random id "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help="the most logprobs, top_logprobs or prompt_logprobs a request may ask for; more is a 400 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="where unset sampling values come from (temperature, top_p, top_k, min_p, the three penalties, "
        "max_new_tokens as chat's default max_tokens): auto, the model's generation_config.json; "
        "vllm, OpenAI's defaults; or a folder holding a generation_config.json (default: %(default)s)",
    )
    p.add_argument(
        "--override-generation-config",
        type=_generation_overrides,
        default={},
        metavar="JSON",
        help="sampling defaults over --generation-config's, a JSON object of generation_config.json keys such as "
        "'{\"temperature\": 0.5}' (vLLM's flag) (default: none)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="accepted for vLLM's command lines; only 1 (Pagoda has no tensor parallelism) (default: %(default)s)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_template_kwargs,
        default={},
        metavar="JSON",
        help="template variables for every chat request, under the request's own chat_template_kwargs, e.g. "
        "'{\"enable_thinking\": false}' (vLLM's flag) (default: none)",
    )
    p.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="vLLM's: the per-request log line has the output text too, cut to --max-log-len (default: %(default)s)",
    )
    p.add_argument(
        "--disable-access-log-for-endpoints",
        default="",
        metavar="PATHS",
        help="vLLM's: no --access-log line for these comma-separated paths, e.g. /health,/metrics (default: none)",
    )
    p.add_argument(
        "--max-num-queued-reqs",
        dest="max_queue",
        type=int,
        help="vLLM's spelling of --max-queue (default: unbounded)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=_gib_of_bytes,
        metavar="BYTES",
        help="vLLM's: the KV pool in bytes, in vLLM's units (4g is 4 x 10^9, 4G is 4 GiB), as --kv-cache-memory in "
        "GiB (default: --kv-cache-memory's)",
    )
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="accepted for vLLM's command lines; only 1 (one API server process serves each replica; scale out "
        "with --data-parallel-size) (default: %(default)s)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served as model names (with --enable-lora): NAME=PATH, or vLLM's JSON "
        '\'{"name": NAME, "path": PATH, "base_model_name": BASE}\' (default: none)',
    )
    p.add_argument(
        "--lora-dtype",
        type=_lora_dtype,
        default="auto",
        help="accepted for vLLM's command lines: adapters run in the model's dtype (default: %(default)s)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="accepted for vLLM's command lines; a step mixes any number of adapters (default: none)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; Pagoda runs no code from model folders (default: %(default)s)",
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
        "--tool-strict-level",
        default="auto",
        choices=TOOL_STRICT_LEVELS,
        help='what a grammar holds under tool_choice "auto" (vLLM\'s flag): auto, the calls of strict tools (and '
        "of allowed_tools, or one call where parallel_tool_calls is false); function, every call's tool name; "
        "parameter, also every call's arguments, as if every tool were strict (default: %(default)s)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='tool_choice "none" leaves the tools out of the prompt, where by default they are shown '
        "(default: %(default)s)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move the model's <think> section into message.reasoning (default: none)",
    )
    EngineArgs.add_cli_args(p, positional_model=True)
    scale = p.add_argument_group("data parallelism", "replicas of the engine behind a gateway (docs/scaling.md)")
    add_option_flags(scale, ScaleArgs)
    return p


def read_chat_template(value: str | None, given_as: str = "--chat-template") -> str | None:
    """A file's contents when `value` names a file, else `value` itself (an inline template);
    either way one that compiles (a syntax error is the flag's, refused at startup, not a 400 on
    every chat request). `given_as`: how errors name where it came from."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # as apply_chat_template does

    from pagoda.config import ConfigError

    if value is None:
        return None
    path = Path(value)
    try:  # os.path.isfile: False, not an error, for an inline template longer than a file name may be
        template = path.read_text(encoding="utf-8") if os.path.isfile(value) else None
    except OSError as exc:
        raise ConfigError(f"Cannot read the chat template {path}: {exc}") from None
    if template is None and "{" not in value:
        raise ConfigError(f"{given_as} {value!r} is neither a file nor a Jinja template.")
    template = value if template is None else template
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        which = "The inline chat template" if template is value else f"The chat template {path}"
        raise ConfigError(f"{which} does not compile{where}: {exc}") from None
    return template


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with vLLM's spellings folded into Pagoda's and what Pagoda cannot do
    refused with the reason."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_flag is not None and args.model is not None and args.model_flag != args.model:
        parser.error(f"the MODEL argument {args.model!r} and --model {args.model_flag!r} differ; give one")
    args.model = args.model or args.model_flag
    if args.tensor_parallel_size != 1:
        parser.error(
            f"--tensor-parallel-size {args.tensor_parallel_size}: Pagoda has no tensor parallelism yet; "
            "a model runs on one device (leave it at 1)"
        )
    if args.api_server_count != 1:
        parser.error(
            f"--api-server-count {args.api_server_count}: one API server process serves each replica; "
            "scale out with --data-parallel-size N (N replicas behind a gateway)"
        )
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout:g}")
    if args.max_log_len is not None and args.max_log_len < 0:
        parser.error(f"--max-log-len must be at least 0, got {args.max_log_len}")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if (args.fingerprint_mode == "custom") != (args.fingerprint_value is not None):
        parser.error("--fingerprint-value goes with --fingerprint-mode custom, and custom needs it")
    for flag, values in (("--api-key", args.api_key), ("--served-model-name", args.served_model_name)):
        model_given = args.model is not None and "model" not in getattr(args, "filled_from_config", ())
        if not model_given and values and len(values) > 1 and _names_a_model(values[-1]):
            parser.error(f"{values[-1]!r} looks like the MODEL: give it before {flag}, which takes several values")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    lora_names = [module.lora_name for module in args.lora_modules]
    if len(set(lora_names)) < len(lora_names):
        parser.error(f"--lora-modules names an adapter twice: {', '.join(lora_names)}")
    if args.lora_modules:
        from pagoda.model_files import display_name

        base_names = args.served_model_name or [args.model, display_name(args.model)]
        taken = sorted(set(lora_names) & set(base_names))
        if taken:
            parser.error(f"--lora-modules: {taken[0]!r} is the served model's name; give the adapter another")
        if args.data_parallel_size > 1:
            parser.error(
                "--lora-modules with --data-parallel-size: the gateway routes only the base model's name "
                "(it answers 404 for an adapter's); serve adapters from one replica"
            )
    if args.api_key and not all(key.strip() for key in args.api_key):
        parser.error("--api-key: a key must not be empty (an empty one would let anyone in)")
    if args.data_parallel_size > 1 and args.api_key and len(args.api_key) > 1:
        parser.error("--data-parallel-size takes one --api-key (its gateway checks a single key)")
    if args.enable_log_outputs and args.disable_log_requests:
        parser.error("--enable-log-outputs writes outputs into the per-request lines --disable-log-requests turns off")
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        parser.error(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], the most Pagoda returns; got {args.max_logprobs}")
    return args


def _generation_overrides(text: str) -> dict[str, Any]:
    """argparse's type for --override-generation-config: a JSON object of generation_config.json
    keys, as sampling defaults (vLLM's; keys that are not sampling keys are ignored, as vLLM ignores
    them), each checked as SamplingParams checks it."""
    from pagoda.generation_config import sampling_defaults
    from pagoda.sampling_params import SamplingParams, SamplingParamsError

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object such as '{{\"temperature\": 0.5}}', got {text!r}")
    defaults = sampling_defaults(value)
    try:
        SamplingParams(**defaults)
    except SamplingParamsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return defaults


_generation_overrides.__name__ = "--override-generation-config"  # argparse names the type in its message


def _json_strings(flag: str) -> Callable[[str], list[str]]:
    """argparse's type for vLLM's JSON-list flags (--allowed-origins '["https://a.example"]')."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise argparse.ArgumentTypeError(f"a JSON list of strings such as '[\"*\"]', got {text!r}")
        return value

    parse.__name__ = flag  # argparse names the type in its message
    return parse


def read_generation_config(value: str, given_as: str = "--generation-config") -> dict[str, Any] | None:
    """Sampling defaults per --generation-config: None for auto (the model's own, read by the
    loader), {} for vllm (none: OpenAI's apply), else those of the folder's generation_config.json.
    `given_as`: how errors name where it came from."""
    from pagoda.config import ConfigError

    if value == "auto":
        return None
    if value == "vllm":
        return {}
    path = Path(value) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{given_as} {value}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{given_as} {value}: {path} is not a JSON object")
    return sampling_defaults(config)


def _template_kwargs(value: str) -> dict:
    """argparse's type for --default-chat-template-kwargs: a JSON object."""
    try:
        kwargs = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError("a JSON object of template variables, e.g. '{\"enable_thinking\": false}'")
    return kwargs


def _gib_of_bytes(value: str) -> float:
    """argparse's type for --kv-cache-memory-bytes: a count of bytes in vLLM's units (k, m, g
    decimal; K, M, G binary: 4G is 4 GiB), as GiB."""
    from pagoda.engine.args import token_count

    try:
        count = token_count(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a count of bytes: {value!r} (e.g. 4294967296, 4G, 4g)") from None
    if count <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value!r}")
    return count / 2**30


def _lora_dtype(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"{value!r}: adapters run in the model's dtype (give --dtype); only auto")
    return value


def _lora_module(value: str) -> LoRARequest:
    """One --lora-modules value as a LoRARequest (its id is set by its place among them)."""
    from pagoda.lora import LoRARequest

    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            return LoRARequest(spec["name"], 1, spec["path"], spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(
                f'{value!r}: a JSON module is {{"name": ..., "path": ...}} ({exc})'
            ) from None
    name, sep, path = value.partition("=")
    if not sep and (Path(value) / "adapter_config.json").is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME=PATH, e.g. {Path(value).name}={value}")
    if not sep and _names_a_model(value):
        raise argparse.ArgumentTypeError(f"{value!r} looks like the MODEL: give it before --lora-modules")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME=PATH")
    return LoRARequest(name, 1, path)


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # before any heavy import: --help stays instant
    from pagoda.engine.args import EngineArgs
    from pagoda.entrypoints.openai.startup import bind_socket
    from pagoda.errors import ConfigError
    from pagoda.lora import read_adapter_config

    try:
        configure_logging(args)
    except ConfigError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 1
    if args.trust_remote_code:
        logger.warning("--trust-remote-code has no effect: Pagoda runs no code from model folders")
    if args.data_parallel_size > 1:
        return _serve_replicas(args, argv)
    started = time.monotonic()
    try:
        args.reports = read_reports_dir(args.reports)  # a flag's folder, checked before the port and the load
        if args.otlp_traces_endpoint:  # likewise the tracing install
            from pagoda.entrypoints.openai.tracing import check_setup

            check_setup()
        EngineArgs.from_cli_args(args).thread_config()  # likewise the thread flags and variables
        for module in args.lora_modules:  # and each adapter's files, as far as they can be without the model
            read_adapter_config(module)
        sock = bind_socket(args.host, args.port)  # first: a busy port fails before the long load
    except ConfigError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 1
    with sock:
        return asyncio.run(_serve(sock, args, started))


def _serve_replicas(args: argparse.Namespace, argv: list[str]) -> int:
    """--data-parallel-size N: N replicas behind a gateway on the port (data_parallel.py)."""
    from pagoda.entrypoints.openai import data_parallel
    from pagoda.entrypoints.openai.startup import bind_socket
    from pagoda.errors import ConfigError

    try:
        bind_socket(args.host, args.port).close()  # a busy port fails before the replicas load
        return data_parallel.serve(args, argv)
    except ConfigError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 1


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's own settings out of the command line (the engine's are EngineArgs)."""
    from pagoda.entrypoints.openai.serving import CrossOrigin, ServerConfig
    from pagoda.entrypoints.openai.tool_calls import ToolSettings

    return ServerConfig(
        api_keys=api_keys(args),
        chat_template=read_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        request_log=args.request_log,
        log_prompts=args.log_prompts,
        log_outputs=args.enable_log_outputs,
        default_template_kwargs=checked_template_defaults(args.default_chat_template_kwargs),
        max_log_len=args.max_log_len,
        api_docs=not args.disable_fastapi_docs,
        log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats,
        max_logprobs=args.max_logprobs,
        generation_defaults=read_generation_config(args.generation_config),
        generation_overrides=args.override_generation_config,
        tools=ToolSettings(
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            args.reasoning_parser,
            exclude_tools_when_none=args.exclude_tools_when_tool_choice_none,
            tool_strict_level=args.tool_strict_level,
        ),
        reports=read_reports_dir(args.reports),
        cors=CrossOrigin(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        served_names=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        model_argument=None if args.served_model_name else args.model,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        request_id_headers=args.enable_request_id_headers,
        response_role=args.response_role,
        fingerprint_mode=args.fingerprint_mode,
        fingerprint_value=args.fingerprint_value,
        lora_modules=tuple(replace(module, lora_int_id=i) for i, module in enumerate(args.lora_modules, start=1)),
        runtime_lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        metrics_prefix=args.metrics_prefix,
        store_responses=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "").strip() not in ("", "0"),
        root_path=args.root_path or "",
        force_include_usage=args.enable_force_include_usage,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        max_loras=args.max_loras,
    )


def checked_template_defaults(kwargs: dict) -> dict:
    """--default-chat-template-kwargs, refused (ConfigError) where it names an argument of the
    renderer (tokenize, chat_template, ..) rather than a template variable, as a request's are."""
    from transformers import PreTrainedTokenizerBase

    from pagoda.entrypoints.openai.chat import renderer_arguments
    from pagoda.errors import ConfigError

    named = sorted(renderer_arguments(PreTrainedTokenizerBase.apply_chat_template) & set(kwargs))
    if named:
        names = ", ".join(named)
        raise ConfigError(f"--default-chat-template-kwargs: {names}: arguments of the renderer, not template variables")
    return kwargs


def _names_a_model(value: str) -> bool:
    """Whether a flag's last value is a model (a folder or .gguf file): MODEL swallowed by a
    flag that takes several values."""
    return value.endswith(".gguf") or Path(value).is_dir()


def configure_logging(args: argparse.Namespace) -> None:
    """The default (one stream handler, LOG_FORMAT, --log-level), or --log-config-file's (else
    VLLM_LOGGING_CONFIG_PATH's) dictConfig in its place, as vLLM applies one; ConfigError where that
    file cannot be read or applied."""
    path = log_config_file(args)
    if path is None:
        logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    else:
        from logging.config import dictConfig

        from pagoda.errors import ConfigError

        try:
            config = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            # Pagoda's loggers exist by now (its modules made them as they loaded): a file that names
            # none of them, as one written for vLLM, must not silence them (dictConfig's default would)
            dictConfig({"disable_existing_loggers": False, **config})
        except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
            raise ConfigError(f"--log-config-file {path}: {exc}") from None
    if args.disable_log_requests:  # no line per request at all: arrivals, refusals, finishes
        logging.getLogger("pagoda.requests").setLevel(logging.WARNING)
    quiet = {path.strip() for path in args.disable_access_log_for_endpoints.split(",") if path.strip()}
    if quiet:
        logging.getLogger("uvicorn.access").addFilter(AccessLogExcept(frozenset(quiet)))


class AccessLogExcept(logging.Filter):
    """Drops the access log's lines for requests to `paths` (their query string aside), as vLLM's
    --disable-access-log-for-endpoints does; uvicorn's record args: client, method, path, version, status."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and str(args[2]).split("?")[0] in self.paths)


def log_config_file(args: argparse.Namespace) -> str | None:
    return args.log_config_file or os.environ.get("VLLM_LOGGING_CONFIG_PATH") or None


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys a request may bear: --api-key's, else PAGODA_API_KEY, else vLLM's VLLM_API_KEY (a
    deployment moved from vLLM keeps its key where it set it)."""
    if args.api_key:
        return tuple(args.api_key)
    key = os.environ.get("PAGODA_API_KEY") or os.environ.get("VLLM_API_KEY")
    return (key,) if key and key.strip() else ()


def read_reports_dir(path: Path | None) -> Path | None:
    """--reports DIR, resolved; a ConfigError unless it is a folder."""
    from pagoda.errors import ConfigError

    if path is None:
        return None
    if not path.is_dir():
        raise ConfigError(f"--reports {path}: not a folder")
    return path.resolve()


def load_app(args: argparse.Namespace) -> tuple[FastAPI, AsyncEngine]:
    """The engine (its model loaded on its engine thread) and its FastAPI app; run on the loader
    thread, since the server's modules import torch (seconds)."""
    logger.info("loading %s", args.model or "the default model")
    loaded = time.monotonic()
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.openai.api import build_app

    config = server_config(args)  # its files are read before the slow model load
    if config.request_log is not None:
        logger.warning("request log %s records every request's prompt and output", config.request_log)
    engine = AsyncEngine(EngineArgs.from_cli_args(args))
    m, pooler = engine.config.model, engine.config.pooler
    unit = "" if pooler is None or not pooler.use_activation else ", unit length"
    runner = "" if pooler is None else f", embeddings: {pooler.pooling_type} pooling{unit}"
    logger.info(
        "loaded %s (%s, %s, max_model_len %d, deterministic %s%s) in %.1f s",
        m.name,
        m.architecture,
        str(m.dtype).removeprefix("torch."),
        m.max_model_len,
        "on" if engine.config.deterministic else "off",
        runner,
        time.monotonic() - loaded,
    )
    _warn_unused_tool_parser(config, engine.tokenizer.chat_template)
    app = build_app(engine, config)
    # What startup built (the model's modules, the tokenizer, the app: ~340,000 objects) lives as
    # long as the process. Frozen, the cyclic GC no longer walks it: a full collection while
    # serving took ~175 ms with the GIL held (every stream stalled); it now walks only what
    # serving allocates. As vLLM does; only here, since an offline LLM may be dropped and rebuilt.
    gc.collect()
    gc.freeze()
    return app, engine


def _warn_unused_tool_parser(config: ServerConfig, model_template: str | None) -> None:
    """A named --tool-call-parser reads calls in the format the chat template shows tools in; a
    template that shows none has them put in the system prompt in the generic format, whose parser
    reads the calls instead (tool_calls.plan_tools), so the named one goes unused: say so."""
    from pagoda.model_files import template_supports_tools

    template = config.chat_template or model_template
    parser = config.tools.tool_call_parser
    if parser is not None and not template_supports_tools(template):
        logger.warning(
            "--tool-call-parser %s is not used: the chat template shows no tools, so requests' tools go in "
            "the system prompt in Pagoda's generic JSON format and the generic parser reads the calls",
            parser,
        )


async def _serve(sock: socket.socket, args: argparse.Namespace, started: float) -> int:
    """Serve 503s on `sock` while the engine loads, then the API; the exit code."""
    import uvicorn

    from pagoda.entrypoints.openai.startup import LoadProgress, StartingApp, in_daemon_thread

    starting = StartingApp(args.root_path or "")
    server = uvicorn.Server(
        uvicorn.Config(
            starting,
            log_config=None,
            access_log=args.access_log,
            # a --log-config-file sets uvicorn's levels too, unless --uvicorn-log-level is given
            log_level=args.uvicorn_log_level or (None if log_config_file(args) else args.log_level),
            # the server's own abort (_abort_after_grace) ends what still runs at --shutdown-timeout;
            # uvicorn cancels a handler only if it has not answered ABORT_ANSWER_S after that
            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_ANSWER_S,
            lifespan="on",
        )
    )
    with _absorb_reraised_signals():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        async with LoadProgress().reporting():
            loading = asyncio.ensure_future(in_daemon_thread(lambda: load_app(args)))
            await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():  # stopped (SIGTERM, Ctrl-C) while loading
            loading.cancel()
            return 0 if server.started else 1
        if (failure := _load_failure(loading)) is not None:
            print(f"pagoda serve: {failure}", file=sys.stderr)
            server.should_exit = True
            await serving
            return 1
        api, engine = loading.result()
        await starting.serve(api)
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        announce = asyncio.create_task(_announce_ready(server, engine.config.model.name, url, started))
        aborter = asyncio.create_task(_abort_after_grace(server, engine, args.shutdown_timeout))
        await serving
        announce.cancel()
        aborter.cancel()
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


async def _abort_after_grace(server, engine: AsyncEngine, grace_s: float) -> None:
    """Once the server stops (SIGTERM, Ctrl-C), give requests in flight `grace_s` seconds, then end
    the rest with an error, which their handlers answer as any engine error: a 503 body, or an
    error event and [DONE] on a stream."""
    while not server.should_exit:
        await asyncio.sleep(STOP_POLL_S)
    await asyncio.sleep(grace_s)
    aborted = engine.fail_in_flight(f"the server is shutting down: aborted after --shutdown-timeout {grace_s:g} s")
    if aborted:
        logger.warning("aborted %d request(s) still running %g s after the stop", aborted, grace_s)


async def _announce_ready(server, model_name: str, url: str, started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("ready: serving %s at %s (started in %.1f s)", model_name, url, time.monotonic() - started)
    if url.startswith(("http://127.", "http://localhost:")):  # vLLM listens on every interface by default
        logger.info("listening on this machine only: give --host 0.0.0.0 to serve others (or a container's host)")


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
