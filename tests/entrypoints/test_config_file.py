"""`--config FILE`: a YAML file of flags, as vLLM's `vllm serve --config c.yaml` reads one; the
command line's flags win over the file's, the file's over the defaults."""

from __future__ import annotations

import json

from pagoda.engine.args import EngineArgs
from pagoda.entrypoints import generate
from pagoda.entrypoints.openai import serve
from tests.entrypoints.test_vllm_spellings import parse_error


def config(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_files_flags_apply_and_the_command_line_wins(tmp_path):
    path = config(
        tmp_path,
        """
port: 9123
host: 0.0.0.0
max_num_seqs: 7            # the Python field's spelling does too
max-model-len: 4k
enforce-eager: true
enable-prefix-caching: false
served-model-name: [first, second]
api-key: [from-file]
allowed-origins: ["https://app.example"]
speculative-config: {method: ngram, num_speculative_tokens: 3}
""",
    )
    # MODEL first, then a file whose last flags take several values: MODEL stays the model
    args = serve.parse_args(["m", "--config", path, "--port", "9000", "--api-key", "from-cli"])
    assert (args.model, args.port, args.host) == ("m", 9000, "0.0.0.0")
    assert args.served_model_name == ["first", "second"]
    assert args.api_key == ["from-cli"]  # replaced, not added to: a key replaced must stop working
    assert serve.parse_args(["m", "--config", path]).api_key == ["from-file"]
    assert args.allowed_origins == ["https://app.example"]
    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_num_seqs, engine.max_model_len, engine.enforce_eager) == (7, 4000, True)
    assert engine.enable_prefix_caching is False
    assert json.loads(engine.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    # flags the file does not name keep their defaults; the command line's on/off flags win too
    assert serve.parse_args(["m", "--config", path, "--enable-prefix-caching"]).enable_prefix_caching is True
    assert serve.parse_args(["m", "--config", path]).max_num_batched_tokens == EngineArgs().max_num_batched_tokens


def test_the_model_may_come_from_the_file(tmp_path):
    path = config(tmp_path, "model: /models/smollm2\nport: 8001\n")
    assert serve.parse_args(["--config", path]).model == "/models/smollm2"
    assert serve.parse_args([f"--config={path}"]).port == 8001
    args = generate.build_parser().parse_args(["--config", config(tmp_path, "model: x.gguf\nmax-tokens: 3\n"), "hi"])
    assert (args.model, args.max_tokens, args.prompts) == ("x.gguf", 3, ["hi"])
    assert serve.parse_args(["m", "--config", config(tmp_path, "")]).port == 8000  # an empty file: no flags
    # the command line's MODEL wins over the file's model (vLLM's rule); an empty list gives none
    assert serve.parse_args(["cli-model", "--config", path]).model == "cli-model"
    assert serve.parse_args(["m", "--config", config(tmp_path, "api-key: []\n")]).api_key is None
    # --model on the command line wins too; a list value may start with "-"
    with_key = config(tmp_path, "model: file-model\napi-key: ['-secret']\n", "k.yaml")
    assert serve.parse_args(["--config", with_key, "--model", "cli-model"]).model == "cli-model"
    assert serve.parse_args(["--config", with_key]).api_key == ["-secret"]
    # generate's prompts from the file: a string is one prompt, a list several; the command line's win
    prompts = config(tmp_path, "prompts: hello\n", "p.yaml")
    assert generate.build_parser().parse_args(["--config", prompts]).prompts == ["hello"]
    several = config(tmp_path, "prompts: [a, b]\n", "q.yaml")
    assert generate.build_parser().parse_args(["--config", several]).prompts == ["a", "b"]
    assert generate.build_parser().parse_args(["--config", several, "cli"]).prompts == ["cli"]


def test_a_bad_file_is_refused_naming_the_file_and_the_key(tmp_path, capsys):
    def error(text: str) -> str:
        path = config(tmp_path, text)
        message = parse_error(["m", "--config", path], capsys)
        assert f"--config {path}: " in message
        return message

    assert "unknown key 'max-num-seq' (--max-num-seq: did you mean --max-num-seqs?)" in error("max-num-seq: 3")
    assert "recomputes its KV cache" in error("swap-space: 4")  # a vLLM flag Pagoda does not take
    assert "argument --max-num-seqs: invalid int value: 'lots'" in error("max-num-seqs: lots")
    assert "'enforce-eager' is on or off: true or false, not 3" in error("enforce-eager: 3")
    assert "'port' has no value" in error("port:")
    assert "a file cannot name another file" in error("config: other.yaml")
    assert "a YAML mapping of flag names to values" in error("- port\n- 8000\n")
    assert "not YAML" in error("port: [8000\n")
    assert "cannot read it: No such file or directory" in parse_error(["m", "--config", str(tmp_path / "no")], capsys)
    twice = ["m", "--config", config(tmp_path, "port: 1\n"), "--config", config(tmp_path, "port: 2\n", "b.yaml")]
    assert "give --config once" in parse_error(twice, capsys)


def test_a_files_model_leaves_the_swallowed_model_guard_on(tmp_path, capsys):
    """`--api-key k MODEL` reads MODEL as a key; a file's model must not hide that."""
    (tmp_path / "b").mkdir()
    path = config(tmp_path, "model: /models/a\n")
    assert "looks like the MODEL" in parse_error(["--config", path, "--api-key", "k", str(tmp_path / "b")], capsys)


def test_serve_reads_the_file_before_the_port_and_the_load(tmp_path, capsys):
    path = config(tmp_path, f"reports: {tmp_path / 'absent'}\n")
    assert serve.main(["m", "--config", path]) == 1
    assert "--reports" in capsys.readouterr().err
