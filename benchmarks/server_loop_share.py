"""Why the server runs the engine on a thread (not a process): how much of a step the event loop
takes while it streams, and whether torch lets Python run beside its ops (it releases the GIL).

    python benchmarks/server_loop_share.py [--concurrency 32] [--max-tokens 32]

1. GIL: the longest the main thread stalls while a thread runs a long torch op, against a long
   C call that holds the GIL (sorting a big list).
2. The real server in this process (uvicorn on the main thread's event loop, the engine on its
   own thread) while a client in another process streams C completions. CPU time is read per
   thread: the event loop's (HTTP, detokenizing, SSE) against the engine thread's, per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

CLIENT = r"""
import asyncio, json, sys, httpx
base, concurrency, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def one(http, i):
    body = {"prompt": f"Request {i}: write a story about the number {i}.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass
async def main():
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        await asyncio.gather(*(one(http, i) for i in range(concurrency)))
asyncio.run(main())
"""


def gil_check(seconds: float = 3.0) -> dict[str, dict[str, float]]:
    """The longest the main thread is stopped while another thread runs one long call, as ms:
    a torch matmul (does torch release the GIL inside ops?) against a sort of a big list (a C
    call that holds the GIL throughout: the main thread waits for all of it). Pauses of a few
    ms come from the OS scheduler on a busy machine; a held GIL shows as a pause as long as the
    call itself."""
    import torch

    a = torch.randn(2048, 2048)
    numbers = [float(i % 7919) for i in range(3_000_000)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core for the worker, one for the main thread
    result = {"torch_matmul": _pauses(lambda: a @ a, seconds), "list_sort": _pauses(lambda: sorted(numbers), seconds)}
    torch.set_num_threads(threads)
    return result


def _pauses(call, seconds: float) -> dict[str, float]:
    done = threading.Event()
    durations: list[float] = []

    def work() -> None:
        while not done.is_set():
            start = time.perf_counter()
            call()
            durations.append(time.perf_counter() - start)

    worker = threading.Thread(target=work)
    worker.start()
    gaps, last, end = [], time.perf_counter(), time.perf_counter() + seconds
    while last < end:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    done.set()
    worker.join()
    return {"call_ms": round(1000 * statistics.median(durations), 1), "longest_pause_ms": round(1000 * max(gaps), 1)}


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def measure(concurrency: int, max_tokens: int, port: int) -> dict:
    import uvicorn

    from pagoda.engine.args import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.openai.api import build_app
    from pagoda.entrypoints.openai.serving import ServerConfig

    engine = AsyncEngine(EngineArgs(kv_cache_memory=0.5, max_model_len=2048))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ServerConfig()), port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    lags: list[float] = []
    worst: list[tuple[float, float, int]] = []  # (lag, seconds into the run, engine steps then)

    async def ticker() -> None:  # how late the loop wakes up for a 10 ms timer
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - start - 0.01)
            worst.append((lags[-1], time.perf_counter() - wall0, engine.stats.num_steps - steps0))
            worst.sort(reverse=True)
            del worst[3:]

    loop0, engine0, process0 = time.thread_time(), thread_cpu(engine._thread), time.process_time()
    wall0, steps0 = time.perf_counter(), engine.stats.num_steps
    tick = asyncio.create_task(ticker())
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(concurrency), str(max_tokens)
    )
    await client.wait()
    wall, steps = time.perf_counter() - wall0, engine.stats.num_steps - steps0
    loop_cpu, engine_cpu = time.thread_time() - loop0, thread_cpu(engine._thread) - engine0
    process_cpu = time.process_time() - process0
    tick.cancel()
    server.should_exit = True
    await serving
    return {
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 2),
        "steps": steps,
        "step_ms": round(1000 * wall / steps, 1),
        "loop_cpu_ms_per_step": round(1000 * loop_cpu / steps, 2),
        "engine_thread_cpu_ms_per_step": round(1000 * engine_cpu / steps, 2),
        "process_cpu_ms_per_step": round(1000 * process_cpu / steps, 2),
        "loop_share_of_step": round(loop_cpu / wall, 3),
        "loop_lag_p50_ms": round(1000 * statistics.median(lags), 2),
        "loop_lag_p99_ms": round(1000 * statistics.quantiles(lags, n=100)[98], 2),
        "loop_lag_worst": [(round(1000 * lag, 1), round(at, 1), step) for lag, at, step in worst],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=18321)
    args = p.parse_args()
    print(json.dumps({"main_thread_pauses_beside": gil_check()}))
    print(json.dumps(asyncio.run(measure(args.concurrency, args.max_tokens, args.port))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
