"""The web console in a real browser (Debian's chromium driven by Playwright) against the real
server of conftest.py (the default model, an API key, a --reports folder).

Set PAGODA_CONSOLE_SCREENSHOTS=docs/images to write the README's screenshots (laptop and phone
widths); otherwise they go to the test's temporary folder, so every run still takes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import API_KEY, MODEL, metric

pytestmark = pytest.mark.slow

LAPTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}
WAVES_FOR_DOCS = 12  # load waves before the README's dashboard screenshot
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SET_KEY = f"sessionStorage.setItem('pagoda-api-key', {API_KEY!r})"


def chromium_path() -> str | None:
    """Debian's chromium (apt-get install chromium), or the one PAGODA_CHROMIUM names."""
    return os.environ.get("PAGODA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the test extra)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium found: install Debian's package (apt-get install chromium) or set PAGODA_CHROMIUM")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("PAGODA_CONSOLE_SCREENSHOTS")
    return Path(folder) if folder else tmp_path_factory.mktemp("console-shots")


class Page:
    """A browser page on the console that records console errors and uncaught exceptions."""

    def __init__(self, browser, server, viewport=LAPTOP, with_key=True, scheme="light") -> None:
        self.context = browser.new_context(viewport=viewport, color_scheme=scheme)
        if with_key:
            self.context.add_init_script(SET_KEY)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.base_url = server.base_url

    def open(self, tab: str):
        self.page.goto(f"{self.base_url}/#{tab}")
        return self.page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page_of(browser, server):
    pages: list[Page] = []

    def make(**kwargs) -> Page:
        pages.append(Page(browser, server, **kwargs))
        return pages[-1]

    yield make
    for page in pages:
        page.close()


def test_without_the_key_the_page_asks_for_it_and_shows_nothing(page_of):
    console = page_of(with_key=False)
    page = console.open("dashboard")
    page.wait_for_selector("#key-prompt", state="visible")
    assert page.inner_text("#engine-info") == ""  # no engine data without the key
    page.fill("#key-input", "wrong-key")
    page.click("#key-form button")
    page.wait_for_selector("#key-error", state="visible")  # refused, asked again
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    page.wait_for_selector("#key-prompt", state="hidden")
    page.wait_for_function(f"document.querySelector('#engine-info').innerText.includes({MODEL!r})")
    # only the 401s of the refused attempts were logged
    assert all("401" in error for error in console.errors), console.errors


def test_dashboard_counters_move_under_load(page_of, server, client, shots):
    console = page_of()
    page = console.open("dashboard")
    page.wait_for_function(f"document.querySelector('#engine-info').innerText.includes({MODEL!r})")
    page.wait_for_function("document.querySelector('#value-requests').innerText !== '–'")  # a first sample
    ids: list[str] = []  # the first wave's
    with _load_waves(client, ids):  # while the requests run, the live counters leave zero
        page.wait_for_function(f"{_value('throughput')} > 0 && {_value('requests')} > 0", timeout=30_000)
    # every request appears in the table, and the next second's sample counts them
    for request_id in ids:
        page.wait_for_selector(f"#requests td[title^='{request_id} ']", timeout=10_000)
    page.wait_for_function(f"{_value('finished')} >= {len(ids)} && {_value('ttft')} > 0")
    row = page.inner_text(f"#requests tr:has(td[title^='{ids[0]} '])").split("\t")
    assert row[-1].strip() == "length" and int(row[4]) == 48  # output tokens, finish reason
    # the screenshot under load: more waves when writing the README's (the plots fill in)
    for _ in range(WAVES_FOR_DOCS if os.environ.get("PAGODA_CONSOLE_SCREENSHOTS") else 1):
        with _load_waves(client, []):
            page.wait_for_function(f"{_value('requests')} > 0", timeout=30_000)
            page.wait_for_timeout(1500)
    page.screenshot(path=str(shots / "console-dashboard.png"), full_page=True)
    phone = page_of(viewport=PHONE, scheme="dark")
    phone.open("dashboard").wait_for_function(f"{_value('finished')} > 0")
    phone.page.screenshot(path=str(shots / "console-dashboard-phone.png"))
    assert console.errors == [] and phone.errors == []


def _value(tile: str) -> str:
    """JavaScript: a dashboard tile's headline as a number (its first one for "6 / 0")."""
    return f"parseFloat(document.querySelector('#value-{tile}').innerText.replace(/,/g, ''))"


@contextmanager
def _load_waves(client, first_ids: list[str]) -> Iterator[None]:
    """Waves of six concurrent 48-token chats until the block ends (the first wave's ids go into
    `first_ids`). One wave can begin and end between two of the dashboard's one-second samples, so
    a wait for the page to see requests running keeps the load going until it does."""
    stop = threading.Event()

    def waves() -> None:
        ids = first_ids
        while not stop.is_set():
            _chat_load(client, 6, 48, ids)
            ids = []

    thread = threading.Thread(target=waves)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _chat_load(client, requests: int, tokens: int, ids: list[str]) -> None:
    """`requests` concurrent chats of exactly `tokens` tokens each; their ids go into `ids`."""

    def one(i: int) -> None:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 40}."}],
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        ids.append(answer.id)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_playground_streams_the_same_greedy_answer_as_the_api(page_of, client, shots):
    question = "What is the capital of France? Answer in one sentence."
    expected = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You are a geography teacher."}, {"role": "user", "content": question}],
        temperature=0,
        max_tokens=40,
    )
    console = page_of()
    page = console.open("playground")
    page.fill("#system", "You are a geography teacher.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "40")
    page.fill("#prompt", question)
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done']", timeout=60_000)
    assert page.inner_text(".msg.assistant .text") == expected.choices[0].message.content
    stats = page.inner_text(".msg.assistant .stats")
    usage = expected.usage
    assert f"prompt {usage.prompt_tokens} tokens" in stats and f"output {usage.completion_tokens}" in stats, stats
    assert "TTFT" in stats and "tokens/s" in stats and f"finish: {expected.choices[0].finish_reason}" in stats
    page.screenshot(path=str(shots / "console-playground.png"))
    phone = page_of(viewport=PHONE, scheme="dark")
    phone_page = phone.open("playground")
    phone_page.fill("#temperature", "0")
    phone_page.fill("#max_tokens", "40")
    phone_page.fill("#prompt", question)
    phone_page.click("#send")
    phone_page.wait_for_selector(".msg.assistant[data-state='done']", timeout=60_000)
    phone_page.locator(".chat").scroll_into_view_if_needed()
    phone_page.screenshot(path=str(shots / "console-playground-phone.png"))
    assert console.errors == [] and phone.errors == []


def test_playground_json_schema_and_tools_boxes(page_of):
    console = page_of()
    page = console.open("playground")
    page.click("details summary")
    page.fill("#max_tokens", "60")
    page.fill("#json-schema", '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')
    page.fill("#prompt", "Name a city in France.")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done']", timeout=60_000)
    assert isinstance(json.loads(page.inner_text(".msg.assistant .text"))["city"], str)
    page.click("#clear")
    page.fill("#json-schema", "")
    page.fill("#tools", "[{not json")
    page.fill("#prompt", "What is the weather in Paris?")
    page.click("#send")
    assert "Tools: not valid JSON" in page.inner_text("#settings-error")  # refused before sending
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    page.fill("#tools", json.dumps([tool]))
    page.select_option("#tool-choice", "required")
    page.click("#send")
    page.wait_for_selector(".msg.assistant:not([data-state='streaming'])", timeout=60_000)
    assert page.get_attribute(".msg.assistant", "data-state") == "done", page.inner_text(".msg.assistant")
    call = page.inner_text(".msg.assistant pre.calls")
    assert call.startswith("get_weather(") and "city" in json.loads(call[len("get_weather(") : -1])
    assert "finish: tool_calls" in page.inner_text(".msg.assistant .stats")
    assert console.errors == []


def test_the_stop_button_aborts_the_stream(page_of, server):
    aborted_before = _aborts(server)
    console = page_of()
    page = console.open("playground")
    page.fill("#max_tokens", "1500")
    page.fill("#prompt", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.msg.assistant .text').innerText.length > 0", timeout=60_000)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state='stopped']", timeout=10_000)
    assert "finish: stopped" in page.inner_text(".msg.assistant .stats")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    deadline = time.monotonic() + 10  # the server sees the disconnect and aborts the engine request
    while _aborts(server) == aborted_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborts(server) > aborted_before
    assert console.errors == []


def test_a_refused_turn_is_left_out_of_the_conversation(page_of):
    console = page_of()
    page = console.open("playground")
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    for max_tokens, text in (("4", "Say hello"), ("100000", "Again"), ("4", "Third")):
        page.fill("#max_tokens", max_tokens)
        page.fill("#prompt", text)
        page.click("#send")
        page.wait_for_selector(".msg.assistant:last-child:not([data-state='streaming'])", timeout=60_000)
    states = [node.get_attribute("data-state") for node in page.query_selector_all(".msg.assistant")]
    assert states == ["done", "error", "done"], states
    assert "maximum context length" in page.inner_text(".msg.assistant[data-state='error'] .error")
    assert [m["content"] for m in sent[-1]["messages"] if m["role"] == "user"] == ["Say hello", "Third"]
    assert all("400" in error for error in console.errors), console.errors  # the refusal's fetch only


def _chat_bodies(page) -> list[dict]:
    """The bodies of the chat requests the page sends from now on."""
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    return sent


def test_clear_while_an_answer_streams_starts_a_conversation_without_it(page_of):
    console = page_of()
    page = console.open("playground")
    sent = _chat_bodies(page)
    page.fill("#max_tokens", "1500")
    page.fill("#prompt", "Write a very long story about the sea.")
    page.click("#send")
    page.wait_for_function("document.querySelector('.msg.assistant .text').innerText.length > 0", timeout=60_000)
    page.click("#clear")
    page.fill("#max_tokens", "4")
    page.fill("#prompt", "Hi")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done']", timeout=60_000)
    assert sent[-1]["messages"] == [{"role": "user", "content": "Hi"}]
    assert page.locator(".msg").count() == 2  # the new chat's question and answer only
    assert console.errors == []


def test_a_tool_call_is_answered_with_its_result_and_the_model_goes_on(page_of):
    console = page_of()
    page = console.open("playground")
    sent = _chat_bodies(page)
    page.click("details summary")
    page.fill("#max_tokens", "80")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    page.fill("#tools", json.dumps([tool]))
    page.select_option("#tool-choice", "required")
    page.fill("#prompt", "What is the weather in Paris?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done'] pre.calls", timeout=60_000)
    assert page.get_attribute("#prompt", "placeholder").startswith("Result of get_weather(")
    page.select_option("#tool-choice", "none")
    results = 0  # the model may call the tool more than once: a result for each call, in turn
    while page.get_attribute("#prompt", "placeholder").startswith("Result of get_weather("):
        page.fill("#prompt", '{"temperature": 21}')
        page.click("#send")
        results += 1
    answer = f".msg.assistant:nth-of-type({results + 3})"  # after the question, the calls and the results
    page.wait_for_selector(f"{answer}:not([data-state='streaming'])", timeout=60_000)
    assert page.get_attribute(answer, "data-state") == "done", page.inner_text("#messages")
    question, call, *sent_results = sent[-1]["messages"]
    ids = [tool_call["id"] for tool_call in call["tool_calls"]]  # the calls go back as the model made them
    assert call["role"] == "assistant" and len(ids) == results >= 1 and all(ids)
    assert sent_results == [{"role": "tool", "tool_call_id": i, "content": '{"temperature": 21}'} for i in ids]
    assert page.get_attribute("#prompt", "placeholder").startswith("Message")
    assert console.errors == []


def _sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def _choice(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_refused_result_in_a_round_of_two_calls_is_taken_back_alone(page_of):
    """The server (faked here) calls two tools; the first result waits for the second; the request
    with both is refused: only the second goes back to the box, asked for again, and the next send
    has both results, each for its own call."""
    console = page_of()
    page = console.open("playground")
    bodies: list[dict] = []
    calls = [
        {"index": i, "id": f"call-{name}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        for i, name in enumerate(("first", "second"))
    ]

    def server(route) -> None:
        bodies.append(json.loads(route.request.post_data))
        if len(bodies) == 1:
            body = _sse(_choice({"role": "assistant", "tool_calls": calls}), _choice({}, "tool_calls"))
        elif len(bodies) == 2:
            error = {"error": {"message": "refused", "type": "BadRequestError", "param": None, "code": 400}}
            return route.fulfill(status=400, json=error)
        else:
            body = _sse(_choice({"role": "assistant", "content": "both done"}), _choice({}, "stop"))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", server)
    page.fill("#prompt", "Do both.")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done'] pre.calls")
    assert page.get_attribute("#prompt", "placeholder").startswith("Result of first(")
    page.fill("#prompt", "one")
    page.click("#send")
    assert len(bodies) == 1 and page.get_attribute("#prompt", "placeholder").startswith("Result of second(")
    page.fill("#prompt", "two")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='error']")
    assert page.input_value("#prompt") == "two"
    assert page.get_attribute("#prompt", "placeholder").startswith("Result of second(")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done'] >> text=both done")
    results = [m for m in bodies[-1]["messages"] if m["role"] == "tool"]
    assert results == [
        {"role": "tool", "tool_call_id": "call-first", "content": "one"},
        {"role": "tool", "tool_call_id": "call-second", "content": "two"},
    ]
    assert all("400" in error for error in console.errors), console.errors


def test_input_the_page_must_not_send(page_of):
    """A key refused on send puts the message back; a malformed number and an input method's Enter
    send nothing."""
    console = page_of()
    page = console.open("playground")
    sent = _chat_bodies(page)
    page.wait_for_function(f"document.querySelector('#model-name').innerText === {MODEL!r}")
    page.evaluate("api.key = 'a-stale-key'")  # as after a restart with another key
    page.fill("#max_tokens", "4")
    page.fill("#prompt", "Hello there")
    page.click("#send")
    page.wait_for_selector("#key-prompt", state="visible")
    assert page.input_value("#prompt") == "Hello there" and page.locator(".msg").count() == 0
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state='done']", timeout=60_000)
    assert sent[-1]["messages"] == [{"role": "user", "content": "Hello there"}]
    count = len(sent)
    page.click("#temperature")
    page.keyboard.type("1e")  # not a number: the box's value is "" and the field would be left out
    page.fill("#prompt", "Again")
    page.click("#send")
    assert page.inner_text("#settings-error") == "temperature: not a number"
    page.fill("#temperature", "")
    page.evaluate(
        "document.querySelector('#prompt').dispatchEvent("
        "new KeyboardEvent('keydown', {key: 'Enter', isComposing: true, bubbles: true}))"
    )
    page.wait_for_timeout(300)
    assert len(sent) == count and page.input_value("#prompt") == "Again"
    assert all("401" in error for error in console.errors), console.errors  # the stale key's refusal


def test_the_dashboard_reads_afresh_when_the_server_restarts(page_of):
    """A restarted server's feed counts from 1 again: its new instance makes the page drop what it
    holds and read the feed from the start (here a route stands in for the new server's answers)."""
    console = page_of()
    page = console.open("dashboard")
    feeds: list[str] = []
    restarted = threading.Event()

    def feed(route) -> None:
        feeds.append(route.request.url)
        response = route.fetch()
        body = response.json()
        if restarted.is_set():
            body["instance"] = "a-new-server"
        route.fulfill(response=response, json=body)

    page.route("**/console/api/feed*", feed)
    page.wait_for_function("document.querySelector('#value-requests').innerText !== '–'")
    page.wait_for_timeout(2500)  # a few polls, so that the page reads only newer samples
    assert "after=0&" not in feeds[-1]
    count = len(feeds)
    restarted.set()
    deadline = time.monotonic() + 10
    while not any("after=0&after_request=0" in url for url in feeds[count:]):
        assert time.monotonic() < deadline, feeds[count:]
        page.wait_for_timeout(200)
    page.wait_for_timeout(1500)  # and it goes on from there
    assert "after=0&" not in feeds[-1] and page.get_attribute("#conn", "class") == "conn live"
    assert console.errors == []


def _aborts(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return metric(text, "pagoda:request_success_total", required=False, finished_reason="abort")


def test_a_real_bench_report_renders_with_its_tables_and_plots(page_of, browser, server, shots):
    folder = server.reports / "bench-smollm2"
    # a process of its own: Playwright's sync API keeps an event loop running on this thread
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "bench",
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--endpoint",
            "chat",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--num-prompts",
            "4",
            "--concurrency",
            "1,2",
            "--warmup",
            "0",
            "--output",
            str(folder),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    console = page_of()
    page = console.open("reports")
    page.wait_for_selector("#report table")
    assert "bench-smollm2" in page.inner_text("#report-select")
    assert page.locator("#report table").count() >= 1
    assert "output tokens/s" in page.inner_text("#report")
    _assert_images_drawn(page, "#report img", 2)
    page.locator("#report h2", has_text="Results").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "console-report.png"))
    phone = page_of(viewport=PHONE, scheme="dark")
    phone.open("reports").wait_for_selector("#report table")
    _assert_images_drawn(phone.page, "#report img", 2)
    phone.page.locator("#report img").first.scroll_into_view_if_needed()
    phone.page.screenshot(path=str(shots / "console-report-phone.png"))
    # the static report.html beside report.md: the same tables and plots, read from the file alone
    offline = browser.new_page()
    offline.goto((folder / "report.html").as_uri())
    assert offline.locator("table").count() == page.locator("#report table").count()
    _assert_images_drawn(offline, "img", 2)
    offline.close()
    assert console.errors == [] and phone.errors == []


def _assert_images_drawn(page, selector: str, count: int) -> None:
    page.wait_for_function(
        f"[...document.querySelectorAll({selector!r})].every(img => img.complete && img.naturalWidth > 0)"
    )
    assert page.locator(selector).count() == count
