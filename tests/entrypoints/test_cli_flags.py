"""The flags of `pagoda serve` and `pagoda generate` against their docs: every engine option is a
flag of both (made from EngineArgs), and each docs table lists exactly a command's flags with the
defaults `--help` shows."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.engine.args import EngineArgs
from pagoda.entrypoints import generate
from pagoda.entrypoints.openai import serve

DOCS = Path(__file__).resolve().parents[2] / "docs"
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}
PARSERS = {"serve": serve.build_parser, "generate": generate.build_parser}


@dataclasses.dataclass(frozen=True)
class Documented:
    flags: frozenset[str]
    default: str


def table_after(doc: str, heading: str) -> list[list[str]]:
    """The cells of the first markdown table after `heading`, header and separator rows left out."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    after = text[text.index(heading) :]
    rows = re.search(r"^\|.*?(?=\n\n|\Z)", after, re.M | re.S).group(0).splitlines()
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def backticked(cell: str) -> frozenset[str]:
    return frozenset(re.findall(r"`([^`]+)`", cell))


def engine_table(doc: str, heading: str) -> dict[str, Documented]:
    """option name -> its flags and default, from a table with columns option | flag | default."""
    return {
        option.strip("`"): Documented(backticked(flags), default)
        for option, flags, default, *_ in table_after(doc, heading)
    }


def flag_table(doc: str, heading: str) -> dict[frozenset[str], str]:
    """flags -> default, from a table with columns flag | default."""
    return {backticked(flags): default for flags, default, *_ in table_after(doc, heading)}


def shown_default(action: argparse.Action) -> str:
    """What `--help` shows as the action's default: its help ends in "(default: ...)"."""
    match = re.fullmatch(r".* \(default: (.*)\)", action.help % vars(action), re.S)
    assert match, f"{action.dest}: its help does not end with its default"
    return match.group(1)


def actions(command: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in PARSERS[command]()._actions if a.dest != "help"}


@pytest.mark.parametrize("command", PARSERS)
def test_engine_options_table_lists_every_engine_flag_with_its_default(command):
    documented = engine_table("engine.md", "## Engine options")
    parsed = actions(command)
    assert set(documented) == ENGINE_FIELDS
    for name, doc in documented.items():
        action = parsed[name]
        if command == "serve" and name == "model":
            assert action.option_strings == []  # `pagoda serve MODEL`
        else:
            assert frozenset(action.option_strings) == doc.flags, name
        assert shown_default(action) == doc.default, name


def test_gpu_options_table_agrees_with_the_engine_flags():
    parsed = actions("generate")
    for name, doc in engine_table("gpu.md", "# Running on a GPU").items():
        assert frozenset(parsed[name].option_strings) == doc.flags, name
        assert shown_default(parsed[name]) == doc.default, name


@pytest.mark.parametrize(
    "command, doc, heading", [("serve", "server.md", "## Command"), ("generate", "engine.md", "## `pagoda generate`")]
)
def test_command_table_lists_the_commands_own_flags_with_their_defaults(command, doc, heading):
    own = [a for name, a in actions(command).items() if name not in ENGINE_FIELDS and a.option_strings]
    assert flag_table(doc, heading) == {frozenset(a.option_strings): shown_default(a) for a in own}


@pytest.mark.parametrize("command", PARSERS)
def test_help_imports_no_torch(command):
    code = (
        "import sys\nfrom pagoda.entrypoints.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "--max-num-seqs" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("command", PARSERS)
def test_no_flags_give_the_default_engine_args(command):
    assert EngineArgs.from_cli_args(PARSERS[command]().parse_args([])) == EngineArgs()


def test_flags_become_engine_args():
    argv = [
        "model-dir",
        "--port",
        "9000",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--max-queue",
        "3",
        "--kv-cache-memory",
        "0.5",
        "--attention-backend",
        "torch",
        "--quantization",
        "fp8",
    ]
    assert EngineArgs.from_cli_args(serve.build_parser().parse_args(argv)) == EngineArgs(
        model="model-dir",
        enable_prefix_caching=False,
        enforce_eager=True,
        max_queue=3,
        kv_cache_memory=0.5,
        attention_backend="torch",
        quantization="fp8",
    )
    args = generate.build_parser().parse_args(["hello", "--model", "model-dir", "--seed", "7", "--max-tokens", "5"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="model-dir", seed=7)


def test_a_choice_outside_the_list_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--attention-backend", "cuda"])
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_an_unknown_llm_keyword_is_a_type_error_naming_it():
    from pagoda import LLM

    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["m", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice"),
        (["m", "--enable-lora", "--served-model-name", "base", "--lora-modules", "base=/x"], "'base' is the served"),
        (["m", "--enable-lora", "--lora-modules", "a=/x", "--data-parallel-size", "2"], "routes only the base"),
        (["--enable-lora", "--lora-modules", "a=/x", "{dir}"], "looks like the MODEL: give it before --lora-modules"),
        (["m", "--enable-lora", "--lora-modules", '{"name": "a", "path": ""}'], "lora_path is empty"),
        (["m", "--enable-lora", "--lora-dtype", "bfloat16"], "adapters run in the model's dtype (give --dtype)"),
        (["m", "--enable-lora", "--lora-modules", "{adapter}"], "give NAME=PATH, e.g. ft={adapter}"),
    ],
)
def test_lora_flags_are_checked_before_the_load(argv, message, tmp_path, capsys):
    adapter = tmp_path / "ft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit):
        serve.parse_args([arg.replace("{dir}", str(tmp_path)).replace("{adapter}", str(adapter)) for arg in argv])
    assert message.replace("{adapter}", str(adapter)) in capsys.readouterr().err


def test_lora_modules_take_vllms_two_forms():
    args = serve.parse_args(
        [
            "m",
            "--enable-lora",
            "--max-loras",
            "4",
            "--lora-dtype",
            "auto",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y"}',
        ]
    )
    config = serve.server_config(args)
    assert [(m.lora_name, m.lora_int_id, m.lora_path) for m in config.lora_modules] == [("a", 1, "/x"), ("b", 2, "/y")]


def test_an_adapter_no_model_could_serve_stops_serve_before_the_load(tmp_path, capsys):
    """Its files are read before the port is taken and the model loaded (a typo costs no load)."""
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text('{"use_dora": true}')
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(b"")
    for folder, message in [(tmp_path, "no LoRA adapter at"), (tmp_path / "dora", "use_dora True is not supported")]:
        assert serve.main(["no-such-model", "--enable-lora", "--lora-modules", f"a={folder}"]) == 1
        assert message in capsys.readouterr().err


def test_vllms_usage_flags_are_taken():
    args = serve.parse_args(["m", "--enable-force-include-usage", "--enable-prompt-tokens-details"])
    assert serve.server_config(args).force_include_usage
    assert not serve.server_config(serve.parse_args(["m"])).force_include_usage


@pytest.mark.parametrize("flags", [["--max-tokens", "0"], ["--temperature", "-1"], ["--top-p", "0"]])
def test_generate_refuses_bad_sampling_flags_before_loading_a_model(capsys, flags):
    """Told at once, exit 1: the model named does not exist, so loading it would be a different error."""
    assert generate.main(["hello", "--model", "/nonexistent/model", *flags]) == 1
    error = capsys.readouterr().err
    assert error.startswith("pagoda generate: ") and "nonexistent" not in error, error
