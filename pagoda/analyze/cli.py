"""`pagoda analyze LOG.jsonl`: how much of each prompt a prefix cache could serve, and what that
is worth. See docs/analyze.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.kv_memory import kv_footprint
from pagoda.analyze.pipeline import analyze_log
from pagoda.analyze.plot import PLOT_FORMATS, write_plot
from pagoda.analyze.recommend import recommend
from pagoda.analyze.report import render, to_json
from pagoda.analyze.routing import CACHE_THRESHOLD, POLICIES
from pagoda.analyze.summary import summarize
from pagoda.analyze.tokenize import ChatFlags, PromptTokenizer
from pagoda.entrypoints.parsing import Parser
from pagoda.model_files import CONTENT_FORMATS

SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
DEFAULT_TOKENIZER = "default"  # as `pagoda bench --tokenizer default`: Pagoda's default model


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pagoda analyze",
        description="Measure the prefix overlap of logged requests and predict what a prefix cache "
        "saves (an upper bound). Reads `pagoda serve --request-log` files, OpenAI request bodies "
        '(chat or completions) or {"prompt": ...} lines, one JSON object per line.',
    )
    parser.add_argument("log", help="the request log (JSON lines)")
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL_OR_PATH",
        help="model whose tokenizer and chat template turn text prompts into token ids, as the server "
        "does (an HF directory, a .gguf file, or 'default'; default: Pagoda's default model)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help="the server's --chat-template: a file path or the template itself (default: the model's)",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="the server's --chat-template-content-format (default: %(default)s)",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='the server\'s flag: requests with tool_choice "none" render without their tools',
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="the server's flag: a request's own chat_template renders it (else such a line is one the "
        "server would refuse)",
    )
    parser.add_argument("--block-size", type=_positive, default=16, help="the server's KV block size (default 16)")
    parser.add_argument(
        "--cache-tokens",
        metavar="N[,N...]",
        type=_token_counts,
        help="cache sizes to simulate with LRU eviction, e.g. 500k,2M (default: a curve of powers of two)",
    )
    parser.add_argument(
        "--replicas",
        type=_positive,
        default=1,
        help="forecast N replicas behind SGLang Model Gateway, each with its own cache of every "
        "--cache-tokens size (default 1: no forecast)",
    )
    parser.add_argument(
        "--routing",
        type=_policies,
        default=POLICIES,
        metavar="POLICY[,POLICY...]",
        help=f"routing policies to forecast with --replicas: {', '.join(POLICIES)} (default: both)",
    )
    parser.add_argument(
        "--cache-threshold",
        type=_share,
        default=CACHE_THRESHOLD,
        help="the gateway's --cache-threshold: the share of a request's text a worker must hold "
        "for cache-aware routing to prefer it (default %(default)s)",
    )
    parser.add_argument("--top", type=_positive, default=5, help="shared prefixes to list (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=Path,
        help="plot reuse against cache size and the hit ratios (PNG; SVG or PDF by the file's suffix)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except AnalyzeError as exc:
        print(f"pagoda analyze: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagoda analyze: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    model = None if args.tokenizer == DEFAULT_TOKENIZER else args.tokenizer
    flags = ChatFlags(
        _read_template(args.chat_template),
        args.chat_template_content_format,
        args.exclude_tools_when_tool_choice_none,
        args.trust_request_chat_template,
    )
    tokenizer = PromptTokenizer(model, flags)
    if args.plot is not None:  # before the read, not after it
        if not args.plot.parent.is_dir():
            raise AnalyzeError(f"Cannot write the plot to {args.plot}: there is no folder {args.plot.parent}")
        if args.plot.suffix.lower() not in PLOT_FORMATS:
            raise AnalyzeError(f"--plot writes {', '.join(PLOT_FORMATS)} files (by the suffix), not {args.plot.name}")
    if args.tokenizer is not None:  # named (`default` too): it must load, and it shows prefixes as text
        tokenizer.load()
    analysis = analyze_log(
        Path(args.log), tokenizer, args.block_size, args.top, args.replicas, args.routing, args.cache_threshold
    )
    summary = summarize(analysis, args.cache_tokens)
    recommendation = recommend(summary, kv_footprint(model))
    print(to_json(summary, recommendation) if args.json else render(summary, recommendation), end="")
    if args.plot is not None:
        write_plot(summary, args.plot)
        if not args.json:
            print(f"\nPlot written to {args.plot}")
    return 0


def _read_template(value: str | None) -> str | None:
    if value is None:
        return None
    from pagoda.entrypoints.openai.serve import read_chat_template  # read as the server reads it
    from pagoda.errors import ConfigError

    try:
        return read_chat_template(value)
    except ConfigError as exc:
        raise AnalyzeError(str(exc)) from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        choices = ", ".join(POLICIES)
        raise argparse.ArgumentTypeError(f"unknown routing policy {unknown or text!r}; choose from {choices}")
    return names


def _token_counts(text: str) -> tuple[int, ...]:
    """'500k,2M,100000' -> (500000, 2000000, 100000)."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = SUFFIXES.get(part[-1:], 1)
        number = part[:-1] if scale > 1 else part
        try:
            size = int(float(number) * scale)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"not a token count: {part!r} (e.g. 500k, 2M, 100000)") from None
        if size < 1:
            raise argparse.ArgumentTypeError(f"a cache holds at least 1 token, got {part!r}")
        sizes.append(size)
    return tuple(sizes)
