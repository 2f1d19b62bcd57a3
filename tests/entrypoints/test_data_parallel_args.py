"""How `pagoda serve --data-parallel-size N` divides the CPU threads between its replicas (no
process is started here; tests/server/test_data_parallel.py runs the real deployment)."""

from __future__ import annotations

import os

import pytest

from pagoda.entrypoints.openai import serve
from pagoda.entrypoints.openai.data_parallel import replica_log, thread_shares
from pagoda.errors import ConfigError


def shares(*argv: str, replicas: int = 2) -> list[list[str]]:
    return thread_shares(serve.parse_args(list(argv)), replicas)


def test_threads_are_divided_between_the_replicas(monkeypatch):
    monkeypatch.delenv("PAGODA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert shares("--threads", "5") == [["--threads", "2"], ["--threads", "2"]]
    assert shares("--threads", "1") == [["--threads", "1"], ["--threads", "1"]]  # at least one each
    monkeypatch.setenv("PAGODA_NUM_THREADS", "8")
    assert shares(replicas=4) == [["--threads", "2"]] * 4


def test_bound_cores_are_split_into_runs():
    cpus = sorted(os.sched_getaffinity(0))[:4]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    half = len(cpus) // 2
    first, second = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half : 2 * half]))
    assert shares("--bind-cores", ",".join(map(str, cpus))) == [
        ["--bind-cores", first, "--threads", str(half)],
        ["--bind-cores", second, "--threads", str(half)],
    ]
    with pytest.raises(ConfigError, match="names 1 CPUs for 2 replicas"):
        shares("--bind-cores", str(cpus[0]))


def test_each_replica_logs_to_its_own_file(tmp_path):
    assert replica_log(tmp_path / "requests.jsonl", 1) == tmp_path / "requests.1.jsonl"


def test_the_size_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--data-parallel-size", "0"])
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err
