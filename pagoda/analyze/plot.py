"""`--plot FILE.png`: prompt reuse against cache size, and the per-request hit ratio histogram."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.simulate import GRANULARITIES
from pagoda.analyze.summary import Summary

PLOT_FORMATS = (".png", ".svg", ".pdf")  # the file's suffix picks the format


def write_plot(summary: Summary, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display needed
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    curve_axes, histogram_axes = figure.subplots(1, 2)
    _curve(curve_axes, summary)
    _histogram(histogram_axes, summary)
    histogram_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(f"Prefix overlap of {Path(summary.log).name} (an upper bound)")
    try:
        figure.savefig(path, format=path.suffix[1:].lower(), dpi=110)
    except OSError as exc:
        raise AnalyzeError(f"Cannot write the plot to {path}: {exc.strerror or exc}") from None


def _labels(summary: Summary) -> dict[str, str]:
    return {"token": "token granularity", "block": f"{summary.block_size}-token blocks"}


def _curve(axes, summary: Summary) -> None:
    # A cache of `distinct_tokens` never evicts: it is the unlimited cache.
    points = {p.cache_tokens: p for p in summary.capacity_curve}
    points.setdefault(summary.distinct_tokens, summary.unlimited)
    sizes = sorted(points)
    for granularity, label in _labels(summary).items():
        shares = [getattr(points[size], granularity).share * 100 for size in sizes]
        axes.plot(sizes, shares, marker="o", label=label)
    axes.axhline(summary.unlimited.block.share * 100, linestyle="--", color="grey", label="unlimited, blocks")
    axes.set_xscale("log")
    axes.set_xlabel("cache size (tokens, LRU eviction)")
    axes.set_ylabel("prompt tokens reused (%)")
    axes.set_ylim(0, 100)
    axes.set_title("Reuse against cache size")
    axes.legend()


def _histogram(axes, summary: Summary) -> None:
    edges = summary.hit_ratios["block"].histogram_edges
    labels = ["none"] + [f"{edges[i]:.0%}-\n{edges[i + 1]:.0%}" for i in range(len(edges) - 1)]
    positions = np.arange(len(labels))
    width = 0.4
    for offset, granularity in zip((-width / 2, width / 2), GRANULARITIES):
        ratios = summary.hit_ratios[granularity]
        axes.bar(
            positions + offset, [ratios.no_reuse, *ratios.histogram_counts], width, label=_labels(summary)[granularity]
        )
    axes.set_xticks(positions, labels)
    axes.set_xlabel("share of the prompt reused (unlimited cache)")
    axes.set_ylabel("requests")
    axes.set_title("Per-request hit ratio")
    axes.legend()
