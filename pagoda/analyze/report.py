"""Showing an analysis: a terminal report, or JSON."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict

from pagoda.analyze.pipeline import MALFORMED_KEPT, MALFORMED_SHOWN
from pagoda.analyze.recommend import Recommendation
from pagoda.analyze.summary import CachePoint, Summary

PREVIEW_CHARS = 60
WIDTH = 100


def to_json(summary: Summary, recommendation: Recommendation) -> str:
    data = {"upper_bound": True, **asdict(summary), "recommendation": asdict(recommendation)}
    return json.dumps(data, indent=2)


def render(summary: Summary, recommendation: Recommendation) -> str:
    sections = [
        _header(summary),
        _totals(summary),
        _malformed(summary),
        _reuse_table(summary),
        _hit_ratio_table(summary),
        _shared_prefixes(summary),
        _server_check(summary),
        _routing(summary),
        _recommendation(recommendation),
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def _header(summary: Summary) -> str:
    return (
        f"Prefix overlap of {summary.log}\n"
        "An upper bound: an ideal cache replaying requests one at a time, in arrival order."
    )


def _totals(summary: Summary) -> str:
    if summary.output_tokens is None:
        output = "not logged"
    elif summary.requests_without_output:
        output = f"{summary.output_tokens:,} (not logged for {summary.requests_without_output:,} requests)"
    else:
        output = f"{summary.output_tokens:,}"
    prefill = "unknown" if summary.prefill_share is None else f"{summary.prefill_share:.1%} of all tokens"
    rows = [
        ("requests", f"{summary.requests:,}"),
        ("prompt tokens", f"{summary.prompt_tokens:,}"),
        ("output tokens", output),
        ("prefill share", prefill),
        ("distinct tokens", f"{summary.distinct_tokens:,} (what an unlimited cache ends up holding)"),
    ]
    return "\n".join(f"  {name:<18}{value}" for name, value in rows)


def _malformed(summary: Summary) -> str:
    if not summary.malformed_lines:
        return ""
    lines = [f"Malformed lines: {summary.malformed_lines:,}, skipped"]
    lines += [f"  {m}" for m in summary.malformed[:MALFORMED_SHOWN]]
    if summary.malformed_lines > MALFORMED_SHOWN:
        more = summary.malformed_lines - MALFORMED_SHOWN
        lines.append(f"  ... and {more:,} more (--json lists the first {MALFORMED_KEPT:,})")
    return "\n".join(lines)


def _reuse_table(summary: Summary) -> str:
    head = f"{'Reusable prompt tokens':<26}{'token granularity':>22}{f'{summary.block_size}-token blocks':>22}"
    rows = [_reuse_row("unlimited cache", summary.unlimited)]
    rows += [_reuse_row(f"cache of {p.cache_tokens:,}", p) for p in reversed(summary.capacity_curve)]
    return "\n".join([head, *rows])


def _reuse_row(label: str, point: CachePoint) -> str:
    cells = "".join(f"{reuse.tokens:>15,} {reuse.share:>6.1%}" for reuse in (point.token, point.block))
    return f"  {label:<24}{cells}"


def _hit_ratio_table(summary: Summary) -> str:
    token, block = summary.hit_ratios["token"], summary.hit_ratios["block"]
    head = f"{'Per-request hit ratio (unlimited)':<36}{'token':>12}{f'{summary.block_size}-token blocks':>22}"
    rows = [f"  {'none':<34}{token.no_reuse:>12,}{block.no_reuse:>22,}"]
    edges = block.histogram_edges
    for label, t, b in zip(_bin_labels(edges), token.histogram_counts, block.histogram_counts):
        rows.append(f"  {label:<34}{t:>12,}{b:>22,}")
    for name in ("median", "p90", "mean"):
        rows.append(f"  {name:<34}{getattr(token, name):>12.1%}{getattr(block, name):>22.1%}")
    return "\n".join([head, *rows])


def _bin_labels(edges: tuple[float, ...]) -> list[str]:
    """Interval labels: the first bin leaves out 0 (counted as "none"), the last includes 100%."""
    last = len(edges) - 2
    return [
        f"{'(' if i == 0 else '['}{edges[i]:.0%}, {edges[i + 1]:.0%}{']' if i == last else ')'}"
        for i in range(last + 1)
    ]


def _shared_prefixes(summary: Summary) -> str:
    if not summary.shared_prefixes:
        return "Top shared prefixes: none (no two requests share a prefix)"
    lines = [f"{'Top shared prefixes':<22}{'tokens':>10}{'requests':>10}  first characters"]
    for prefix in summary.shared_prefixes:
        text = json.dumps(prefix.text[:PREVIEW_CHARS], ensure_ascii=False)
        lines.append(f"  {'':<20}{prefix.tokens:>10,}{prefix.requests:>10,}  {text}")
    return "\n".join(lines)


def _server_check(summary: Summary) -> str:
    check = summary.server_check
    if check is None:
        return ""
    lines = [
        f"The log's own cached_tokens ({check.requests:,} requests), against the prediction "
        f"in {summary.block_size}-token blocks, unlimited cache",
        f"  logged {check.logged_cached_tokens:,}, predicted {check.predicted_cached_tokens:,}; "
        f"{check.exact:,} of {check.requests:,} requests exactly as predicted",
    ]
    lines += [
        f"  line {line}: predicted {predicted:,}, logged {logged:,}" for line, predicted, logged in check.differences
    ]
    return "\n".join(lines)


def _routing(summary: Summary) -> str:
    if not summary.routing:
        return ""
    replicas = len(summary.routing[0].requests_per_replica)
    lines = [
        f"Routing forecast: {replicas} replicas behind SGLang Model Gateway, each with its own cache "
        f"({summary.block_size}-token blocks)",
        f"  {'policy':<14}{'cache per replica':<20}{'hit rate':>9}{'prefill saved':>15}{'prefill left':>14}"
        f"  requests on each replica (busiest / mean in brackets)",
    ]
    for route in summary.routing:
        spread = f"{'/'.join(map(str, route.requests_per_replica))} ({route.imbalance:.2f})"
        for i, point in enumerate(route.points):
            size = "unlimited" if point.cache_tokens is None else f"{point.cache_tokens:,} tokens"
            lines.append(
                f"  {route.policy if i == 0 else '':<14}{size:<20}{point.reused.share:>9.1%}"
                f"{point.reused.tokens:>15,}{point.prefill_tokens:>14,}  {spread if i == 0 else ''}".rstrip()
            )
    return "\n".join(lines)


def _recommendation(recommendation: Recommendation) -> str:
    lines = ["Recommendation (an upper bound)", *_wrap(recommendation.verdict, "  ", "  ")]
    for reason in recommendation.reasons:
        lines += _wrap(reason, "  - ", "    ")
    return "\n".join(lines)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest)
