"""One streaming pass over a request log: read each line, turn its prompt into token ids, and
replay it through the cache simulator, with a progress bar over the file's bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.logs import LogEntry, Malformed, in_arrival_order, read_log
from pagoda.analyze.routing import CACHE_THRESHOLD, RoutedReplay, RoutingReplay
from pagoda.analyze.simulate import CacheSimulator, ReplayRequest, Simulation
from pagoda.analyze.tokenize import PromptError, PromptTokenizer

MALFORMED_KEPT = 1000  # listed by line number; beyond that only counted
MALFORMED_SHOWN = 10  # of them in the report or the error
PREVIEW_TOKENS = 48


@dataclass(frozen=True)
class Analysis:
    path: Path
    simulation: Simulation
    malformed_count: int
    malformed: tuple[Malformed, ...]  # the first MALFORMED_KEPT, in file order
    prefix_previews: tuple[str, ...]  # the first characters of each shared prefix
    routing: tuple[RoutedReplay, ...] = ()  # per routing policy, with --replicas N > 1


def analyze_log(
    path: Path,
    tokenizer: PromptTokenizer,
    block_size: int = 16,
    top_prefixes: int = 5,
    replicas: int = 1,
    policies: tuple[str, ...] = (),
    cache_threshold: float = CACHE_THRESHOLD,
) -> Analysis:
    """`replicas` > 1: also replay the log through that many replicas under each routing policy."""
    size = _file_size(path)
    if tokenizer.model is not None:
        tokenizer.load()  # a tokenizer named explicitly must work: fail now, not after a long read
    simulator = CacheSimulator(block_size, top_prefixes)
    routed = [RoutingReplay(p, replicas, block_size, cache_threshold) for p in policies] if replicas > 1 else []
    malformed: list[Malformed] = []
    malformed_count = 0
    with tqdm(total=size, unit="B", unit_scale=True, desc="pagoda analyze", disable=None) as bar:
        for item in in_arrival_order(read_log(path, bar.update)):
            problem = item if isinstance(item, Malformed) else _replay(item, tokenizer, simulator, routed)
            if problem is not None:
                malformed_count += 1
                if len(malformed) < MALFORMED_KEPT:
                    malformed.append(problem)
    if simulator.num_requests == 0:
        if not malformed_count:
            raise AnalyzeError(f"No requests to analyze in {path}: it has no requests (only blank lines, or none).")
        shown = "".join(f"\n  {m}" for m in malformed[:MALFORMED_SHOWN])
        more = f"\n  ... and {malformed_count - MALFORMED_SHOWN:,} more" if malformed_count > MALFORMED_SHOWN else ""
        what = "its one request is" if malformed_count == 1 else f"all {malformed_count:,} requests in it are"
        raise AnalyzeError(f"No requests to analyze in {path}: {what} malformed:{shown}{more}")
    simulation = simulator.finish()
    previews = tuple(_preview(tokenizer, prefix.tokens) for prefix in simulation.shared_prefixes)
    routing = tuple(replay.finish() for replay in routed)
    return Analysis(path, simulation, malformed_count, tuple(malformed), previews, routing)


def _replay(
    entry: LogEntry, tokenizer: PromptTokenizer, simulator: CacheSimulator, routed: list[RoutingReplay]
) -> Malformed | None:
    """Replay one entry; a prompt that cannot be tokenized comes back as a malformed line."""
    try:
        prompt_ids = tokenizer.ids(entry.prompt)
    except PromptError as exc:
        return Malformed(entry.line, str(exc))
    if len(prompt_ids) == 0:
        return Malformed(entry.line, "the prompt has no tokens")
    request = ReplayRequest(
        entry.line, prompt_ids, entry.output_ids, entry.output_tokens, entry.logged_cached_tokens, entry.cache_salt
    )
    simulator.add(request)
    if routed:
        arrival = finish = None  # in flight from arrival to finish, where the log times it
        if entry.arrival is not None and entry.latency_s is not None:
            arrival, finish = entry.arrival, entry.arrival + entry.latency_s
        for replay in routed:
            replay.add(request, entry.text, arrival, finish)
    return None


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise AnalyzeError(f"Cannot read {path}: {exc.strerror or exc}") from None


def _preview(tokenizer: PromptTokenizer, tokens: np.ndarray) -> str:
    """The prefix's first characters; token ids when no tokenizer was needed or named (the log's
    model is unknown then, and loading one just for this would cost seconds)."""
    if tokenizer.loaded:
        return tokenizer.decode(tokens[:PREVIEW_TOKENS])
    return "token ids " + " ".join(str(t) for t in tokens[:PREVIEW_TOKENS].tolist())
