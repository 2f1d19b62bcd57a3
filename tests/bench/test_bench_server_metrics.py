"""Prometheus parsing and the prefix-cache hit rate for Pagoda's, vLLM's and SGLang's names."""

from __future__ import annotations

import pytest

from pagoda.bench.server_metrics import parse_prometheus, prefix_cache_stats

PAGODA = """# HELP pagoda:prefix_cache_queries Prompt tokens looked up.
# TYPE pagoda:prefix_cache_queries counter
pagoda:prefix_cache_queries_total{{model_name="m"}} {q}
pagoda:prefix_cache_queries_created{{model_name="m"}} 1.7e+09
pagoda:prefix_cache_hits_total{{model_name="m"}} {h}
"""


def test_parse_sums_label_sets_and_survives_odd_label_values() -> None:
    text = (
        'vllm:prefix_cache_hits_total{engine="0",model_name="/m/a b}"} 10\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="say \\"hi\\" {x}"} 5.5 1700000000\n'
        "plain_metric 3\n"
        "broken_metric notanumber\n"
        "\n# a comment\n"
    )
    assert parse_prometheus(text) == {"vllm:prefix_cache_hits_total": 15.5, "plain_metric": 3.0}


def test_pagoda_counters_give_the_rate_over_the_run() -> None:
    before = parse_prometheus(PAGODA.format(q=1000, h=100))
    after = parse_prometheus(PAGODA.format(q=1400, h=400))
    stats = prefix_cache_stats(before, after)
    assert stats is not None and stats.source == "pagoda counters"
    assert (stats.hit_tokens, stats.query_tokens) == (300, 400)
    assert stats.hit_rate == pytest.approx(0.75)


@pytest.mark.parametrize("suffix", ["", "_total"])
def test_counter_names_with_or_without_total(suffix: str) -> None:
    before = {f"vllm:prefix_cache_queries{suffix}": 10.0, f"vllm:prefix_cache_hits{suffix}": 0.0}
    after = {f"vllm:prefix_cache_queries{suffix}": 110.0, f"vllm:prefix_cache_hits{suffix}": 25.0}
    stats = prefix_cache_stats(before, after)
    assert stats is not None and stats.source == "vllm counters" and stats.hit_rate == pytest.approx(0.25)


def test_no_queries_in_the_run_has_no_rate() -> None:
    same = parse_prometheus(PAGODA.format(q=5, h=1))
    stats = prefix_cache_stats(same, same)
    assert stats is not None and stats.hit_rate is None


def test_sglang_gauge_is_read_after_the_run() -> None:
    stats = prefix_cache_stats({"sglang:cache_hit_rate": 0.1}, {"sglang:cache_hit_rate": 0.42})
    assert stats is not None and stats.hit_rate == 0.42 and "gauge" in stats.source


def test_unknown_servers_have_no_stats() -> None:
    assert prefix_cache_stats({"http_requests_total": 1.0}, {"http_requests_total": 2.0}) is None
