"""The console's routes over HTTP (the real server of conftest.py, with an API key and --reports),
and its feed (console/feed.py) stepped by hand with fake engine counters."""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import pytest

from pagoda.core.outputs import SchedulerStats
from pagoda.entrypoints.openai.console import feed as feed_module
from pagoda.entrypoints.openai.console.feed import EngineFeed, RecentRequests
from pagoda.entrypoints.openai.console.routes import find_report, report_folders
from tests.server.helpers import MODEL

DATA_ROUTES = ("/console/api/info", "/console/api/feed", "/console/api/reports")


@pytest.mark.slow
def test_the_page_is_open_and_its_data_needs_the_key(server, http):
    page = httpx.get(f"{server.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="console/console.js">' in page.text  # relative: it resolves under a proxy's prefix
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
        assert httpx.get(f"{server.base_url}/console/{name}", timeout=10).headers["content-type"].startswith(kind)
    missing = httpx.get(f"{server.base_url}/console/secrets.txt", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"
    for route in DATA_ROUTES:
        refused = httpx.get(f"{server.base_url}{route}", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", route
        assert http.get(route).status_code == 200, route
    info = http.get("/console/api/info").json()
    assert (info["model"], info["device"], info["dtype"], info["reports"]) == (MODEL, "cpu", "float32", True)
    # the engine card's switches (the test server: tool_choice auto on, no speculation, no LoRA)
    assert (info["auto_tool_choice"], info["speculative"], info["lora_adapters"]) == (True, None, None)
    assert isinstance(info["deterministic"], bool)
    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    assert not [path for path in paths if path == "/" or path.startswith("/console")]  # the page's, not the API


@pytest.mark.slow
def test_the_feed_has_the_requests_numbers_and_never_their_prompts(server, http, client):
    secret = f"a prompt that must not leak {uuid.uuid4().hex}"
    before = http.get("/console/api/feed").json()
    while not before["samples"]:  # a server started a moment ago has taken no sample yet (1 Hz)
        time.sleep(0.2)
        before = http.get("/console/api/feed").json()
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=5, temperature=0
    )
    deadline = time.monotonic() + 10
    while True:  # the row is there at once; the sample that counts its tokens within a second
        after = http.get("/console/api/feed", params={"after": before["samples"][-1]["seq"]}).json()
        if any(s["generation_tps"] > 0 for s in after["samples"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["samples"] and all(s["seq"] > before["samples"][-1]["seq"] for s in after["samples"])
    assert any(s["generation_tps"] > 0 for s in after["samples"])
    row = next(r for r in after["requests"] if r["request_id"] == answer.id)
    assert (row["prompt_tokens"], row["output_tokens"]) == (answer.usage.prompt_tokens, 5)
    assert row["cached_tokens"] == answer.usage.prompt_tokens_details.cached_tokens
    assert row["finish_reason"] == "length" and 0 < row["ttft_s"] <= row["latency_s"] and row["tpot_s"] > 0
    assert row["prompt"] is None and secret not in http.get("/console/api/feed").text
    newer = http.get("/console/api/feed", params={"after_request": row["seq"]}).json()["requests"]
    assert all(r["seq"] > row["seq"] for r in newer)
    bad = http.get("/console/api/feed", params={"after": -1})
    assert bad.status_code == 400 and "after" in bad.json()["error"]["param"]


@pytest.mark.slow
def test_the_feed_shows_prompts_only_where_the_server_logs_them(small_server):
    """The small server runs with --log-prompts (and no key): its rows carry the prompt text.
    (test_server_small.py ends that server last; this module runs before it.)"""
    text = f"Say the word {uuid.uuid4().hex[:8]}"
    base = small_server.base_url
    body = {"model": MODEL, "prompt": text, "max_tokens": 2}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    rows = httpx.get(f"{base}/console/api/feed", timeout=10).json()["requests"]
    assert next(r for r in rows if r["request_id"] == answer["id"])["prompt"].endswith(text)
    assert httpx.get(f"{base}/console/api/info", timeout=10).json()["prompts_shown"] is True


@pytest.mark.slow
def test_reports_outside_the_listing_are_not_found(server, http):
    (server.reports / "by-hand").mkdir(exist_ok=True)
    (server.reports / "by-hand" / "report.md").write_text("# by hand\n\n| a | b |\n|---|---|\n| <b>1</b> | 2 |\n")
    assert "by-hand" in http.get("/console/api/reports").json()["reports"]
    html = http.get("/console/api/report", params={"name": "by-hand"}).json()["html"]
    assert "<td>&lt;b&gt;1&lt;/b&gt;</td>" in html  # text is escaped
    for name in ("../requests.jsonl", "..", "by-hand/../..", "../../etc/passwd", "nothing", ""):
        assert http.get("/console/api/report", params={"name": name}).status_code == 404, name
    # the folder itself, ".": a name no URL path keeps, asked as a query parameter
    root = server.reports / "report.md"
    root.write_text("# at the root\n")
    try:
        assert "." in http.get("/console/api/reports").json()["reports"]
        assert "<h1>at the root</h1>" in http.get("/console/api/report", params={"name": "."}).json()["html"]
    finally:
        root.unlink()


def test_report_folders_lists_only_folders_with_a_report(tmp_path):
    for name in ("a", "b/c", "b/d", "e/f/g"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("a", "b/c"):
        (tmp_path / name / "report.md").write_text("# r\n")
    (tmp_path / "e/f/g/report.md").write_text("# too deep\n")
    assert sorted(report_folders(tmp_path)) == ["a", "b/c"]
    assert find_report(tmp_path, "b/c") == tmp_path / "b/c"
    assert find_report(tmp_path, "b/../a") is None and find_report(tmp_path, "e/f/g") is None


class FakeEngine:
    """SchedulerStats as the engine thread would publish them."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()


def _row(ttft: float, tpot: float) -> dict:
    return dict(
        request_id="r",
        endpoint="/v1/completions",
        finished=0.0,
        prompt_tokens=10,
        output_tokens=4,
        cached_tokens=0,
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=ttft + 3 * tpot,
        finish_reason="length",
    )


def test_the_feed_rates_hit_rates_and_percentiles(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(feed_module.time, "monotonic", lambda: clock[0])
    engine, requests = FakeEngine(), RecentRequests()
    feed = EngineFeed(lambda: engine.stats, requests)
    feed.sample()
    # the first minute: 100 prompt tokens looked up, 40 found; then 100 more, none found
    clock[0] += 2
    engine.stats = SchedulerStats(
        num_running=3, prompt_tokens=60, generation_tokens=20, prefix_cache_queries=100, prefix_cache_hits=40
    )
    ttfts = [0.1 * i for i in range(1, 21)]
    for ttft in ttfts:
        requests.add(_row(ttft, ttft / 10), clock[0])
    first = feed.sample()
    assert (first.running, first.prompt_tps, first.generation_tps) == (3, 30.0, 10.0)
    assert first.hit_rate_minute == first.hit_rate_total == pytest.approx(0.4)
    expected = np.percentile(ttfts, [50, 90, 99])
    assert [first.ttft_p50, first.ttft_p90, first.ttft_p99] == pytest.approx(list(expected))
    assert first.tpot_p99 == pytest.approx(expected[2] / 10) and first.finished_minute == 20
    for _ in range(70):  # a minute later, 100 more lookups without a hit
        clock[0] += 1
        feed.sample()
    engine.stats = SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=40)
    clock[0] += 1
    later = feed.sample()
    assert later.hit_rate_minute == 0.0 and later.hit_rate_total == pytest.approx(0.2)
    assert later.ttft_p50 is None and later.finished_minute == 0  # those requests left the window
    assert len(requests.latest()) == 20  # ...but the table keeps the last rows
    assert [s["seq"] for s in feed.since(after_sample=later.seq - 2)["samples"]] == [later.seq - 1, later.seq]


def test_the_ring_buffer_keeps_ten_minutes():
    engine = FakeEngine()
    feed = EngineFeed(lambda: engine.stats, RecentRequests())
    for _ in range(feed_module.HISTORY_S + 50):
        feed.sample()
    samples = feed.since()["samples"]
    assert len(samples) == feed_module.HISTORY_S and samples[-1]["seq"] == feed_module.HISTORY_S + 50
