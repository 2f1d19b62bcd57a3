"""vLLM's flag spellings on `pagoda serve`, what they do in the server, and the parser every
subcommand shares: "did you mean" for a mistyped flag, and a default shown for every flag."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from types import SimpleNamespace

import pytest

from pagoda.analyze.cli import build_parser as analyze_parser
from pagoda.bench.settings import UsageError
from pagoda.bench.settings import build_parser as bench_parser
from pagoda.engine.args import EngineArgs
from pagoda.entrypoints import generate
from pagoda.entrypoints.openai import serve
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.params import ModelLimits, sampling_params
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.entrypoints.openai.serving import ServerConfig, ServerState
from pagoda.errors import ConfigError


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        serve.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_model_flag_is_the_positional_model(capsys):
    assert serve.parse_args(["--model", "dir"]).model == "dir"
    assert serve.parse_args(["dir", "--model", "dir"]).model == "dir"
    assert serve.parse_args(["dir"]).model == "dir"
    assert "the MODEL argument 'a' and --model 'b' differ" in parse_error(["a", "--model", "b"], capsys)


def test_tensor_parallelism_above_one_is_refused_with_the_reason(capsys):
    assert serve.parse_args(["--tensor-parallel-size", "1"]).tensor_parallel_size == 1
    assert "Pagoda has no tensor parallelism yet" in parse_error(["--tensor-parallel-size", "2"], capsys)


def test_log_flags_become_the_server_config(capsys):
    assert not serve.parse_args([]).enable_log_requests
    assert serve.parse_args(["--enable-log-requests"]).enable_log_requests
    assert not serve.parse_args(["--disable-log-requests"]).enable_log_requests
    requests = logging.getLogger("pagoda.requests")
    try:  # vLLM's flag quiets every per-request line: refusals and finishes too
        serve.configure_logging(serve.parse_args(["--disable-log-requests"]))
        assert not requests.isEnabledFor(logging.INFO)
    finally:
        requests.setLevel(logging.NOTSET)
    assert "contradict" in parse_error(["--enable-log-requests", "--disable-log-requests"], capsys)
    assert serve.parse_args(["--disable-log-stats"]).disable_log_stats
    assert ServerConfig().log_stats and not ServerConfig().log_requests
    assert serve.parse_args(["--uvicorn-log-level", "trace"]).uvicorn_log_level == "trace"
    assert serve.parse_args(["--log-config-file", "logging.json"]).log_config_file == "logging.json"
    assert serve.parse_args(["--enable-server-load-tracking"]).enable_server_load_tracking  # /load always counts


def test_server_flags_become_the_server_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    default = serve.server_config(serve.parse_args([]))
    assert (default.log_requests, default.log_stats, default.max_logprobs, default.generation_defaults) == (
        False,
        True,
        20,
        None,
    )
    argv = ["--enable-log-requests", "--disable-log-stats", "--max-logprobs", "3", "--generation-config"]
    config = serve.server_config(serve.parse_args([*argv, str(tmp_path)]))
    assert (config.log_requests, config.log_stats, config.max_logprobs, config.generation_defaults) == (
        True,
        False,
        3,
        {"top_p": 0.5},
    )
    assert serve.server_config(serve.parse_args(["--generation-config", "vllm"])).generation_defaults == {}


def test_tokenizer_flag_names_the_tokenizer_the_engine_loads(tmp_path):
    from pagoda.engine.args import EngineArgs

    folder = tmp_path / "tok-dir"
    folder.mkdir()
    args = EngineArgs.from_cli_args(serve.parse_args(["--tokenizer", str(folder)]))
    assert args == EngineArgs(tokenizer=str(folder))
    assert args.create_config().model.tokenizer == str(folder)
    assert EngineArgs().create_config().model.tokenizer is None  # the model's own


def test_the_engine_loads_the_tokenizer_named(tmp_path):
    from pagoda import LLM
    from pagoda.model_files import load_tokenizer
    from tests.tiny_models import write_tiny_model

    tokenizer = load_tokenizer(None)
    model = write_tiny_model("llama", tmp_path / "tiny", tokenizer)
    tokenizer.chat_template = "{{ messages[0].content }} (the other tokenizer)"
    tokenizer.save_pretrained(tmp_path / "other")
    llm = LLM(str(model), tokenizer=str(tmp_path / "other"), kv_cache_memory=0.05)
    assert llm.tokenizer.chat_template == "{{ messages[0].content }} (the other tokenizer)"
    assert LLM(str(model), kv_cache_memory=0.05).tokenizer.chat_template != llm.tokenizer.chat_template


def test_trust_remote_code_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, "pagoda.serve"):
        assert serve.main(["--trust-remote-code", "--generation-config", "/no/such/folder"]) == 1
    assert "--trust-remote-code has no effect" in caplog.text


def test_max_logprobs_above_what_pagoda_returns_is_refused(capsys):
    assert serve.parse_args(["--max-logprobs", "5"]).max_logprobs == 5
    assert "--max-logprobs must be in [0, 20]" in parse_error(["--max-logprobs", "21"], capsys)


def test_out_of_range_port_and_negative_grace_are_refused_at_parse(capsys):
    assert "--port must be in [0, 65535], got 99999" in parse_error(["--port", "99999"], capsys)
    assert "--port must be in [0, 65535], got -1" in parse_error(["--port", "-1"], capsys)
    assert "--shutdown-timeout must be at least 0, got -5" in parse_error(["--shutdown-timeout", "-5"], capsys)


def test_cors_flags_take_vllms_json_lists(capsys):
    args = serve.parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    cors = serve.server_config(args).cors
    assert cors.origins == ("https://a.example",) and cors.methods == cors.headers == ("*",) and cors.credentials
    assert serve.server_config(serve.parse_args([])).cors.origins == ()  # as vLLM: no cross-origin calls
    error = parse_error(["--allowed-origins", "*"], capsys)
    assert "argument --allowed-origins: a JSON list of strings such as '[\"*\"]', got '*'" in error


def test_a_host_that_does_not_resolve_is_named():
    from pagoda.entrypoints.openai.startup import bind_socket
    from pagoda.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--host 999\.1\.1\.1 does not resolve to an address"):
        bind_socket("999.1.1.1", 0)


USER = {"role": "user", "content": "x"}
LIMITS = ModelLimits(2048, 1000, {"temperature": 0.6, "top_p": 0.9}, max_logprobs=5)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=6),
            "top_logprobs",
        ),
        (CompletionRequest(prompt="x", logprobs=6), "logprobs"),
        (CompletionRequest(prompt="x", prompt_logprobs=6), "prompt_logprobs"),
    ],
)
def test_logprobs_beyond_max_logprobs_are_a_400_naming_the_field(body, param):
    logprobs = body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs
    with pytest.raises(APIError) as raised:
        sampling_params(
            body,
            LIMITS,
            max_tokens=4,
            logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs,
            renames={"logprobs": "top_logprobs"} if isinstance(body, ChatCompletionRequest) else {},
        )
    assert raised.value.status == 400 and raised.value.param == param
    assert "at most 5" in raised.value.message
    five = sampling_params(body, LIMITS, max_tokens=4, logprobs=5, prompt_logprobs=None, renames={})
    assert five.logprobs == 5


def test_generation_config_chooses_the_sampling_defaults(tmp_path, capsys):
    config = {"temperature": 0.3, "top_k": 7, "max_length": 9, "repetition_penalty": 1.1, "max_new_tokens": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "min_p": None}))
    assert serve.read_generation_config("auto") is None  # the model's own, as the loader reads them
    assert serve.read_generation_config("vllm") == {}
    assert serve.read_generation_config(str(tmp_path)) == {  # vLLM's keys; max_new_tokens is max_tokens
        "temperature": 0.3,
        "top_k": 7,
        "repetition_penalty": 1.1,
        "max_tokens": 5,
    }
    assert serve.parse_args([]).generation_config == "auto"
    params = sampling_params(
        CompletionRequest(prompt="x"),
        ModelLimits(2048, 1000, serve.read_generation_config(str(tmp_path)) or {}),
        max_tokens=4,
        logprobs=None,
        prompt_logprobs=None,
        renames={},
    )
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.3, 7, 1.0, 1.1)
    asked = CompletionRequest(prompt="x", repetition_penalty=1.0, min_p=0.2)  # a request's own values win
    limits = ModelLimits(2048, 1000, serve.read_generation_config(str(tmp_path)) or {})
    own = sampling_params(asked, limits, max_tokens=4, logprobs=None, prompt_logprobs=None, renames={})
    assert (own.repetition_penalty, own.min_p, own.max_tokens) == (1.0, 0.2, 4)
    assert serve.main(["--generation-config", str(tmp_path / "absent")]) == 1
    assert "--generation-config" in capsys.readouterr().err
    started = time.monotonic()  # a --reports that is no folder fails before the port and the load
    assert serve.main(["--reports", str(tmp_path / "absent")]) == 1
    assert "--reports" in capsys.readouterr().err and time.monotonic() - started < 2


def test_override_generation_config_goes_over_the_generation_config(tmp_path, capsys):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    model = {"temperature": 0.6, "top_p": 0.9}
    overrides = '{"temperature": 0.5, "max_new_tokens": 12, "do_sample": true}'  # vLLM's keys only
    for flags, expected in [
        ([], model),
        (["--override-generation-config", overrides], {"temperature": 0.5, "top_p": 0.9, "max_tokens": 12}),
        (
            ["--generation-config", "vllm", "--override-generation-config", overrides],
            {"temperature": 0.5, "max_tokens": 12},
        ),
        (
            ["--generation-config", str(tmp_path), "--override-generation-config", '{"top_k": 3}'],
            {"temperature": 0.3, "top_k": 3},
        ),
    ]:
        assert serve.server_config(serve.parse_args(["m", *flags])).sampling_defaults(model) == expected
    assert "a JSON object" in parse_error(["m", "--override-generation-config", "[1]"], capsys)
    assert "temperature must be in [0, 2]" in parse_error(
        ["m", "--override-generation-config", '{"temperature": 9}'], capsys
    )


def test_enable_log_requests_logs_ids_and_params_on_arrival(caplog):
    """The line is written before the request reaches the engine; this state has none, so the
    launch fails right after it."""
    from pagoda.sampling_params import SamplingParams

    for enabled in (True, False):
        sinks = SimpleNamespace(request_log=None, tracer=None)
        state = ServerState(None, ServerConfig(log_requests=enabled), "m", LIMITS, sinks, None)  # type: ignore[arg-type]
        caplog.clear()
        with caplog.at_level(logging.INFO, "pagoda.requests"), pytest.raises(APIError):
            asyncio.run(
                state.launch(None, "/v1/completions", "cmpl-7", [[1, 2, 3]], SamplingParams(max_tokens=3), None, None)
            )  # type: ignore[arg-type]
        lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.requests"]
        if enabled:
            assert lines and lines[0].startswith("received cmpl-7 /v1/completions: 1 prompt(s), SamplingParams(")
            assert "max_tokens=3" in lines[0]
        else:
            assert not lines


SUBCOMMAND_PARSERS = {
    "serve": serve.build_parser,
    "generate": generate.build_parser,
    "analyze": analyze_parser,
    "bench": bench_parser,
}


@pytest.mark.parametrize(
    "command, typo, meant",
    [
        ("serve", "--max-num-seq", None),  # an unambiguous prefix: argparse accepts it
        ("serve", "--kv-cache-memroy", "--kv-cache-memory"),
        ("generate", "--max-token", None),
        ("generate", "--temprature", "--temperature"),
        ("analyze", "--blok-size", "--block-size"),
        ("bench", "--concurency", "--concurrency"),
    ],
)
def test_an_unknown_flag_names_the_closest_one(command, typo, meant, capsys):
    parser = SUBCOMMAND_PARSERS[command]()
    argv = [typo, "1"] + (["log.jsonl"] if command == "analyze" else []) + (["p"] if command == "generate" else [])
    if meant is None:
        parser.parse_args(argv)
        return
    with pytest.raises((SystemExit, UsageError)) as raised:
        parser.parse_args(argv)
    message = str(raised.value) if raised.type is UsageError else capsys.readouterr().err
    assert f"{typo}: did you mean {meant}?" in message


def test_bakeoff_names_the_closest_flag(capsys):
    from pagoda.bench import bakeoff

    with pytest.raises(SystemExit):
        bakeoff.main(["x.toml", "--no-progess"])
    assert "--no-progess: did you mean --no-progress?" in capsys.readouterr().err


@pytest.mark.parametrize("command", SUBCOMMAND_PARSERS)
def test_help_shows_every_flags_default(command):
    parser = SUBCOMMAND_PARSERS[command]()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            shown = formatter._expand_help(action) if action.help else ""
            assert "default" in shown, f"{command} {action.option_strings}: {shown!r}"


def test_the_defaults_formatter_leaves_a_stated_default_alone():
    parser = argparse.ArgumentParser(formatter_class=serve.Parser().formatter_class)
    parser.add_argument("--a", default=3, help="a number")
    parser.add_argument("--b", default=None, help="a path")
    parser.add_argument("--c", default=1, help="as stated (default: one)")
    text = " ".join(parser.format_help().split())
    assert "a number (default: 3)" in text and "a path (default: none)" in text
    assert "as stated (default: one)" in text and "(default: one) (default" not in text


def test_the_model_argument_as_given_names_the_model_too():
    """vLLM's id for a model is the argument as given, which its clients send; Pagoda lists the
    folder's name and takes either, unless --served-model-name names it."""

    def state(argv: list[str]) -> ServerState:
        fields = dict.fromkeys(("engine", "limits", "sinks", "token_texts"))
        return ServerState(config=serve.server_config(serve.parse_args(argv)), model_name="smollm2", **fields)

    assert state(["/models/smollm2", "--served-model-name", "smollm2", "small"]).config.served_names == ("small",)

    given = state(["/models/smollm2"])
    given.check_model("/models/smollm2")
    given.check_model("smollm2")
    several = state(["/models/smollm2", "--served-model-name", "smollm2", "small", "--dtype", "half"])
    several.check_model("small")  # vLLM serves every name given; the first is the id
    args = serve.parse_args(["/models/smollm2", "--served-model-name", "smollm2", "small", "--dtype", "half"])
    assert (EngineArgs.from_cli_args(args).served_model_name, EngineArgs.from_cli_args(args).dtype) == (
        "smollm2",
        "float16",
    )
    for refused, model in (
        (given, "/models/other"),
        (state(["/models/smollm2", "--served-model-name", "x"]), "/models/smollm2"),
    ):
        with pytest.raises(APIError) as error:
            refused.check_model(model)
        assert error.value.status == 404 and error.value.param == "model"


def test_several_api_keys_and_vllms_environment_variable(monkeypatch, capsys):
    """vLLM's --api-key takes several keys, any of which authorizes; without the flag, a key set in
    VLLM_API_KEY (a deployment moved from vLLM) still closes the server."""
    from pagoda.entrypoints.openai.api import _require_key

    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve.server_config(serve.parse_args(["m", "--api-key", "a", "b"])).api_keys == ("a", "b")
    assert serve.server_config(serve.parse_args(["m", "--api-key", "a", "--api-key", "b"])).api_keys == ("a", "b")
    assert serve.server_config(serve.parse_args(["m"])).api_keys == ()
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert serve.server_config(serve.parse_args(["m"])).api_keys == ("v",)
    monkeypatch.setenv("PAGODA_API_KEY", "p")
    assert serve.server_config(serve.parse_args(["m"])).api_keys == ("p",)
    check = _require_key(("a", "b"))
    # (Authorization, X-Api-Key): Anthropic's clients send the key as the latter
    for accepted in (("Bearer a", None), ("Bearer b", None), ("bearer b ", None), (None, "a"), ("Basic x", "b")):
        asyncio.run(check(*accepted))
    for refused in (("Bearer c", None), ("Basic a", None), (None, None), (None, "c"), ("Bearer c", "a"), (None, "")):
        with pytest.raises(APIError) as error:
            asyncio.run(check(*refused))
        assert error.value.status == 401
    assert "one --api-key" in parse_error(["m", "--data-parallel-size", "2", "--api-key", "a", "b"], capsys)
    assert "must not be empty" in parse_error(["m", "--api-key", "a", ""], capsys)  # "$K2" unset: not open


def test_a_flag_of_several_values_does_not_swallow_the_model(tmp_path, capsys):
    """`--api-key k MODEL` read MODEL as a second key (and served the default model): refused."""
    for flag in ("--api-key", "--served-model-name"):
        assert "give it before" in parse_error([flag, "x", str(tmp_path)], capsys)
        assert "give it before" in parse_error([flag, "x", "model.gguf"], capsys)
    assert serve.parse_args([str(tmp_path), "--api-key", "a", "b"]).api_key == ["a", "b"]


def test_vllm_flags_it_does_not_take_say_why(capsys):
    """Rather than a "did you mean" naming a flag of another meaning (--disable-uvicorn-access-log
    is no --access-log): the reason and what to do instead; no-op flags of vLLM's lines pass."""
    assert "put a TLS-terminating proxy" in parse_error(["m", "--ssl-keyfile", "k.pem"], capsys)
    assert "did you mean" not in parse_error(["m", "--swap-space", "4"], capsys)
    assert "always prefilled in chunks" in parse_error(["m", "--no-enable-chunked-prefill"], capsys)
    assert "did you mean --max-model-len" in parse_error(["m", "--max-model-length", "9"], capsys)  # a typo
    assert "no sleep mode" in parse_error(["m", "--enable-sleep-mode"], capsys)
    assert "not each step's model" in parse_error(["m", "--collect-detailed-traces", "all"], capsys)
    assert "--speculative-config" in parse_error(["m", "--spec-method", "ngram"], capsys)
    assert "--max-prefill-with-decodes" in parse_error(["m", "--long-prefill-token-threshold", "64"], capsys)
    accepted = ["m", "--disable-custom-all-reduce", "--disable-cascade-attn", "--disable-sliding-window"]
    assert serve.parse_args([*accepted, "--logprobs-mode", "raw_logprobs"]).disable_sliding_window
    assert "invalid choice" in parse_error(["m", "--logprobs-mode", "processed_logprobs"], capsys)
    for flag in ("--hf-token", "--data-parallel-address", "--numa-bind", "--async-scheduling", "--uds"):
        assert f"{flag} is a vLLM flag pagoda serve does not take" in parse_error(["m", flag, "x"], capsys), flag
    assert "not a count of bytes" in parse_error(["m", "--kv-cache-memory-bytes", "lots"], capsys)
    assert "a JSON object of template variables" in parse_error(["m", "--default-chat-template-kwargs", "[1]"], capsys)
    with pytest.raises(ConfigError, match="tokenize: arguments of the renderer"):
        serve.checked_template_defaults({"tokenize": False, "enable_thinking": False})
    assert serve.parse_args(["m", "--max-num-queued-reqs", "5"]).max_queue == 5
    assert serve.parse_args(["m", "--no-async-scheduling"]).no_async_scheduling  # what Pagoda does anyway
    both = ["m", "--enable-log-outputs", "--disable-log-requests"]
    assert "the per-request lines --disable-log-requests turns off" in parse_error(both, capsys)
    assert serve.parse_args(["m", "--kv-cache-memory-bytes", "2147483648"]).kv_cache_memory == 2.0
    assert serve.parse_args(["m", "--kv-cache-memory-bytes", "3G"]).kv_cache_memory == 3.0
    assert "scale out with --data-parallel-size" in parse_error(["m", "--api-server-count", "2"], capsys)
    assert serve.parse_args(["m", "-asc", "1"]).api_server_count == 1
    serve.parse_args(["m", "--enable-chunked-prefill", "--disable-uvicorn-access-log"])
    assert "--max-log-len must be at least 0" in parse_error(["m", "--max-log-len", "-1"], capsys)


def test_max_model_len_takes_vllms_units(capsys):
    lengths = {text: serve.parse_args(["m", "--max-model-len", text]).max_model_len for text in ("2048", "4k", "4K")}
    assert lengths == {"2048": 2048, "4k": 4000, "4K": 4096}
    assert "not a count of tokens" in parse_error(["m", "--max-model-len", "lots"], capsys)
    assert "not a whole count" in parse_error(["m", "--max-model-len", "infk"], capsys)  # not a traceback


def test_return_tokens_as_token_ids_flag_is_the_default_a_request_may_override():
    assert not serve.server_config(serve.parse_args(["m"])).return_tokens_as_token_ids
    config = serve.server_config(serve.parse_args(["m", "--return-tokens-as-token-ids"]))
    texts = SimpleNamespace(width=len, bytes=lambda token_id: [token_id])  # a stand-in for TokenTexts
    for server_default, asked, as_ids in [
        (True, None, True),
        (True, False, False),
        (False, None, False),
        (False, True, True),
    ]:
        state = ServerState(None, ServerConfig(return_tokens_as_token_ids=server_default), "m", LIMITS, None, texts)  # type: ignore[arg-type]
        body = CompletionRequest(prompt="x", return_tokens_as_token_ids=asked)
        names = state.logprob_tokens(body)
        assert names.text(7) == "token_id:7" if as_ids else names is texts
    assert config.return_tokens_as_token_ids


def test_request_id_headers_echo_the_callers_id_or_make_one():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagoda.entrypoints.openai.api import RequestIdHeader

    assert serve.server_config(serve.parse_args(["m", "--enable-request-id-headers"])).request_id_headers
    assert not serve.server_config(serve.parse_args(["m"])).request_id_headers
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    app.add_middleware(RequestIdHeader)
    with TestClient(app) as http:
        assert http.get("/ping", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
        made = [http.get("/ping").headers["x-request-id"] for _ in range(2)]
        missing = http.get("/nowhere")  # errors carry it too
    assert len(made[0]) == 32 and made[0] != made[1] and int(made[0], 16) >= 0
    assert missing.status_code == 404 and len(missing.headers["x-request-id"]) == 32


def test_response_role_names_the_reply_after_a_generation_prompt():
    from pagoda.entrypoints.openai.chat import _reply_role

    assert serve.server_config(serve.parse_args(["m"])).response_role == "assistant"
    state = SimpleNamespace(config=serve.server_config(serve.parse_args(["m", "--response-role", "bot"])))
    messages = [{"role": "user", "content": "hi"}]
    assert _reply_role(state, ChatCompletionRequest(messages=messages)) == "bot"
    assert _reply_role(state, ChatCompletionRequest(messages=messages, add_generation_prompt=False)) == "user"
    developer = ChatCompletionRequest(messages=[{"role": "developer", "content": "x"}], add_generation_prompt=False)
    assert _reply_role(state, developer) == "developer"  # as sent, as vLLM (the template sees system)


def test_fingerprint_modes_are_vllms(capsys):
    """full and hash: pagoda-VERSION-HASH8 of what decides the outputs (another deterministic
    setting, another fingerprint); custom: the value given; none: null."""
    import re

    from pagoda import __version__
    from pagoda.entrypoints.openai.api import system_fingerprint

    def engine(deterministic: bool) -> SimpleNamespace:
        cache, device = SimpleNamespace(kv_cache_dtype="auto"), SimpleNamespace(type="cpu")
        return SimpleNamespace(
            model="m", cache=cache, device=device, attention_backend="CPU", deterministic=deterministic,
            speculative=None, enforce_eager=False,
        )  # fmt: skip

    config = serve.server_config(serve.parse_args(["m"]))
    full = system_fingerprint(engine(True), config.fingerprint_mode, config.fingerprint_value)
    assert re.fullmatch(rf"pagoda-{re.escape(__version__)}-[0-9a-f]{{8}}", full)
    assert system_fingerprint(engine(True), "hash", None) == full != system_fingerprint(engine(False), "full", None)
    custom = serve.server_config(serve.parse_args(["m", "--fingerprint-mode", "custom", "--fingerprint-value", "v1"]))
    assert system_fingerprint(engine(True), custom.fingerprint_mode, custom.fingerprint_value) == "v1"
    assert system_fingerprint(engine(True), "none", None) is None
    assert "custom needs it" in parse_error(["m", "--fingerprint-mode", "custom"], capsys)
    assert "--fingerprint-value goes with" in parse_error(["m", "--fingerprint-value", "v1"], capsys)


def test_vllms_cpu_kv_cache_space_sizes_the_pool_where_the_flag_is_not_given(monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it) where --kv-cache-memory is unset."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert EngineArgs().resolve_kv_cache_memory() == 2.0
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "6")
    assert EngineArgs().resolve_kv_cache_memory() == 6.0
    assert EngineArgs(kv_cache_memory=0.5).resolve_kv_cache_memory() == 0.5  # the flag wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a whole number"):
        EngineArgs().resolve_kv_cache_memory()


def test_a_tokenizer_path_that_is_not_there_is_named_as_the_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="tokenizer '.*nowhere': no such folder or .gguf file"):
        EngineArgs(tokenizer=str(tmp_path / "nowhere")).create_config()
