"""`pagoda bakeoff`: two stub engines and a missing one, the report folder, config errors."""

from __future__ import annotations

import json
import shlex
import struct
from pathlib import Path

import pytest
from bench_helpers import read_results, stub_command

from pagoda.bench import bakeoff
from tests.server.helpers import free_port

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def engine_table(name: str, port: int, *stub_args: str) -> str:
    command = shlex.join(stub_command(*stub_args, port=port))
    return f'[[engine]]\nname = "{name}"\ncommand = {json.dumps(command)}\nbase_url = "http://127.0.0.1:{port}"\n'


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bakeoff_of_two_engines_writes_every_report_file(tmp_path: Path, capsys) -> None:
    from matplotlib.image import imread

    config = tmp_path / "b.toml"
    config.write_text(
        '[workload]\ntokenizer = "default"\ninput_len = 12\noutput_len = 4\nnum_prompts = 4\n'
        "concurrency = [1, 2]\nwarmup = 1\nseed = 3\n\n"
        + engine_table("fast", free_port(), "--ttft", "0.02", "--itl", "0.002")
        + engine_table("slow", free_port(), "--ttft", "0.3", "--itl", "0.002")
        + '[[engine]]\nname = "ghost"\ncommand = "no-such-engine-xyz serve"\nbase_url = "http://127.0.0.1:9"\n'
    )
    out = tmp_path / "report"
    assert bakeoff.main([str(config), "--output", str(out), "--no-progress"]) == 1  # the ghost failed
    printed = capsys.readouterr().out

    results = read_results(out)
    fast, slow, ghost = results["engines"]
    assert [fast["status"], slow["status"], ghost["status"]] == ["ok", "ok", "failed"]
    assert "command not found: no-such-engine-xyz" in ghost["error"]
    for engine in (fast, slow):
        assert [level["concurrency"] for level in engine["levels"]] == [1, 2]
        assert engine["cold_start"]["ready_s"] > 0 and engine["memory"]["rss_mib"] > 0
    # The same seeded prompts went to both engines (the stub counts a prompt's words).
    prompts = [[r["prompt_tokens"] for lv in e["levels"] for r in lv["records"]] for e in (fast, slow)]
    assert prompts[0] == prompts[1] and len(prompts[0]) == 8
    ttft = [e["levels"][0]["summary"]["ttft"]["median"] for e in (fast, slow)]
    assert ttft[0] < ttft[1] and ttft[1] >= 0.3 - 0.002

    csv_rows = (out / "results.csv").read_text().splitlines()
    assert [row.split(",")[:2] for row in csv_rows[1:]] == [["fast", "1"], ["fast", "2"], ["slow", "1"], ["slow", "2"]]
    report = (out / "report.md").read_text()
    # One metrics-by-level table per engine that measured something, then the engines side by side.
    assert report.count("| metric | c=1 | c=2 |") == 2 and "## Results: ghost" not in report
    side_by_side = report[report.index("## Side by side") :]
    assert "| metric | concurrency | fast | slow | slow / fast |" in side_by_side
    ttft_row = next(
        line for line in side_by_side.splitlines() if line.startswith("| TTFT p50 (ms) (lower is better) | 1 |")
    )
    assert ttft_row.endswith("x worse |")  # slow's TTFT is higher: worse
    assert printed.index("side by side:") < printed.index("| metric | concurrency | fast | slow | slow / fast |")
    for text in (
        "## Results: fast",
        "| output tokens/s (higher is better) |",
        "## Cold start",
        "## Peak memory",
        "ghost",
        "command not found",
        "random: input 12 tokens",
        "![throughput_vs_concurrency.png]",
        "![ttft_vs_concurrency.png]",
    ):
        assert text in report
    for name in ("throughput_vs_concurrency.png", "ttft_vs_concurrency.png"):
        width, height = png_size(out / name)
        assert width > 100 and height > 100
        pixels = imread(out / name)
        assert pixels.std() > 0.01  # drawn, not blank
    assert (out / "logs" / "fast.log").exists() and (out / "logs" / "slow.log").exists()
    # No machine's paths: the report folder is ".", other folders are left out.
    assert str(tmp_path) not in report + (out / "results.json").read_text()
    assert "`pagoda bakeoff .../b.toml --output . --no-progress`" in report


@pytest.mark.parametrize(
    "text, message",
    [
        ("[workload\n", "not valid TOML"),
        ("[workload]\n", "list the engines as [[engine]] tables"),
        ('[[engine]]\nname = "a"\ncommand = "x"\n', "engine 1 ('a'): missing 'base_url'"),
        ('[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\nport = 3\n', "unknown keys ['port']"),
        (
            '[workload]\nbase_url = "http://h:1"\n[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n',
            "[workload] cannot set ['base_url']",
        ),
        (
            '[workload]\nconcurrency = "many"\n[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n',
            "[workload]: --concurrency wants integers",
        ),
        (
            '[workload]\nfrobnicate = 1\n[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n',
            "unrecognized arguments: --frobnicate=1",
        ),
        (
            '[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n[[engine]]\nname = "a"\ncommand = "y"\n'
            'base_url = "http://h:2"\n',
            "engine names must differ",
        ),
        ('[[engine]]\nname = "a"\ncommand = "x \'open"\nbase_url = "http://h:1"\n', "cannot parse launch command"),
        ('[[engine]]\nname = "a"\ncommand = 5\nbase_url = "http://h:1"\n', "command must be a string or a list"),
        ("\x00\udcff\n", "not valid TOML"),  # bytes 0x00 0xff: not UTF-8
        (
            'rounds = 0\n[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n',
            "rounds must be an integer >= 1",
        ),
        (
            '[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\nrounds = "two"\n',
            "engine 1 ('a'): rounds must be an integer >= 1, got 'two'",
        ),
    ],
)
def test_bad_configs_stop_before_anything_runs(tmp_path: Path, capsys, text: str, message: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert bakeoff.main([str(config), "--output", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_rounds_run_the_engine_list_in_turn(tmp_path: Path) -> None:
    """rounds repeats the whole list, interleaved, each engine-round named NAME-rR with its own
    server log; an engine's own rounds keeps it to the first ones; --rounds overrides the config."""
    config = tmp_path / "r.toml"
    engines = '[[engine]]\nname = "a"\ncommand = "x"\nbase_url = "http://h:1"\n'
    engines += '[[engine]]\nname = "b c"\ncommand = "y"\nbase_url = "http://h:2"\nrounds = 1\n'
    engines += '[[engine]]\nname = "d"\ncommand = "z"\nbase_url = "http://h:3"\n'
    config.write_text("rounds = 3\n" + engines)
    loaded = bakeoff.load_config(config, tmp_path / "out")
    assert [e.name for e in loaded.engines] == ["a-r1", "b c-r1", "d-r1", "a-r2", "d-r2", "a-r3", "d-r3"]
    assert [e.settings.base_url for e in loaded.engines[:3]] == ["http://h:1", "http://h:2", "http://h:3"]
    assert [e.settings.launch.log_path.name for e in loaded.engines[:2]] == ["a-r1.log", "b_c-r1.log"]
    assert [e.name for e in bakeoff.load_config(config, tmp_path / "out", rounds=1).engines] == ["a", "b c", "d"]
    assert len(bakeoff.load_config(config, tmp_path / "out", rounds=2).engines) == 5


def test_missing_config_file(tmp_path: Path, capsys) -> None:
    assert bakeoff.main([str(tmp_path / "none.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].joinpath("examples").glob("bakeoff-*.toml")))
def test_example_configs_parse(path: Path, tmp_path: Path) -> None:
    config = bakeoff.load_config(path, tmp_path)
    assert len(config.engines) >= 2
    assert all(engine.settings.launch for engine in config.engines)
