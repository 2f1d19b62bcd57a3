"""`pagoda bench` options, parsed and validated once into a frozen BenchSettings.

`pagoda bakeoff` turns its config into the same options, so both commands share one
parser and one set of checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pagoda.bench.client import root_url
from pagoda.bench.datasets import DEFAULT_OUTPUT_LEN, ENDPOINT_PATHS, KINDS, LengthDist, WorkloadSpec
from pagoda.bench.errors import BenchError
from pagoda.bench.launcher import LaunchSpec, parse_command
from pagoda.bench.metrics import SLO
from pagoda.bench.tool_calls import TOOL_CHOICES
from pagoda.entrypoints.parsing import Parser, with_suggestions

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# vLLM's `bench serve` names, in Pagoda's terms.
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ENDPOINTS = {"chat": "chat", "completions": "completions", **ENDPOINT_PATHS}  # vLLM's --endpoint paths too
DATASET_NAMES = {"random": "random", "sharegpt": "sharegpt", "prefix_repetition": "shared-prefix", "custom": "custom"}
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}
UNBOUNDED_IN_FLIGHT = 10_000  # "no bound" on the requests in flight, for a run of no fixed size
# the request fields vLLM's sampling flags set (--top-p 0.9: "top_p": 0.9)
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
_RAMP_UP = "no ramp-up: sweep fixed rates or concurrency levels, one level each (--request-rate, --concurrency 1,8,32)"
# `vllm bench serve` flags `pagoda bench` does not take, with why
VLLM_FLAGS_NOT_TAKEN = {
    "--ramp-up-strategy": _RAMP_UP,
    "--ramp-up-start-rps": _RAMP_UP,
    "--ramp-up-end-rps": _RAMP_UP,
    "--lora-modules": "adapters are model names: give one with --model",
    "--profile": "no server profiling from the client",
    "--plot-timeline": "report.md and report.html (--output DIR) have the plots",
}
T = TypeVar("T")


class UsageError(BenchError):
    """A bad command line; the parser's usage line goes with the message."""


class _OneSpelling(argparse._StoreAction):
    """Stores an option's value, as argparse does, but an option with two spellings (Pagoda's and
    vLLM's: --input-len and --random-input-len) given both ways with different values is an error,
    where argparse would keep the last one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        given = namespace.__dict__.setdefault("_spellings", {})
        earlier = given.get(self.dest)
        if earlier is not None and earlier[0] != option_string and earlier[1] != values:
            parser.error(f"{earlier[0]} {earlier[1]} and {option_string} {values} disagree; give one")
        given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


class _Parser(Parser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, foreign=VLLM_FLAGS_NOT_TAKEN, **kwargs)
        self.register("action", None, _OneSpelling)
        self.register("action", "store", _OneSpelling)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(with_suggestions(message, self))


@dataclass(frozen=True)
class BenchSettings:
    base_url: str  # server root, without /v1
    model: str | None  # None: the first model /v1/models lists
    api_key: str | None
    request_timeout_s: float
    temperature: float
    ignore_eos: bool
    extra_body: dict[str, Any]  # read-only by convention
    workload: WorkloadSpec
    tokenizer: str | None
    concurrency: tuple[int, ...]
    request_rate: float
    burstiness: float
    num_prompts: int | None  # requests per level; None: until --duration, or the whole replay file
    duration_s: float | None
    warmup: int
    seed: int
    slo: SLO | None
    server_pid: int | None
    metrics_url: str | None
    launch: LaunchSpec | None
    output: Path | None
    progress: bool
    reset_prefix_cache: bool = False  # POST /reset_prefix_cache before each level
    in_flight_bound: bool = True  # False: the levels bound nothing (a request rate without --concurrency)
    ready_timeout_s: float = 0.0  # wait this long for the server to answer before the run (0: fail at once)
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request, beside the API key's
    vllm_results: VllmResults | None = None  # vLLM's result JSON (--save-result), none without it


@dataclass(frozen=True)
class VllmResults:
    """What `vllm bench serve --save-result` writes, as it writes it (vllm_results.py)."""

    folder: Path
    filename: str | None  # None: vLLM's own name (backend, rate, concurrency, model, time)
    backend: str  # vLLM's name for the endpoint: openai or openai-chat
    label: str | None
    metadata: tuple[tuple[str, str], ...]
    percentile_metrics: tuple[str, ...]
    percentiles: tuple[float, ...]
    detailed: bool  # per-request lists too (--save-detailed)
    append: bool  # add a line to the file instead of writing it (--append-result)


def build_parser(prog: str = "pagoda bench") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Benchmark any OpenAI-compatible server, always streaming.")
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url", help=f"server root (a trailing /v1 is fine) (default: {DEFAULT_BASE_URL}, or --host and --port)"
    )
    target.add_argument("--host", help="vLLM's: the server's host, without --base-url (default: 127.0.0.1)")
    target.add_argument("--port", type=int, help="vLLM's: the server's port, without --base-url (default: 8000)")
    target.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    target.add_argument(
        "--served-model-name",
        help="vLLM's: the model name to send, where --model names the tokenizer's model (default: --model)",
    )
    target.add_argument(
        "--endpoint",
        type=_endpoint,
        metavar="{chat,completions}",
        help="chat or completions, or vLLM's /v1/chat/completions or /v1/completions (default: chat for "
        "structured and tools, else completions)",
    )
    target.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        help="vLLM's spelling of --endpoint: openai and vllm are completions, openai-chat is chat (default: none)",
    )
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    target.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per request (default 600)")
    target.add_argument(
        "--temperature", type=float, default=0.0, help="unless a replayed request sets one (default: %(default)s)"
    )
    target.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos so outputs reach max_tokens (default: on for random, as vLLM does)",
    )
    target.add_argument("--extra-body", default="{}", metavar="JSON", help="fields added to every request body")
    for field_name in SAMPLING_FLAGS:
        target.add_argument(
            f"--{field_name.replace('_', '-')}",
            type=float,
            help=f"vLLM's: sent as {field_name} in every request (default: none, the server's)",
        )
    target.add_argument(
        "--header", nargs="+", default=[], metavar="KEY=VALUE", help="HTTP headers sent with every request"
    )
    target.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        metavar="S",
        help="vLLM's: wait up to S seconds for the server to answer before the run (default: 0, fail at once)",
    )
    target.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines: no effect")
    target.add_argument("--tokenizer-mode", help="accepted for vLLM's command lines: no effect (default: none)")

    work = parser.add_argument_group("workload (seeded: equal seeds send equal prompts)")
    work.add_argument("--workload", choices=KINDS, help="default: random, or replay/sharegpt from --dataset's suffix")
    work.add_argument(
        "--dataset-name",
        choices=sorted(DATASET_NAMES),
        help="vLLM's spelling of --workload: prefix_repetition is shared-prefix, custom is replay (default: none)",
    )
    work.add_argument(
        "--dataset",
        "--dataset-path",
        type=Path,
        help="replay: JSONL (request bodies or a Pagoda request log); sharegpt: JSON (default: none)",
    )
    work.add_argument(
        "--input-len",
        "--random-input-len",
        default="256",
        metavar="LEN",
        help="N, LOW:HIGH or normal:MEAN,STD (default 256)",
    )
    work.add_argument(
        "--random-range-ratio",
        metavar="R",
        help="vLLM's: an N length becomes the uniform range N*(1-R) to N*(1+R); a float, or JSON "
        '{"input": R, "output": R} (default: none)',
    )
    work.add_argument(
        "--output-len",
        "--random-output-len",
        metavar="LEN",
        help="as --input-len (default 64; structured: 128; tools: 200; ShareGPT: the reply's length)",
    )
    work.add_argument(
        "--tool-choice",
        choices=TOOL_CHOICES,
        help="tools: required (default), auto, or named (force the tool the prompt is about)",
    )
    work.add_argument("--tokenizer", help="HF directory, .gguf file, or 'default' (default: the served model's)")
    work.add_argument("--seed", type=int, default=0, help="the prompts' seed (default: %(default)s)")
    work.add_argument("--groups", type=int, default=4, help="shared-prefix: groups (default 4)")
    work.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix (default 8)")
    work.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix: tokens (default 512)")
    work.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens (default 64)")
    work.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session (default 4)")
    work.add_argument(
        "--think-time", type=float, default=1.0, metavar="S", help="multi-turn: between turns (default 1)"
    )
    work.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="vLLM's: random: every prompt opens with the same N random tokens (default: 0)",
    )
    work.add_argument(
        "--custom-output-len",
        type=int,
        default=256,
        metavar="N",
        help="vLLM's: custom: every request's max_tokens; -1: each line's output_tokens (default: 256)",
    )
    work.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="vLLM's: custom, to the completions endpoint: the prompt as it is, not in the chat template",
    )
    work.add_argument(
        "--disable-shuffle", action="store_true", help="vLLM's: sharegpt and custom: the file's order, not shuffled"
    )
    work.add_argument(
        "--no-oversample",
        action="store_true",
        help="accepted for vLLM's command lines: a file's prompts are never sent twice to make up --num-prompts",
    )
    # vLLM's names for the shared-prefix settings and a ShareGPT run's output length
    for flag, dest in (
        ("--sharegpt-output-len", "output_len"),
        ("--prefix-repetition-prefix-len", "system_prompt_len"),
        ("--prefix-repetition-suffix-len", "question_len"),
        ("--prefix-repetition-num-prefixes", "groups"),
        ("--prefix-repetition-output-len", "output_len"),
    ):
        work.add_argument(
            flag, dest=dest, type=str if dest == "output_len" else int, help=f"vLLM's: --{dest.replace('_', '-')}"
        )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        "--max-concurrency",
        metavar="N[,N...]",
        help="levels of the sweep: requests in flight at most (default: 1; with --request-rate, no bound)",
    )
    load.add_argument(
        "--request-rate", type=float, default=math.inf, metavar="R", help="sessions/s, Poisson (default inf)"
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (default 1: Poisson)")
    load.add_argument(
        "--num-prompts", type=int, help="requests per level (default 100; shared-prefix: groups x prompts)"
    )
    load.add_argument("--duration", type=float, metavar="S", help="start no request due after S seconds of a level")
    load.add_argument(
        "--warmup",
        "--num-warmups",
        type=int,
        default=2,
        metavar="N",
        help="requests sent first and not counted (default 2)",
    )
    load.add_argument("--slo", help="goodput targets, e.g. ttft=500ms,tpot=50ms,e2e=5s (default: none)")
    load.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="vLLM's spelling of --slo: ttft:500 tpot:50 e2el:5000, in ms (default: none)",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--launch", metavar="COMMAND", help="start the server, time its cold start, stop it at the end")
    server.add_argument(
        "--launch-env", action="append", default=[], metavar="KEY=VALUE", help="for --launch; repeatable"
    )
    server.add_argument(
        "--launch-timeout", type=float, default=600.0, metavar="S", help="until it answers (default 600)"
    )
    server.add_argument("--server-log", type=Path, help="--launch output (default: OUTPUT/server.log or a temp file)")
    server.add_argument("--server-pid", type=int, help="sample this process tree's peak memory")
    server.add_argument("--metrics-url", help="Prometheus metrics (default: BASE_URL/metrics)")
    server.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /reset_prefix_cache before each level; a server without it gets a warning (default: off)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--output",
        "--result-dir",
        type=Path,
        metavar="DIR",
        help="write results.json, results.csv, report.md, plots (default: none)",
    )
    out.add_argument(
        "--save-result",
        action="store_true",
        help="vLLM's: write vLLM's result JSON, one a level, in --output (default: the current folder)",
    )
    out.add_argument(
        "--result-filename",
        metavar="NAME",
        help="vLLM's: the result JSON's file name (-cN before its suffix for each level of several) "
        "(default: vLLM's, BACKEND-RATEqps[-concurrencyN]-MODEL-TIME.json)",
    )
    out.add_argument(
        "--save-detailed", action="store_true", help="vLLM's: the result JSON has each request's lengths and times"
    )
    out.add_argument("--append-result", action="store_true", help="vLLM's: add the result JSON as a line to its file")
    out.add_argument("--label", help="vLLM's: the result JSON's label and file-name prefix (default: the backend)")
    out.add_argument("--metadata", nargs="+", default=[], metavar="KEY=VALUE", help="vLLM's: fields of the result JSON")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        metavar="NAMES",
        help="vLLM's: the result JSON's metrics with percentiles, of ttft, tpot, itl, e2el (default: %(default)s)",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        metavar="P[,P...]",
        help="vLLM's: their percentiles in the result JSON (default: %(default)s)",
    )
    out.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar (default: off)")
    return parser


def parse_settings(argv: Sequence[str]) -> BenchSettings:
    args = build_parser().parse_args(list(argv))
    given_url = args.base_url or f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    base_url = root_url(given_url)
    if not base_url.startswith(("http://", "https://")):
        raise UsageError(f"--base-url must start with http:// or https://, got {given_url!r}")
    if args.launch and args.server_pid:
        raise UsageError("--launch and --server-pid exclude each other: a launched server's pid is known")
    workload = _workload(args)
    num_prompts = _num_prompts(args, workload)
    request_rate = _positive(args.request_rate, "--request-rate")
    return BenchSettings(
        base_url=base_url,
        model=args.served_model_name or args.model,
        api_key=args.api_key,
        request_timeout_s=_positive(args.request_timeout, "--request-timeout"),
        temperature=args.temperature,
        ignore_eos=args.ignore_eos if args.ignore_eos is not None else workload.kind == "random",
        extra_body=_json_object(args.extra_body) | _sampling_fields(args),
        workload=workload,
        # vLLM's --model names the tokenizer's model where --served-model-name names the one to send
        tokenizer=args.tokenizer or (args.model if args.served_model_name else None),
        concurrency=_concurrency(args.concurrency, request_rate, num_prompts),
        request_rate=request_rate,
        burstiness=_positive(args.burstiness, "--burstiness"),
        num_prompts=num_prompts,
        duration_s=None if args.duration is None else _positive(args.duration, "--duration"),
        warmup=_at_least(args.warmup, 0, "--warmup"),
        seed=args.seed,
        slo=_slo(args),
        server_pid=args.server_pid,
        metrics_url=args.metrics_url or f"{base_url}/metrics",
        launch=_launch(args),
        output=args.output,
        progress=not args.no_progress,
        reset_prefix_cache=args.reset_prefix_cache,
        in_flight_bound=args.concurrency is not None or not math.isfinite(request_rate),
        ready_timeout_s=max(0.0, args.ready_check_timeout_sec),
        headers=tuple(_pairs(args.header, "--header")),
        vllm_results=_vllm_results(args, workload),
    )


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    kind = _same("--workload", args.workload, "--dataset-name", DATASET_NAMES.get(args.dataset_name or ""))
    endpoint = _same("--endpoint", args.endpoint, "--backend", BACKENDS.get(args.backend or ""))
    if kind is None:
        kind = (
            {".jsonl": "replay", ".json": "sharegpt"}.get(args.dataset.suffix, "replay") if args.dataset else "random"
        )
    if args.dataset is not None and kind not in ("replay", "sharegpt", "custom"):
        raise UsageError(f"--dataset is for the replay, sharegpt and custom workloads, not {kind}")
    ratios = _range_ratios(args.random_range_ratio)
    output_len = args.output_len
    if output_len is None and kind == "random" and ratios["output"]:  # vLLM widens its default length too
        output_len = str(DEFAULT_OUTPUT_LEN)
    if args.random_prefix_len and kind != "random":
        raise UsageError(f"--random-prefix-len is for the random workload, not {kind}")
    if args.tool_choice is not None and kind != "tools":
        raise UsageError(f"--tool-choice is for the tools workload, not {kind}")
    if kind == "tools" and endpoint == "completions":
        raise UsageError("the tools workload needs the chat endpoint: tools are a chat feature")
    return WorkloadSpec(
        kind=kind,
        endpoint=endpoint or ("chat" if kind in ("structured", "tools") else "completions"),
        input_len=_option(LengthDist.parse, _ranged(args.input_len, ratios["input"]), "--input-len"),
        output_len=_option(LengthDist.parse, _ranged(output_len, ratios["output"]), "--output-len")
        if output_len
        else None,
        groups=_at_least(args.groups, 1, "--groups"),
        prompts_per_group=_at_least(args.prompts_per_group, 1, "--prompts-per-group"),
        system_prompt_len=_at_least(args.system_prompt_len, 1, "--system-prompt-len"),
        question_len=_at_least(args.question_len, 1, "--question-len"),
        turns=_at_least(args.turns, 1, "--turns"),
        think_time_s=max(0.0, args.think_time),
        dataset=args.dataset,
        tool_choice=args.tool_choice or "required",
        prefix_len=_at_least(args.random_prefix_len, 0, "--random-prefix-len"),
        custom_output_len=_custom_output_len(args.custom_output_len),
        skip_chat_template=args.skip_chat_template,
        shuffle=not args.disable_shuffle,
    )


def _custom_output_len(value: int) -> int:
    if value != -1 and value < 1:
        raise UsageError(f"--custom-output-len must be >= 1, or -1 for each line's output_tokens; got {value}")
    return value


def _same(name: str, value: str | None, alias: str, alias_value: str | None) -> str | None:
    """The one value a flag and its vLLM spelling give; both with different values is an error."""
    if value is not None and alias_value is not None and value != alias_value:
        raise UsageError(f"{name} {value} and {alias} (meaning {alias_value}) disagree; give one")
    return value or alias_value


def _range_ratios(text: str | None) -> dict[str, float]:
    """--random-range-ratio as vLLM reads it: one float for both lengths, or a JSON object."""
    if text is None:
        return {"input": 0.0, "output": 0.0}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"--random-range-ratio wants a number or a JSON object, got {text!r}") from None
    ratios = value if isinstance(value, dict) else {"input": value, "output": value}
    if set(ratios) - {"input", "output"} or not all(
        isinstance(r, (int, float)) and 0 <= r < 1 for r in ratios.values()
    ):
        raise UsageError(f'--random-range-ratio wants R in [0, 1) or {{"input": R, "output": R}}, got {text!r}')
    return {"input": 0.0, "output": 0.0} | ratios


def _ranged(length: str | None, ratio: float) -> str | None:
    """An N length widened by vLLM's range ratio to the uniform LOW:HIGH it samples from."""
    if length is None or not ratio:
        return length
    if not length.isdigit():
        raise UsageError(f"--random-range-ratio widens a single length N, not {length!r}")
    n = int(length)
    return f"{max(1, math.floor(n * (1 - ratio)))}:{math.ceil(n * (1 + ratio))}"


def _slo(args: argparse.Namespace) -> SLO | None:
    """--slo, or vLLM's --goodput KEY:MS pairs in its spelling."""
    if args.slo and args.goodput:
        raise UsageError("--slo and --goodput are the same setting; give one")
    text = args.slo
    if args.goodput:
        pairs = [item.partition(":") for item in args.goodput]
        if any(not sep or key not in GOODPUT_KEYS for key, sep, _ in pairs):
            raise UsageError(f"--goodput wants ttft:MS, tpot:MS or e2el:MS pairs, got {' '.join(args.goodput)}")
        text = ",".join(f"{GOODPUT_KEYS[key]}={ms}ms" for key, _, ms in pairs)
    return _option(SLO.parse, text, "--goodput" if args.goodput else "--slo") if text else None


def _endpoint(text: str) -> str:
    """--endpoint: Pagoda's name, or vLLM's path for it."""
    if text not in ENDPOINTS:
        raise argparse.ArgumentTypeError(f"{text!r}: chat or completions (or /v1/chat/completions, /v1/completions)")
    return ENDPOINTS[text]


def _sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if "top_k" in fields:
        fields["top_k"] = int(fields["top_k"])
    return fields


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    """KEY=VALUE items, in order."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} wants KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _concurrency(text: str | None, request_rate: float, num_prompts: int | None) -> tuple[int, ...]:
    """The levels given; else one: 1, or with a request rate no bound (vLLM's default), as many as
    the level sends (UNBOUNDED_IN_FLIGHT for a --duration run)."""
    if text is not None:
        return _levels(text)
    return (num_prompts or UNBOUNDED_IN_FLIGHT,) if math.isfinite(request_rate) else (1,)


def _vllm_results(args: argparse.Namespace, workload: WorkloadSpec) -> VllmResults | None:
    if not (args.save_result or args.result_filename or args.append_result):
        return None
    metrics = tuple(name.strip() for name in args.percentile_metrics.split(",") if name.strip())
    if not metrics or set(metrics) - set(PERCENTILE_METRICS):
        raise UsageError(
            f"--percentile-metrics names some of {','.join(PERCENTILE_METRICS)}, got {args.percentile_metrics!r}"
        )
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise UsageError(
            f"--metric-percentiles wants numbers in (0, 100), like 50,90,99, got {args.metric_percentiles!r}"
        )
    return VllmResults(
        folder=args.output or Path("."),
        filename=args.result_filename,
        backend=args.backend or ("openai-chat" if workload.endpoint == "chat" else "openai"),
        label=args.label,
        metadata=tuple(_pairs(args.metadata, "--metadata")),
        percentile_metrics=metrics,
        percentiles=percentiles,
        detailed=args.save_detailed,
        append=args.append_result,
    )


def _num_prompts(args: argparse.Namespace, workload: WorkloadSpec) -> int | None:
    if args.num_prompts is not None:
        return _at_least(args.num_prompts, 1, "--num-prompts")
    return None if args.duration is not None else workload.default_num_prompts()


def _launch(args: argparse.Namespace) -> LaunchSpec | None:
    if not args.launch:
        return None
    env = {}
    for item in args.launch_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--launch-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    log = args.server_log or (args.output / "server.log" if args.output else None)
    if log is None:
        log = Path(tempfile.gettempdir()) / f"pagoda-bench-server-{os.getpid()}.log"
    return LaunchSpec(parse_command(args.launch), log, env, _positive(args.launch_timeout, "--launch-timeout"))


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--concurrency wants integers like 1,8,32, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--extra-body is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise UsageError("--extra-body must be a JSON object")
    return value


def _option(parse: Callable[[str], T], text: str, name: str) -> T:
    try:
        return parse(text)
    except BenchError as exc:
        raise UsageError(f"{name}: {exc}") from None


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise UsageError(f"{name} must be > 0, got {value:g}")
    return value


def _at_least(value: int, low: int, name: str) -> int:
    if value < low:
        raise UsageError(f"{name} must be >= {low}, got {value}")
    return value
