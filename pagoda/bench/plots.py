"""PNG plots against concurrency, one line per engine. matplotlib is imported here only, and
through its object API (Figure + Agg canvas), so no global backend or pyplot state is touched."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pagoda.bench.run import EngineResult, LevelResult

Series = tuple[str, Callable[[LevelResult], float | None], str]  # label suffix, value, line style


def write_plots(folder: Path, results: Sequence[EngineResult]) -> list[Path]:
    """throughput_vs_concurrency.png and ttft_vs_concurrency.png; none when nothing was measured."""
    if not any(r.levels for r in results):
        return []
    throughput: list[Series] = [("", lambda lv: lv.summary.output_throughput, "-")]
    ttft: list[Series] = [
        (" p50", lambda lv: lv.summary.ttft.median * 1000 if lv.summary.ttft else None, "-"),
        (" p95", lambda lv: lv.summary.ttft.p95 * 1000 if lv.summary.ttft else None, "--"),
    ]
    return [
        _plot(folder / "throughput_vs_concurrency.png", results, throughput, "output tokens/s", "Output throughput"),
        _plot(folder / "ttft_vs_concurrency.png", results, ttft, "TTFT (ms)", "Time to first token, p50 and p95"),
    ]


def subtitle(results: Sequence[EngineResult]) -> str:
    """The models and workloads measured, each named once."""
    models = dict.fromkeys(r.model for r in results if r.model)
    workloads = dict.fromkeys(r.workload_name for r in results if r.workload_name)
    return "; ".join(filter(None, [", ".join(models), ", ".join(workloads)]))


def _plot(path: Path, results: Sequence[EngineResult], series: Sequence[Series], ylabel: str, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for number, result in enumerate(results):
        color = f"C{number % 10}"
        for suffix, value, style in series:
            points = [(lv.concurrency, value(lv)) for lv in sorted(result.levels, key=lambda lv: lv.concurrency)]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                xs, ys = zip(*points)
                axes.plot(xs, ys, style, marker="o", color=color, label=result.name + suffix)
    concurrencies = sorted({lv.concurrency for r in results for lv in r.levels})
    if len(concurrencies) > 1 and concurrencies[-1] / concurrencies[0] >= 10:
        axes.set_xscale("log")
    axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axes.set_xlabel("concurrency")
    axes.set_ylabel(ylabel)
    axes.set_title(f"{title}\n{subtitle(results)}", fontsize=10)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    if axes.lines:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
