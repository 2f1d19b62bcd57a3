"""`pagoda serve --data-parallel-size 2`: two replicas of a tiny model behind the real SGLang Model
Gateway (`smg`, cache_aware), one deployment shared by the module, talked to with the `openai`
client. The tests run in file order: the last two kill a replica, then stop the launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import free_port, metric, sse_events
from tests.tiny_models import write_tiny_model

pytest.importorskip("smg")

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 240
MODEL = "tiny"
GROUPS = 3  # shared-prefix groups in the forecast check (odd: round-robin splits each over both replicas)
PER_GROUP = 3


class Deployment:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, request_log: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path
        self.request_log = request_log
        self.replicas: dict[int, tuple[int, str]] = {}  # rank -> (pid, url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> Deployment:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "ready: serving at" not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the deployment did not start (code {self.process.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.25)
        for rank, pid, url in re.findall(r"replica (\d+): pid (\d+) at (\S+)", self.log()):
            self.replicas[int(rank)] = (int(pid), url)
        return self

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60, **kwargs)

    def replica_metrics(self) -> list[str]:
        return [httpx.get(f"{url}/metrics", timeout=10).text for _, url in sorted(self.replicas.values())]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Deployment:
    from pagoda.model_files import load_tokenizer

    folder = tmp_path_factory.mktemp("data_parallel")
    model = write_tiny_model("llama", folder / "tiny", load_tokenizer(None))
    port = free_port()
    command = [
        *(sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model)),
        *("--served-model-name", MODEL, "--port", str(port), "--data-parallel-size", "2", "--threads", "2"),
        *("--kv-cache-memory", "0.05", "--request-log", str(folder / "requests.jsonl"), "--shutdown-timeout", "5"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_path = folder / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    served = Deployment(process, f"http://127.0.0.1:{port}", log_path, folder / "requests.jsonl")
    yield served.wait_ready()
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    for pid, _ in served.replicas.values():
        _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by the launcher) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _requests_served(metrics: str) -> float:
    return metric(metrics, "pagoda:request_success_total", required=False)


def test_requests_spread_and_the_api_works_through_the_gateway(deployment):
    client = deployment.client()
    before = [_requests_served(m) for m in deployment.replica_metrics()]
    for i in range(16):  # texts that share no prefix: each one is a cache miss, sent to the least loaded
        out = client.completions.create(model=MODEL, prompt=f"{chr(97 + i)} request number {i}", max_tokens=3)
        assert out.usage.completion_tokens == 3
    served = [_requests_served(m) - b for m, b in zip(deployment.replica_metrics(), before)]
    assert sum(served) == 16 and min(served) >= 1, served

    # streaming with usage, and an error naming its field, unchanged through the gateway
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert error.value.body["param"] == "max_tokens"

    # what the gateway asks of each replica
    for _, url in deployment.replicas.values():
        loads = httpx.get(f"{url}/v1/loads", timeout=10).json()
        assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_running_reqs"] == 0
        assert httpx.get(f"{url}/get_model_info", timeout=10).json()["is_generation"] is True
    assert httpx.get(f"{deployment.url}/get_server_info", timeout=10).json()["served_model_name"] == MODEL
    assert httpx.get(f"{deployment.url}/health_generate", timeout=60).status_code == 200
    assert httpx.post(f"{deployment.url}/flush_cache", timeout=30).json()["workers_flushed"] == 2
    assert all(deployment.request_log.with_name(f"requests.{rank}.jsonl").stat().st_size for rank in (0, 1))


def test_shared_prefixes_land_on_the_replica_that_cached_them_as_forecast(deployment, tmp_path):
    """Groups of requests sharing a long system prompt, one at a time: after the first of a group,
    the gateway sends the rest where that prefix is cached. The forecast of `pagoda analyze
    --replicas 2` for the same log must equal the cached tokens the replicas report."""
    from pagoda.analyze.pipeline import analyze_log
    from pagoda.analyze.tokenize import PromptTokenizer

    assert httpx.post(f"{deployment.url}/flush_cache", timeout=30).status_code == 200
    client = deployment.client()
    bodies, measured = [], []
    for turn in range(PER_GROUP):
        for group in range(GROUPS):
            system = f"Group {group} rules. " + " ".join(f"rule{group}-{k} holds" for k in range(60))
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}],
                "max_tokens": 2,
            }
            out = client.chat.completions.create(**body)
            bodies.append(body)
            measured.append(out.usage.prompt_tokens_details.cached_tokens)
    assert all(cached > 0 for cached in measured[GROUPS:]), measured  # every later turn hit its prefix

    log = tmp_path / "bodies.jsonl"
    log.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    tokenizer = PromptTokenizer(_model_dir(deployment))
    analysis = analyze_log(log, tokenizer, replicas=2, policies=("cache-aware", "round-robin"))
    forecast = {replay.policy: replay for replay in analysis.routing}
    assert forecast["cache-aware"].reusable().tolist() == measured  # agreement: exact, request by request
    assert forecast["round-robin"].reusable().sum() < sum(measured)  # each prefix computed on both replicas
    counts = forecast["cache-aware"].assignment.tolist()
    for group in range(GROUPS):  # the forecast, too, keeps each group on one replica
        assert len({counts[turn * GROUPS + group] for turn in range(PER_GROUP)}) == 1


def _model_dir(deployment: Deployment) -> str:
    return str(deployment.log_path.parent / "tiny")


def test_a_client_that_disconnects_cancels_its_request_on_the_replica(deployment):
    aborted = sum(
        metric(m, "pagoda:request_success_total", False, finished_reason="abort") for m in deployment.replica_metrics()
    )
    with httpx.stream(
        "POST",
        f"{deployment.url}/v1/completions",
        json={"model": MODEL, "prompt": "count forever", "max_tokens": 1000, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as response:
        events = sse_events(line for _, line in zip(range(3), response.iter_lines()) if line)
        assert events and events[0]["choices"][0]["text"] is not None
    deadline = time.monotonic() + 20
    while True:  # the gateway closes its upstream stream, and the replica aborts the request
        metrics = deployment.replica_metrics()
        now_aborted = sum(metric(m, "pagoda:request_success_total", False, finished_reason="abort") for m in metrics)
        running = [metric(m, "pagoda:num_requests_running") for m in metrics]
        if now_aborted == aborted + 1 and running == [0, 0]:
            break
        assert time.monotonic() < deadline, f"not aborted after the client left: {running}, {now_aborted}"
        time.sleep(0.1)


def _running(deployment: Deployment) -> dict[int, float]:
    return {
        rank: metric(httpx.get(f"{url}/metrics", timeout=10).text, "pagoda:num_requests_running")
        for rank, (_, url) in deployment.replicas.items()
    }


def _taken(deployment: Deployment) -> dict[int, float]:
    """The requests each replica has taken so far: running, or finished for any reason."""
    taken = {}
    for rank, (_, url) in deployment.replicas.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        taken[rank] = metric(text, "pagoda:num_requests_running") + metric(text, "pagoda:request_success_total")
    return taken


def test_a_replica_killed_mid_run_is_taken_out_and_the_survivor_serves(deployment):
    """Where the gateway sends a stream hangs on the prefix trees the earlier tests left and on the
    loads (six streams all went to one replica once), so streams start one by one until both
    replicas serve some, and the victim is the replica serving more."""
    client = deployment.client()
    outcomes: list[str] = []

    def long_request(i: int) -> None:
        prompt = f"{i} " + " the story goes on" * 80
        try:
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=600, stream=True, extra_body={"ignore_eos": True}
            )
            tokens = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)
            outcomes.append("completed" if tokens >= 590 else f"cut after {tokens}")
        except (openai.APIError, httpx.HTTPError) as exc:
            outcomes.append(f"error {type(exc).__name__}")

    threads: list[threading.Thread] = []
    before = _taken(deployment)
    taken = dict.fromkeys(before, 0.0)
    while len(threads) < 6 or min(taken.values()) < 1:  # one at a time, until both replicas took some
        assert len(threads) < 12, f"the streams did not spread over both replicas: {taken}"
        threads.append(threading.Thread(target=long_request, args=(len(threads),)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        # a stream of the tiny model can end within a second, between two looks: count those too
        while sum(taken.values()) < len(threads):
            assert time.monotonic() < deadline, taken
            time.sleep(0.05)
            taken = {rank: count - before[rank] for rank, count in _taken(deployment).items()}
    running = _running(deployment)
    victim = max(running, key=lambda rank: (running[rank], taken[rank]))  # serving the most, else took the most
    _kill(deployment.replicas[victim][0])
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads), "a client hung after its replica died"
    assert len(outcomes) == len(threads) and "completed" in outcomes, outcomes  # the survivor's streams finish

    for i in range(6):  # new requests all land on the survivor
        out = client.completions.create(model=MODEL, prompt=f"after the failure {i}", max_tokens=2)
        assert out.usage.completion_tokens == 2
    deadline = time.monotonic() + 10
    while f"replica {victim} exited" not in deployment.log():
        assert time.monotonic() < deadline, deployment.log()[-2000:]
        time.sleep(0.1)
    assert deployment.process.poll() is None  # the launcher keeps serving on the survivor


def test_sigterm_stops_the_gateway_and_every_replica(deployment):
    """The gateway stops first and drains: a stream in flight at SIGTERM finishes (its replica still
    serves it), and a request sent meanwhile is refused or served, never a 5xx."""
    assert "the gateway: pid" in deployment.log() and "its metrics at http://127.0.0.1:" in deployment.log()
    client = deployment.client()
    stream = client.completions.create(
        model=MODEL,
        prompt="drain me",
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    deployment.process.send_signal(signal.SIGTERM)
    late: list[int | str] = []
    for _ in range(3):
        time.sleep(0.3)
        try:
            late.append(
                httpx.post(f"{deployment.url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code
            )
        except httpx.TransportError as exc:
            late.append(type(exc).__name__)
    streamed = [first, *chunks]  # to its end: the finish reason, then the usage
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].usage.completion_tokens == 200
    assert not [status for status in late if isinstance(status, int) and status >= 500], late
    assert deployment.process.wait(timeout=60) == 0
    assert not any(_alive(pid) for pid, _ in deployment.replicas.values())
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{deployment.url}/health", timeout=2)
