"""What `pagoda bench`'s streaming client loses to its own per-chunk cost, beside vLLM's client.

    python benchmarks/bench_client_overhead.py                    # concurrency 64 and 128, 3 rounds
    python benchmarks/bench_client_overhead.py --rounds 1 --concurrency 64 --requests-per-slot 2   # quick
    python benchmarks/bench_client_overhead.py --pagoda before=/tmp/pagoda-before --pagoda after=.
    python benchmarks/bench_client_overhead.py --cpu              # client CPU per chunk, in-process

Starts a fake OpenAI-compatible server in its own process (plain asyncio, HTTP/1.1 keep-alive,
chunked SSE; `--serve` runs it alone): every streamed completion sends its `max_tokens` text
chunks `--itl` seconds apart (the first at once, each at its scheduled time, late ones sent at
once to catch up), then a finish_reason chunk, the usage chunk and `data: [DONE]`; one chunk per
TCP write (TCP_NODELAY), so a client reads about one chunk per receive, as from a GPU server.
With every slot busy the server streams concurrency / itl chunks a second; a request lasts
(tokens - 1) * itl, so the true output rate a client could read is at most
concurrency * tokens / ((tokens - 1) * itl) (`ideal_tok_s`); what a client measures below that
is its turnaround between requests plus the time its own CPU work delays its reads.

Then, for each round and concurrency, runs `pagoda bench` (each `--pagoda LABEL=TREE`, by default
this checkout) and `vllm bench serve` (`--vllm`) against it one after another, on the same
workload (random, 32 tokens in, `--tokens` out, ignore_eos, `--requests-per-slot` * concurrency
requests, seed 0), the clients' order rotated each round so that a machine getting busier or
quieter favours none. Prints a JSON line per run (output tok/s, its shortfall against the ideal)
and one per concurrency (mean tok/s per client, each Pagoda's ratio to vLLM's, per round and of
the means). On a machine whose cores the server and the clients share, only same-run ratios count.

`--cpu` measures instead the CPU seconds each client spends per chunk (time.process_time over
the streams, in a process of its own running only that client against the same server):
Pagoda's `stream_request` from each tree, and vLLM's request function from its venv.

Every process started here is stopped at the end (the server's whole process group).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = Path("/root/.cache/pagoda-peers/vllm-venv/bin/vllm")
TOKENIZER = Path("/root/.cache/pagoda-peers/models/smollm2-135m-instruct")
MODEL = "bench-model"
PORTS = range(18900, 19000)
INPUT_LEN = 32


# --- the fake server -------------------------------------------------------------------------


def _frame(payload: bytes) -> bytes:
    """One chunk of a chunked HTTP/1.1 body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(chunk: dict) -> bytes:
    return _frame(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


def _chunks(chat: bool) -> tuple[bytes, bytes, bytes]:
    """The opening frame (chat's role chunk; empty for completions), a token frame and the
    finish frame, as vLLM's server words them."""
    head = {"id": "cmpl-bench", "created": 1700000000, "model": MODEL}
    if chat:
        head["object"] = "chat.completion.chunk"

        def choice(delta: dict, finish: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        role = _event(choice({"role": "assistant", "content": ""}, None))
        return role, _event(choice({"content": " tok"}, None)), _event(choice({}, "length"))
    head["object"] = "text_completion"

    def text(piece: str, finish: str | None) -> dict:
        fields = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return {**head, "choices": [fields]}

    return b"", _event(text(" tok", None)), _event(text("", "length"))


CHUNKS = {"/v1/completions": _chunks(False), "/v1/chat/completions": _chunks(True)}
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _whole(status: str, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


class _Connection(asyncio.Protocol):
    """One keep-alive connection: requests in turn (no pipelining), each streamed on a schedule."""

    def __init__(self, itl: float) -> None:
        self.itl = itl
        self.buffer = b""
        self.streaming = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next_request()

    def _next_request(self) -> None:
        while not self.streaming:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buffer[:end].decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
            self._answer(method, path.split("?")[0], body)

    def _answer(self, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path == "/v1/models":
            self.transport.write(_whole("200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif method == "POST" and path in CHUNKS:
            request = json.loads(body)
            if not request.get("stream"):
                self.transport.write(_whole("400 Bad Request", {"error": {"message": "only streaming here"}}))
                return
            tokens = int(request.get("max_tokens") or 16)
            usage = (request.get("stream_options") or {}).get("include_usage")
            self._stream(CHUNKS[path], tokens, INPUT_LEN if usage else None)
        else:
            self.transport.write(_whole("404 Not Found", {"error": {"message": f"no {method} {path}"}}))

    def _stream(self, chunks: tuple[bytes, bytes, bytes], tokens: int, prompt_tokens: int | None) -> None:
        opening, token, finish = chunks
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.streaming = True
        self.transport.write(STREAM_HEAD + opening)
        sent = 0

        def tick() -> None:
            nonlocal sent
            if self.transport.is_closing():
                return
            self.transport.write(token)
            sent += 1
            if sent < tokens:
                self.timer = loop.call_at(start + sent * self.itl, tick)
                return
            self.timer = None
            ending = [finish]
            if prompt_tokens is not None:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}
                ending.append(_event({"id": "cmpl-bench", "choices": [], "usage": usage}))
            ending += [_frame(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
            self.transport.write(b"".join(ending))
            self.streaming = False
            self._next_request()

        tick()


def serve(port: int, itl: float) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(itl), "127.0.0.1", port, backlog=1024)
        print(f"listening on {port}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def free_port() -> int:
    for port in PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise SystemExit(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def start_server(port: int, itl: float) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--port", str(port), "--itl", str(itl)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = server.stdout.readline() if server.stdout else ""
    if not line.startswith("listening"):
        stop(server)
        raise SystemExit(f"the fake server did not start: {line!r}")
    return server


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# --- the clients, end to end -----------------------------------------------------------------


def run_pagoda(tree: Path, url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    command = [
        sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "--base-url", url, "--model", MODEL,
        "--tokenizer", str(TOKENIZER), "--endpoint", "completions", "--workload", "random",
        "--input-len", str(INPUT_LEN), "--output-len", str(args.tokens), "--ignore-eos",
        "--num-prompts", str(args.requests_per_slot * concurrency), "--concurrency", str(concurrency),
        "--seed", "0", "--warmup", "1", "--no-progress", "--output", str(out),
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "results.json").read_text())["engines"][0]["levels"][0]["summary"]
    return {"output_tok_s": summary["output_throughput"], "duration_s": summary["duration_s"],
            "failed": summary["failed"]}  # fmt: skip


def run_vllm(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    command = [
        str(args.vllm), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL, "--tokenizer", str(TOKENIZER), "--dataset-name", "random",
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(args.tokens), "--ignore-eos",
        "--num-prompts", str(args.requests_per_slot * concurrency), "--max-concurrency", str(concurrency),
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out), "--result-filename", "vllm.json",
    ]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads((out / "vllm.json").read_text())
    return {"output_tok_s": result["output_throughput"], "duration_s": result["duration"],
            "failed": result["num_prompts"] - result["completed"]}  # fmt: skip


def end_to_end(url: str, clients: list[str], args: argparse.Namespace) -> None:
    trees = dict(args.pagoda)
    by_level: dict[int, dict[str, list[float]]] = {c: {name: [] for name in clients} for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="bench_client_overhead-") as scratch:
        for round_ in range(args.rounds):
            order = clients[round_ % len(clients) :] + clients[: round_ % len(clients)]
            for concurrency in args.concurrency:
                ideal = concurrency * args.tokens / ((args.tokens - 1) * args.itl)
                for name in order:
                    out = Path(scratch) / f"{round_}-{concurrency}-{name}"
                    out.mkdir()
                    if name == "vllm":
                        figures = run_vllm(url, concurrency, args, out)
                    else:
                        figures = run_pagoda(trees[name], url, concurrency, args, out)
                    by_level[concurrency][name].append(figures["output_tok_s"])
                    shortfall = 1 - figures["output_tok_s"] / ideal
                    line = {"round": round_ + 1, "concurrency": concurrency, "client": name, **figures,
                            "ideal_tok_s": round(ideal, 1), "shortfall": round(shortfall, 4)}  # fmt: skip
                    print(json.dumps(line), flush=True)
    for concurrency, runs in by_level.items():
        summary: dict = {"concurrency": concurrency, "rounds": args.rounds, "tokens": args.tokens, "itl": args.itl}
        summary["mean_tok_s"] = {name: round(statistics.mean(values), 1) for name, values in runs.items()}
        if "vllm" in runs:
            for name in trees:
                summary[f"{name}_vs_vllm"] = {
                    "per_round": [round(p / v, 3) for p, v in zip(runs[name], runs["vllm"])],
                    "ratio_of_means": round(statistics.mean(runs[name]) / statistics.mean(runs["vllm"]), 3),
                }
        print(json.dumps(summary), flush=True)


# --- the clients' CPU per chunk --------------------------------------------------------------

# Each runs in a process of its own: `concurrency` streams at a time until `requests` are done,
# then prints {"cpu_s", "wall_s", "chunks"} (chunks: the text chunks, requests * tokens, as both
# clients count the closing chunks differently); the import and the first request are not counted.
# The timed loop both clients' scripts share: `concurrency` workers take the `requests` one at a time, each
# awaiting ONE_REQUEST (an expression that fails loudly when the request did) inside `async with SESSION as http`.
CPU_LOOP = """
url, concurrency, requests, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
async def main():
    SETUP
    async with SESSION as http:
        await ONE_REQUEST
        left, chunks = [requests], [0]
        async def worker():
            while left[0] > 0:
                left[0] -= 1
                await ONE_REQUEST
                chunks[0] += tokens
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                          "chunks": chunks[0]}))
asyncio.run(main())
"""


def cpu_script(imports: str, setup: str, session: str, one_request: str) -> str:
    return imports + CPU_LOOP.replace("SETUP", setup).replace("SESSION", session).replace("ONE_REQUEST", one_request)


PAGODA_CPU = cpu_script(
    "import asyncio, json, sys, time\n"
    "from pagoda.bench.client import Target, make_client, stream_request\n"
    "from pagoda.bench.datasets import Prompt\n"
    "async def one(http, target, prompt):\n"
    "    result = await stream_request(http, target, prompt)\n"
    "    assert result.error is None, result.error\n",
    'target, prompt = Target(url, "bench-model", ignore_eos=True), Prompt("completions", {"prompt": "hi", '
    '"max_tokens": tokens})',
    "make_client(concurrency, 600.0)",
    "one(http, target, prompt)",
)

VLLM_CPU = cpu_script(
    "import asyncio, json, sys, time\n"
    "import aiohttp\n"
    "from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions\n"
    "async def one(http, request):\n"
    "    output = await async_request_openai_completions(request, http)\n"
    "    assert output.success, output.error\n",
    'request = RequestFuncInput(prompt="hi", api_url=url + "/v1/completions", prompt_len=1, output_len=tokens, '
    'model="bench-model", ignore_eos=True)',
    "aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, "
    "keepalive_timeout=60), trust_env=True, timeout=aiohttp.ClientTimeout(total=6 * 3600))",
    "one(http, request)",
)


def client_cpu(url: str, clients: list[str], args: argparse.Namespace) -> None:
    trees = dict(args.pagoda)
    for round_ in range(args.rounds):
        order = clients[round_ % len(clients) :] + clients[: round_ % len(clients)]
        for concurrency in args.concurrency:
            for name in order:
                numbers = [url, str(concurrency), str(args.requests_per_slot * concurrency), str(args.tokens)]
                if name == "vllm":
                    python = args.vllm.parent / "python"
                    command, env, cwd = [str(python), "-c", VLLM_CPU, *numbers], dict(os.environ), None
                else:
                    command = [sys.executable, "-c", PAGODA_CPU, *numbers]
                    env, cwd = os.environ | {"PYTHONPATH": str(trees[name])}, trees[name]
                done = subprocess.run(command, env=env, cwd=cwd, check=True, capture_output=True, text=True)
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                line = {"round": round_ + 1, "concurrency": concurrency, "client": name,
                        "cpu_us_per_chunk": round(1e6 * figures["cpu_s"] / figures["chunks"], 1),
                        "chunks_per_s": round(figures["chunks"] / figures["wall_s"], 1),
                        "ideal_chunks_per_s": round(concurrency / args.itl, 1), **figures}  # fmt: skip
                print(json.dumps(line), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help="run only the fake server (on --port)")
    p.add_argument("--port", type=int, default=None, help=f"default: the first free in {PORTS.start}-{PORTS.stop - 1}")
    p.add_argument("--itl", type=float, default=0.01, help="seconds between a stream's chunks (default 0.01)")
    p.add_argument("--tokens", type=int, default=200, help="output chunks per request (default 200)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 128])
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests per run = this * concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--pagoda",
        action="append",
        type=lambda text: (text.split("=", 1)[0], Path(text.split("=", 1)[1]).resolve()),
        help="LABEL=TREE: a checkout of Pagoda whose client to run (repeatable; default pagoda=this checkout)",
    )
    p.add_argument("--vllm", type=Path, default=VLLM, help="vLLM's CLI, or 'none' to leave it out")
    p.add_argument("--cpu", action="store_true", help="client CPU per chunk, in-process, instead of `bench`")
    args = p.parse_args()
    args.pagoda = args.pagoda or [("pagoda", ROOT)]
    return args


def main() -> int:
    args = parse_args()
    if args.serve:
        serve(args.port or free_port(), args.itl)
        return 0
    clients = [name for name, _ in args.pagoda] + ([] if str(args.vllm) == "none" else ["vllm"])
    port = args.port or free_port()
    server = start_server(port, args.itl)
    try:
        context = {"cpu": os.cpu_count(), "load_average": os.getloadavg(), "clients": clients, "port": port}
        print(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **context}), flush=True)
        (client_cpu if args.cpu else end_to_end)(f"http://127.0.0.1:{port}", clients, args)
        print(json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()}))
    finally:
        stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
