"""The routing forecast's model of SGLang Model Gateway (routing.py), and `--replicas` end to end.
Its agreement with the real gateway is tested in tests/server/test_data_parallel.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pagoda.analyze.cli import main
from pagoda.analyze.routing import Gateway, RoutingReplay, TextTree, request_text
from pagoda.analyze.simulate import ReplayRequest

from .conftest import write_log


def test_text_tree_matches_the_longest_prefix_and_its_holders():
    tree = TextTree()
    assert tree.match("anything") == (0, set())
    tree.insert("system prompt A: hello", 0)
    tree.insert("system prompt B: bye", 1)
    tree.insert("system prompt A: howdy", 1)
    assert tree.match("system prompt A: he") == (len("system prompt A: he"), {0})
    assert tree.match("system prompt A: h") == (len("system prompt A: h"), {0, 1})
    assert tree.match("system prompt C") == (len("system prompt "), {0, 1})
    assert tree.match("x") == (0, set())


def test_text_tree_agrees_with_a_brute_force_search():
    rng = random.Random(0)
    tree, inserted = TextTree(), []
    for step in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        matched, holders = tree.match(text)
        best = max((_shared(text, t) for t, _ in inserted), default=0)
        assert matched == best, (step, text)
        # the holders hold the matched prefix, and so does every worker that was sent a text with it
        assert holders == {w for t, w in inserted if _shared(text, t) >= best} if best else holders == set()
        worker = rng.randrange(3)
        tree.insert(text, worker)
        inserted.append((text, worker))


def _shared(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_cache_aware_follows_the_holder_above_the_threshold_only():
    gateway = Gateway("cache-aware", 2)
    prefix = "p" * 40
    assert gateway.route(prefix + "a" * 60, [0, 0]) == 0  # a miss: the least loaded, ties to the fewest sent
    assert gateway.route(prefix + "b" * 60, [0, 0]) == 0  # 40% of the text matched (> 30%): the holder
    assert gateway.route(prefix[:20] + "c" * 80, [0, 0]) == 1  # 20% matched: a miss, to the one sent fewer
    assert gateway.route(prefix + "d" * 60, [3, 0]) == 0  # the holder although busier (no spill at mean 1.5)
    assert gateway.sent == [3, 1]


def test_cache_aware_spills_a_hot_holder_to_the_least_loaded():
    gateway = Gateway("cache-aware", 2)
    text = "shared system prompt " * 5
    gateway.route(text + "1", [0, 0])
    # mean 5: margin min(64, max(4, 2 * sqrt(5))) = 4.47, so a holder spills above 9.47 (and 7.5)
    assert gateway.route(text + "2", [9, 1]) == 0
    assert gateway.route(text + "3", [10, 0]) == 1
    assert gateway.route(text + "4", [5, 0]) == 1  # now both hold it: the less loaded holder


def test_round_robin_ignores_the_text():
    gateway = Gateway("round-robin", 3)
    assert [gateway.route("same text", [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_loads_come_from_the_logged_timings():
    replay = RoutingReplay("cache-aware", 2, block_size=4)
    ids = np.arange(8, dtype=np.int32)
    for i, text in enumerate(["alpha", "bravo", "charlie"]):  # in flight together, then one after they finished
        replay.add(ReplayRequest(i, ids + 100 * i), text, arrival=float(i), finish=10.0 + i)
    replay.add(ReplayRequest(3, ids + 300), "later", arrival=20.0, finish=21.0)
    assert replay.finish().assignment.tolist() == [0, 1, 0, 1]  # least loaded; then equal loads, fewest sent


def test_request_text_is_what_the_gateway_matches():
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    )
    assert request_text(messages) == "Be brief. Hi"
    assert request_text("a completion prompt") == "a completion prompt"
    assert request_text(np.array([1, 2, 3])) == ""


def test_replicas_report_and_json(tmp_path, capsys):
    system = "You answer questions about group {g}. " + "Context line. " * 20
    lines = [
        {"prompt": system.format(g=g) + f"Question {q}?"} for q in range(3) for g in range(3)
    ]  # three groups in turn: round-robin splits each group over both replicas
    log = write_log(tmp_path / "log.jsonl", lines)
    code = main([str(log), "--replicas", "2", "--cache-tokens", "64,100k", "--json"])
    assert code == 0
    routing = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["routing"]}
    aware, robin = routing["cache-aware"], routing["round-robin"]
    assert [p["cache_tokens"] for p in aware["points"]] == [None, 64, 100_000]
    assert aware["points"][0]["reused"]["tokens"] > robin["points"][0]["reused"]["tokens"] > 0
    assert aware["points"][1]["reused"]["tokens"] < aware["points"][0]["reused"]["tokens"]  # 64 tokens hold little
    assert robin["requests_per_replica"] == [5, 4] and robin["imbalance"] == pytest.approx(5 / 4.5)

    assert main([str(log), "--replicas", "2", "--routing", "cache-aware"]) == 0
    out = capsys.readouterr().out
    assert "Routing forecast: 2 replicas" in out and "cache-aware" in out and "round-robin" not in out


def test_unknown_policy_is_refused(tmp_path, capsys):
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "hello"}])
    with pytest.raises(SystemExit) as exit_:
        main([str(log), "--replicas", "2", "--routing", "random"])
    assert exit_.value.code == 2
    assert "unknown routing policy" in capsys.readouterr().err
