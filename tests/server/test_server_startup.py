"""`pagoda serve`'s start-up, each test with a server process of its own on a tiny model: the
port is bound before the model loads (a busy port fails at once), 503s with Retry-After while it
loads, progress in the log, and a load that fails ends the process with one line and exit 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagoda.engine.args import DETERMINISTIC_BY_DEFAULT
from tests.server.helpers import free_port
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

EXIT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from pagoda.model_files import load_tokenizer

    return str(write_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", load_tokenizer(None)))


def start(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def poll(url: str, until_status: int, timeout_s: float = EXIT_TIMEOUT_S) -> list[httpx.Response]:
    """Every answer from GET `url` until one has `until_status` (connection errors skipped)."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answers.append(httpx.get(url, timeout=5))
        except httpx.TransportError:
            pass
        if answers and answers[-1].status_code == until_status:
            return answers
        time.sleep(0.05)
    pytest.fail(f"GET {url} never answered {until_status}")


def assert_loading_503(response: httpx.Response) -> None:
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"] == {
        "message": "The model is still loading; retry shortly.",
        "type": "server_error",
        "param": None,
        "code": "model_loading",
    }


def test_a_busy_port_fails_at_once_with_one_line_and_exit_1(tiny_model):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        process = start(port, tiny_model)
        _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    assert stderr.strip().splitlines() == [
        f"pagoda serve: cannot listen on 127.0.0.1:{port}: Address already in use (is another server running on it?)"
    ]


def test_bad_thread_settings_fail_before_the_port_with_one_line_and_exit_1(tiny_model):
    process = start(free_port(), tiny_model, "--threads", "0")
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    assert stderr.strip().splitlines() == ["pagoda serve: --threads must be at least 1 thread, got 0"]


def test_503_while_loading_then_the_api_and_progress_in_the_log(tiny_model, tmp_path):
    port = free_port()
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3}')
    flags = (
        "--access-log",
        "--kv-cache-memory",
        "0.01",
        "--root-path",
        "/pagoda",
        "--metrics-prefix",
        "vllm",
        "--generation-config",
        str(tmp_path),
    )
    process = start(port, tiny_model, *flags)
    try:
        # while the model loads, the console page's files are served (the page waits for the engine)
        loading = poll(f"http://127.0.0.1:{port}/pagoda/console/console.js", 200)[-1]
        assert loading.headers["content-type"].startswith("text/javascript")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503, "loaded too soon to see the page load"
        assert "<title>Pagoda</title>" in httpx.get(f"http://127.0.0.1:{port}/").text
        answers = poll(f"http://127.0.0.1:{port}/v1/models", 200)
        assert answers[0].status_code == 503  # the port answered before the model had loaded
        for response in answers[:-1]:
            assert_loading_503(response)
        assert answers[-1].json()["data"][0]["id"] == "llama"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        # --root-path: a path a proxy left its prefix on finds its route too (vLLM's rule)
        assert httpx.get(f"http://127.0.0.1:{port}/pagoda/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/pagoda/v1/models").json()["data"][0]["id"] == "llama"
        # the model as given is its name too (vLLM's id), and generation_config's max_new_tokens
        # is the default max_tokens of a chat request (as vLLM takes it)
        ask = {"model": tiny_model, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=ask, timeout=60).json()
        assert chat["usage"]["completion_tokens"] == 3, chat
        # under vLLM's metric names, vLLM's model_name: the MODEL argument as given
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'vllm:generation_tokens_total{{model_name="{tiny_model}"}} 3.0' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
    steps = ["Reading the model config", "Loading the tokenizer", "Reading weights: file 1 of 1"]
    steps += ["Allocating the KV cache", "loaded llama", "ready: serving llama", "listening on this machine only"]
    positions = [log.index(step) for step in steps]
    assert positions == sorted(positions), log
    # --access-log: each request at the path it came with
    assert '"GET /v1/models HTTP/1.1" 200' in log and '"GET /pagoda/v1/models HTTP/1.1" 200' in log
    assert f"deterministic {'on' if DETERMINISTIC_BY_DEFAULT else 'off'})" in log  # the mode, in the load line


def test_a_log_config_file_is_the_logging_uvicorns_loggers_included(tiny_model, tmp_path):
    """--log-config-file (vLLM's): its dictConfig replaces the default handler and format; a file
    written for vLLM, naming only its loggers, leaves Pagoda's (made before it is read) working."""
    written = tmp_path / "server.log"
    config = {
        "version": 1,
        "formatters": {"mine": {"format": "MINE %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(written), "formatter": "mine"}},
        "root": {"handlers": ["file"], "level": "INFO"},
        "loggers": {"vllm": {"level": "DEBUG"}},
    }
    (tmp_path / "logging.json").write_text(json.dumps(config))
    port = free_port()
    flags = ("--kv-cache-memory", "0.01", "--access-log", "--log-config-file", str(tmp_path / "logging.json"))
    process = start(port, tiny_model, *flags)
    try:
        poll(f"http://127.0.0.1:{port}/health", 200)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while "ready: serving" not in written.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
    lines = written.read_text()
    assert "MINE INFO pagoda.serve: ready: serving llama" in lines
    assert '"GET /health HTTP/1.1" 200' in lines  # uvicorn's access log through the file's handler
    assert "ready: serving" not in stderr  # the default handler is not installed


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "No such file"), ("{", "Expecting property name"), ("{}", "dictionary doesn't specify a version")],
)
@pytest.mark.parametrize("by_variable", [False, True])
def test_a_log_config_that_cannot_be_applied_ends_the_process_with_one_line_and_exit_1(
    tiny_model, tmp_path, content, why, by_variable
):
    path = tmp_path / "logging.json"
    if content is not None:
        path.write_text(content)
    if by_variable:  # vLLM's variable for the same file
        process = start(free_port(), tiny_model, env={"VLLM_LOGGING_CONFIG_PATH": str(path)})
    else:
        process = start(free_port(), tiny_model, "--log-config-file", str(path))
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = stderr.strip().splitlines()
    assert line.startswith(f"pagoda serve: --log-config-file {path}: ") and why in line, line


def test_vllms_operator_flags_take_effect(tiny_model, tmp_path):
    """--default-chat-template-kwargs (under a request's own), --enable-log-outputs,
    --disable-access-log-for-endpoints, --max-num-queued-reqs and --kv-cache-memory-bytes."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}[{{ greeting }}]"
    flags = (
        *("--chat-template", template),
        *("--default-chat-template-kwargs", '{"greeting": "hello"}'),
        "--enable-log-outputs",
        "--access-log",
        *("--disable-access-log-for-endpoints", "/health,/v1/models"),
        *("--max-num-queued-reqs", "7"),
        *("--kv-cache-memory-bytes", "16M"),  # 16 MiB: 0.015625 GiB
    )
    port = free_port()
    process = start(port, tiny_model, *flags)
    url = f"http://127.0.0.1:{port}"
    try:
        poll(f"{url}/health", 200)
        tokenize = {"model": "llama", "messages": [{"role": "user", "content": "x"}]}
        ids = httpx.post(f"{url}/tokenize", json=tokenize).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"].endswith("[hello]")
        ids = httpx.post(f"{url}/tokenize", json={**tokenize, "chat_template_kwargs": {"greeting": "bye"}}).json()
        assert httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"].endswith("[bye]")
        body = {"model": "llama", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        info = httpx.get(f"{url}/get_server_info").json()
    finally:
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert (info["scheduler"]["max_queue"], info["cache"]["kv_cache_memory_gib"]) == (7, 16 / 1024)
    [line] = [line for line in log.splitlines() if f"{answer['id']} /v1/completions" in line]
    assert line.endswith(f"output={answer['choices'][0]['text']!r}"), line
    assert '"POST /v1/completions HTTP/1.1" 200' in log and '"GET /health HTTP/1.1"' not in log
    assert "GET /v1/models" not in log and '"POST /tokenize HTTP/1.1" 200' in log


class SpanCollector:
    """An OTLP trace collector on a free loopback port, over gRPC or HTTP: the spans it received."""

    def __init__(self, protocol: str) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.requests: list = []
        if protocol == "grpc":
            from concurrent import futures

            import grpc
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

            requests = self.requests

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):
                    requests.append(request)
                    return trace_service_pb2.ExportTraceServiceResponse()

            self._grpc = grpc.server(futures.ThreadPoolExecutor(2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
            self.endpoint = f"http://127.0.0.1:{self._grpc.add_insecure_port('127.0.0.1:0')}"
            self._grpc.start()
            self.close = lambda: self._grpc.stop(0)
        else:
            import http.server
            import threading

            requests = self.requests

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_POST(self):
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                    requests.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.end_headers()
                    self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

                def log_message(self, *args):
                    pass

            self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=self._http.serve_forever, daemon=True).start()
            self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"
            self.close = self._http.shutdown

    def spans(self) -> list:
        return [
            span
            for request in list(self.requests)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_span_per_request_goes_to_the_otlp_collector_in_the_callers_trace(tiny_model, protocol):
    """--otlp-traces-endpoint (vLLM's): an llm_request span per finished prompt, a child of the
    span its HTTP request's traceparent names, with vLLM's gen_ai.* attributes."""
    collector = SpanCollector(protocol)
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    flags = ("--kv-cache-memory", "0.01", "--otlp-traces-endpoint", collector.endpoint)
    process = start(port, tiny_model, *flags, env=env)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        poll(f"http://127.0.0.1:{port}/health", 200)
        body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0.5, "top_p": 0.9}
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 30
        while not collector.spans() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=EXIT_TIMEOUT_S)
        collector.close()
    [span] = collector.spans()
    assert (span.name, span.kind) == ("llm_request", 2)  # SPAN_KIND_SERVER
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (trace_id, parent_id)
    value = {a.key: a.value for a in span.attributes}
    assert value["gen_ai.request.id"].string_value == answer.json()["id"]
    assert value["gen_ai.response.model"].string_value == "llama"
    counts = {key: value[f"gen_ai.{key}"].int_value for key in ("usage.completion_tokens", "request.max_tokens")}
    assert counts == {"usage.completion_tokens": 3, "request.max_tokens": 3}
    assert value["gen_ai.request.n"].int_value == 1
    assert value["gen_ai.usage.prompt_tokens"].int_value == answer.json()["usage"]["prompt_tokens"]
    assert value["gen_ai.request.temperature"].double_value == 0.5
    e2e = value["gen_ai.latency.e2e"].double_value
    assert 0 < value["gen_ai.latency.time_to_first_token"].double_value <= e2e
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-3


def test_an_otlp_protocol_it_cannot_send_ends_the_process_with_one_line_and_exit_1(tiny_model):
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
    process = start(free_port(), tiny_model, "--otlp-traces-endpoint", "http://127.0.0.1:4317", env=env)
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    assert stderr.strip().splitlines() == [
        "pagoda serve: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json': OTLP traces go over grpc or http/protobuf"
    ]


def test_a_load_failure_ends_the_process_with_one_line_and_exit_1(tiny_model):
    port = free_port()
    process = start(port, tiny_model, "--kv-cache-memory", "0.000001")
    answers = poll(f"http://127.0.0.1:{port}/health", 503)
    assert_loading_503(answers[-1])
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert "cannot hold one sequence of max_model_len" in line
    assert "Traceback" not in log


def test_device_cuda_without_a_gpu_fails_with_one_line_and_exit_1(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    process = start(free_port(), tiny_model, "--device", "cuda")
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert line.startswith("pagoda serve: --device cuda cannot be used: ")
    assert "Traceback" not in log


def test_deterministic_refused_in_bfloat16_with_one_line_and_exit_1(tiny_model):
    process = start(free_port(), tiny_model, "--deterministic", "--dtype", "bfloat16")
    _, log = process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 1
    [line] = [line for line in log.splitlines() if line.startswith("pagoda serve:")]
    assert line.startswith("pagoda serve: --deterministic cannot hold here: ") and "float32 only" in line
    assert "Traceback" not in log


def test_sigterm_while_loading_exits_promptly(tiny_model):
    port = free_port()
    process = start(port, tiny_model)
    poll(f"http://127.0.0.1:{port}/health", 503)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=EXIT_TIMEOUT_S)
    assert process.returncode == 0
