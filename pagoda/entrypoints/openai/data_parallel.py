"""`pagoda serve --data-parallel-size N`: N engine replicas on one machine behind SGLang Model
Gateway (`smg`, installed with `pip install 'pagoda[scale]'`), on the one port the user named.

Each replica is a `pagoda serve` child on a free loopback port with its share of the CPU threads
(and of --bind-cores); the gateway is a child too and routes with --router-policy (cache_aware by
default: requests sharing a prefix go to the replica that holds it). The launcher reports ready
once every replica answers /health and the gateway serves /v1/models.

Lifetime: SIGTERM or Ctrl-C stops the gateway first and alone: it takes no new requests and lets
those in flight finish (for up to --shutdown-timeout seconds) while the replicas still serve
them; once it has exited, the replicas stop. A replica that dies is logged
and the gateway routes around it; the launcher exits 1 when the gateway or the last replica dies.
Each child gets SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import httpx

from pagoda.engine.args import EngineArgs, option
from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda.serve")

GATEWAY_POLICIES = ["cache_aware", "round_robin", "power_of_two", "least_load", "random", "prefix_hash"]
POLL_S = 0.25
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0  # beyond --shutdown-timeout, before a child is killed
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class ScaleArgs:
    """The flags of `pagoda serve` that start several replicas behind a gateway."""

    data_parallel_size: int = option(
        1, "engine replicas behind SGLang Model Gateway on --port (needs `pip install 'pagoda[scale]'`)"
    )
    router_policy: str = option(
        "cache_aware", "the gateway's routing policy for --data-parallel-size > 1", choices=GATEWAY_POLICIES
    )
    gateway_args: str | None = option(
        None,
        'more flags for `smg launch`, one string, e.g. "--cache-threshold 0.5" (see `smg launch --help`)',
        default_text="none",
    )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ScaleArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    url: str


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the replicas and the gateway, wait until they serve, then supervise them; the exit code."""
    scale = ScaleArgs.from_cli_args(args)
    if importlib.util.find_spec("smg") is None:
        raise ConfigError(
            "--data-parallel-size needs SGLang Model Gateway: pip install 'pagoda[scale]' (the `smg` package)"
        )
    shares = thread_shares(args, scale.data_parallel_size)
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: stopping.append(signum)) for sig in STOP_SIGNALS}
    gateway: list[Child] = []  # stopped first, then the replicas
    replicas: list[Child] = []
    try:
        for rank, share in enumerate(shares):
            replicas.append(_start_replica(rank, argv, share, args.request_log))
            logger.info("replica %d: pid %d at %s", rank, replicas[-1].process.pid, replicas[-1].url)
        if not _wait_all(replicas, lambda child: _status(child.url + "/health") == 200, stopping):
            return 0 if stopping else 1
        gateway.append(_start_gateway(args, scale, [c.url for c in replicas]))
        if not _wait_all(gateway, lambda child: _healthy_workers(child) == len(replicas), stopping):
            return 0 if stopping else 1
        logger.info(
            "ready: serving at %s with %d replicas behind SGLang Model Gateway (policy %s)",
            gateway[0].url,
            len(replicas),
            scale.router_policy,
        )
        return _supervise(gateway[0], replicas, stopping)
    finally:
        _stop(gateway, args.shutdown_timeout)
        _stop(replicas, args.shutdown_timeout)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def thread_shares(args: argparse.Namespace, replicas: int) -> list[list[str]]:
    """Each replica's thread flags: --bind-cores split into N consecutive runs of CPUs, else the
    engine's thread count (--threads, $PAGODA_NUM_THREADS, $OMP_NUM_THREADS, or every CPU this
    process may use) divided by N, at least one each."""
    threads = EngineArgs.from_cli_args(args).thread_config()  # validated as one engine's would be
    if threads.bind_cores:
        cores = threads.bind_cores
        if len(cores) < replicas:
            raise ConfigError(f"--bind-cores {args.bind_cores} names {len(cores)} CPUs for {replicas} replicas")
        per = len(cores) // replicas
        runs = [cores[i * per : (i + 1) * per] for i in range(replicas)]
        return [["--bind-cores", ",".join(map(str, run)), "--threads", str(len(run))] for run in runs]
    total = threads.num_threads or len(os.sched_getaffinity(0))
    return [["--threads", str(max(1, total // replicas))] for _ in range(replicas)]


def _start_replica(rank: int, argv: list[str], threads: list[str], request_log: Path | None) -> Child:
    port = free_port()
    # The user's command line, then what differs per replica: argparse keeps a flag's last value.
    overrides = ["--data-parallel-size", "1", "--host", "127.0.0.1", "--port", str(port), *threads]
    if request_log is not None:
        overrides += ["--request-log", str(replica_log(request_log, rank))]
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *argv, *overrides]
    return Child(f"replica {rank}", _spawn(command), f"http://127.0.0.1:{port}")


def replica_log(request_log: Path, rank: int) -> Path:
    """Replica `rank`'s request log: requests.jsonl -> requests.0.jsonl."""
    return request_log.with_name(f"{request_log.stem}.{rank}{request_log.suffix}")


def _start_gateway(args: argparse.Namespace, scale: ScaleArgs, worker_urls: list[str]) -> Child:
    metrics_port = free_port()
    command = [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        scale.router_policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "debug" if args.log_level == "debug" else "warn",  # its info lines are per request
        "--shutdown-grace-period-secs",  # its drain of requests in flight at SIGTERM
        str(math.ceil(args.shutdown_timeout)),
        *(scale.gateway_args or "").split(),
    ]
    from pagoda.entrypoints.openai.serve import api_keys  # serve imports this module

    keys = api_keys(args)  # one at most: parse_args refuses several with --data-parallel-size
    if keys:
        command += ["--api-key", keys[0]]
    host = f"[{args.host}]" if ":" in args.host else args.host
    gateway = Child("the gateway", _spawn(command), f"http://{host}:{args.port}")
    logger.info("the gateway: pid %d, its metrics at http://127.0.0.1:%d/metrics", gateway.process.pid, metrics_port)
    return gateway


def _spawn(command: list[str]) -> subprocess.Popen:
    """A child in its own process group (the launcher forwards signals in order) that gets
    SIGTERM when the launcher dies."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_all(children: list[Child], ready: Callable[[Child], bool], stopping: list[int]) -> bool:
    """True once every child is `ready`; False when one exits or a signal comes first."""
    pending = list(children)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while pending:
        if stopping:
            return False
        for child in pending:
            if child.process.poll() is not None:
                logger.error("%s exited with code %d while starting", child.name, child.process.returncode)
                return False
        pending = [c for c in pending if not ready(c)]
        if pending and time.monotonic() > deadline:
            logger.error("%s was not ready within %.0f s", pending[0].name, STARTUP_TIMEOUT_S)
            return False
        time.sleep(POLL_S)
    return True


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _healthy_workers(gateway: Child) -> int:
    """The replicas the gateway has registered and found healthy (its /readiness)."""
    try:
        return int(httpx.get(gateway.url + "/readiness", timeout=2).json().get("healthy_workers", 0))
    except (httpx.HTTPError, ValueError, AttributeError):
        return 0


def _supervise(gateway: Child, replicas: list[Child], stopping: list[int]) -> int:
    """Wait for a signal (exit 0) or the gateway's or the last replica's death (exit 1)."""
    alive = list(replicas)
    while not stopping:
        if gateway.process.poll() is not None:
            logger.error("the gateway exited with code %d; stopping the replicas", gateway.process.returncode)
            return 1
        for child in [c for c in alive if c.process.poll() is not None]:
            alive.remove(child)
            logger.error(
                "%s exited with code %d; the gateway routes around it (%d replicas left)",
                child.name,
                child.process.returncode,
                len(alive),
            )
        if not alive:
            return 1
        time.sleep(POLL_S)
    return 0


def _stop(children: list[Child], grace_s: float) -> None:
    """SIGTERM each child, then wait for all; SIGKILL any still running `grace_s + STOP_TIMEOUT_S`
    later."""
    for child in children:
        _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + STOP_TIMEOUT_S
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", child.name)
            _signal(child, signal.SIGKILL)
            child.process.wait()


def _signal(child: Child, sig: int) -> None:
    if child.process.poll() is None:
        try:
            os.killpg(child.process.pid, sig)
        except ProcessLookupError:
            pass


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
