"""The offline API returns vLLM's shapes (RequestOutput / CompletionOutput, logprobs as
{token id: Logprob}), shows a progress bar and a throughput line by default, and `pagoda generate`
reports a missing prompts file in one line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.entrypoints import generate
from pagoda.outputs import CompletionOutput, RequestOutput
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    path = write_tiny_model("llama", tmp_path_factory.mktemp("offline") / "llama", load_tokenizer(None))
    return LLM(str(path), kv_cache_memory=0.01, max_model_len=128)


def test_outputs_have_vllms_fields_and_no_engine_internals(tiny_llm):
    text, ids = "The capital of France", [5, 6, 7, 8]
    by_text, by_ids = tiny_llm.generate([text, ids], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3))
    assert isinstance(by_text, RequestOutput) and by_text.finished
    assert by_text.prompt == text and by_text.prompt_token_ids == tiny_llm.tokenizer.encode(text)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.prompt_logprobs is None
    times = by_text.metrics  # vLLM's RequestOutput.metrics: when it arrived, ran, gave its first token
    assert times.num_prompt_tokens == len(by_text.prompt_token_ids)
    assert times.arrival_time <= times.first_scheduled_time <= times.first_token_time
    assert [o.index for o in by_ids.outputs] == [0, 1]
    out = by_ids.outputs[1]
    assert isinstance(out, CompletionOutput) and len(out.token_ids) == 3 and out.finish_reason == "length"
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.cumulative_logprob is None and out.logprobs is None  # not asked for, as vLLM
    assert {f.name for f in dataclasses.fields(out)} == {
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "lora_request",
    }
    assert out.finished() and out.lora_request is None  # vLLM's method and field


def test_logprobs_sum_to_the_cumulative_logprob(tiny_llm):
    (result,) = tiny_llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    out = result.outputs[0]
    chosen = [position[token] for token, position in zip(out.token_ids, out.logprobs)]
    assert [lp.rank for lp in chosen] == [1, 1, 1, 1]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in chosen))


def test_detokenize_false_gives_the_same_tokens_without_text(tiny_llm):
    asked = dict(temperature=0.0, max_tokens=5, logprobs=1, prompt_logprobs=1, stop_token_ids=[0])
    with_text, ids_only = (
        tiny_llm.generate([[5, 6, 7, 8]], SamplingParams(**asked, detokenize=d))[0] for d in (True, False)
    )
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert with_text.outputs[0].text and ids_only.outputs[0].text == ""  # vLLM's: no text at all
    for position in ids_only.outputs[0].logprobs + ids_only.prompt_logprobs[1:]:
        assert position and all(lp.decoded_token is None for lp in position.values())
    same = [{t: lp.logprob for t, lp in position.items()} for position in ids_only.outputs[0].logprobs]
    assert same == [{t: lp.logprob for t, lp in position.items()} for position in with_text.outputs[0].logprobs]
    taken = SamplingParams(**asked, spaces_between_special_tokens=False)  # vLLM's field: taken (and ignored)
    assert tiny_llm.generate([[5, 6, 7, 8]], taken)[0].outputs[0].token_ids == with_text.outputs[0].token_ids


def test_chat_outputs_carry_the_rendered_prompt(tiny_llm):
    (result,) = tiny_llm.chat([{"role": "user", "content": "Hi there"}], GREEDY)
    assert "Hi there" in result.prompt and tiny_llm.tokenizer.encode(result.prompt) == result.prompt_token_ids


def test_progress_bar_and_speed_line_by_default(tiny_llm, capsys):
    tiny_llm.generate(["one", "two", "three"], GREEDY)
    err = capsys.readouterr().err
    assert "Generating" in err and "tok/s" in err and "3/3 sequences done" in err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("Processed 3 prompts in ") and "input tok/s, " in summary
    assert summary.endswith(" output tok/s")
    tiny_llm.generate(["one"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_generate_missing_prompts_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    assert generate.main(["--prompts-file", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "Traceback" not in err


def test_vllms_boilerplate_arguments_are_taken(tiny_llm):
    """What vLLM scripts pass and that changes nothing here loads; a value that would mean
    something Pagoda cannot do is refused, naming the argument; vLLM's dtype spellings."""
    model = tiny_llm.engine.config.model.path
    boilerplate = dict(
        trust_remote_code=True,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        disable_log_stats=True,
        swap_space=4,
        compilation_config={"level": 3},
        distributed_executor_backend="mp",
        logprobs_mode="raw_logprobs",
    )
    llm = LLM(model, dtype="float", kv_cache_memory_bytes=2**24, max_model_len=64, **boilerplate)
    assert llm.engine.config.model.dtype == torch.float32 and llm.engine.config.cache.kv_cache_memory_gib == 1 / 64
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model, max_logprobs=100)


@pytest.mark.parametrize("configure", ["1", "0"])
def test_loading_steps_show_on_the_terminal(tiny_llm, configure):
    """A program that set up no logging sees each loading step on stderr, as vLLM's LLM prints its
    own; PAGODA_CONFIGURE_LOGGING=0 keeps it quiet."""
    model = tiny_llm.engine.config.model.path
    code = f"from pagoda import LLM; LLM({model!r}, kv_cache_memory=0.01, max_model_len=64)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGODA_CONFIGURE_LOGGING": configure}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = ["Reading the model config", "Loading the tokenizer", "Reading weights", "Allocating the KV cache"]
    if configure == "1":
        assert all(step in done.stderr for step in steps), done.stderr
    else:
        assert not any(step in done.stderr for step in steps), done.stderr


def test_what_vllm_scripts_do_with_params_outputs_and_prompts(tiny_llm):
    """vLLM's SamplingParams are changed in place between calls (each call checks them again), and
    its outputs too; vLLM's prompt TypedDicts, its chat argument order, one priority for all,
    max_logprobs, and the sampling defaults of generation_config and override_generation_config."""
    from pagoda import RequestOutputKind, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    four = tiny_llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, use_tqdm=False)[0]
    params.max_tokens, params.stop = 2, "x"  # a string, made a list as a new SamplingParams would
    (two,) = tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False, priority=0)
    assert two.outputs[0].token_ids == four.outputs[0].token_ids[:2] and params.stop == "x"
    params.temperature = 5.0
    with pytest.raises(ValueError, match="temperature"):
        tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    params.temperature, params.logprobs = 0.0, "3"
    with pytest.raises(ValueError, match="logprobs must be an integer"):  # named, before the max_logprobs cap
        tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    params.logprobs = None
    import numpy as np

    assert len(tiny_llm.generate([[5, 6], [7, 8]], params, use_tqdm=False, priority=np.array([1, 0]))) == 2
    assert not tiny_llm.engine.has_unfinished
    params.temperature = 0.0
    params.stop = []
    params.stop += ["never"]  # a list, as vLLM's
    four.outputs[0].text = four.outputs[0].text.strip()  # outputs are plain objects too
    chat = [{"role": "user", "content": "Hi"}]
    by_position = tiny_llm.chat(chat, params, False, None, 0, "{{ messages[0].content }}")[0]
    assert by_position.prompt == "Hi"
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"a": 1}).extra_args == {"a": 1}
    assert SamplingParams(top_k=-1).top_k == -1  # disabled, kept as vLLM keeps it
    capped = LLM(tiny_llm.engine.config.model.path, kv_cache_memory=0.01, max_model_len=64, max_logprobs=2,
                 generation_config="vllm", override_generation_config={"temperature": 0.3, "max_new_tokens": 7},
                 chat_template="{{ 'T:' + messages[0].content }}")  # fmt: skip
    with pytest.raises(ValueError, match="max_logprobs"):
        capped.generate([5, 6], SamplingParams(logprobs=3), use_tqdm=False)
    defaults = capped.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.3, 7, 1.0)
    assert capped.chat(chat, params, use_tqdm=False)[0].prompt == "T:Hi"
    engine = capped.llm_engine  # as older vLLM scripts reach the tokenizer and the context length
    assert engine.get_tokenizer() is capped.tokenizer and engine.model_config.max_model_len == 64


def test_tokenization_kwargs_truncate_prompts_as_vllms(tiny_llm, caplog):
    """vLLM's offline truncation: the last tokens kept (the first with truncation_side "right"),
    token-id prompts too; special tokens left out of a text on request; unknown keys warned of."""
    ids = list(range(5, 25))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt_of(prompt, **kwargs):
        return tiny_llm.generate(prompt, params, use_tqdm=False, tokenization_kwargs=kwargs)[0].prompt_token_ids

    assert prompt_of(ids, truncate_prompt_tokens=8) == ids[-8:]
    assert prompt_of(ids, truncation=True, max_length=6, truncation_side="right") == ids[:6]
    assert prompt_of(ids, truncate_prompt_tokens=-1) == ids  # the context (128) less one holds it all
    text = "Hello there, general Kenobi"
    assert prompt_of(text, add_special_tokens=False) == tiny_llm.tokenizer.encode(text, add_special_tokens=False)
    with caplog.at_level("WARNING", logger="pagoda.entrypoints.llm"):
        assert prompt_of(ids, padding="longest") == ids
    assert "['padding'] are not supported" in caplog.text
    with pytest.raises(ValueError, match="cannot be greater than max_model_len"):
        prompt_of(ids, truncate_prompt_tokens=10_000)


def test_beam_search_logprobs_are_vllms_logprob_objects(tiny_llm):
    from pagoda import BeamSearchParams
    from pagoda.outputs import Logprob

    (result,) = tiny_llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=3))
    best = result.sequences[0]
    steps = best.logprobs
    assert len(steps) == len(best.tokens) - 3 and all(isinstance(lp, Logprob) for step in steps for lp in step.values())
    chosen = [step[token] for step, token in zip(steps, best.tokens[3:])]
    assert abs(sum(lp.logprob for lp in chosen) - best.cum_logprob) < 1e-5
    assert all(lp.rank >= 1 and isinstance(lp.decoded_token, str) for step in steps for lp in step.values())


def test_decoded_tokens_join_into_the_text_where_characters_span_tokens(tiny_llm):
    """vLLM's decoded_token: a byte-level piece of a character is "" until the token that completes
    it, which carries the whole character, so a prompt's or an answer's tokens' texts join into
    its text (each token decoded alone would give U+FFFD for every piece)."""
    tokenizer = tiny_llm.tokenizer
    ids = tokenizer.encode("Pizza: 🍕, 日本の首都は東京")
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # the characters span tokens
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (result,) = tiny_llm.generate([ids], params, use_tqdm=False)
    joined = "".join(result.prompt_logprobs[i][ids[i]].decoded_token for i in range(1, len(ids)))
    assert joined == tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])) :]
    answer = tiny_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, logprobs=1), use_tqdm=False)
    out = answer[0].outputs[0]
    texts = "".join(position[token].decoded_token for position, token in zip(out.logprobs, out.token_ids))
    assert texts == tokenizer.decode(out.token_ids).rstrip("\ufffd")  # a character cut short: its pieces give ""


def test_the_package_exports_what_the_docs_import():
    import pagoda
    from pagoda.sampling_params import StructuredOutputsParams

    assert pagoda.StructuredOutputsParams is StructuredOutputsParams and "StructuredOutputsParams" in pagoda.__all__


def test_sampling_params_take_what_vllm_takes():
    """None for the list fields, numpy's scalars, and logit_bias keys written as strings."""
    import numpy as np

    params = SamplingParams(
        stop=None,
        stop_token_ids=None,
        bad_words=None,
        logit_bias={"504": 1},
        temperature=np.float32(0.5),
        max_tokens=np.int64(5),
    )
    assert (params.stop, params.stop_token_ids, params.bad_words, params.logit_bias) == ([], [], [], {504: 1.0})
    assert type(params.temperature) is float and type(params.max_tokens) is int and params.max_tokens == 5
    listed = SamplingParams(
        allowed_token_ids=np.array([1, 2]), stop_token_ids=[np.int64(3)], logit_bias={np.int64(4): 1}
    )
    assert (listed.allowed_token_ids, listed.stop_token_ids, listed.logit_bias) == ([1, 2], [3], {4: 1.0})
    copied = params.clone()
    assert copied == params and copied.logit_bias is not params.logit_bias


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(seed="abc"), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**70), "seed"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(temperature="hot"), "temperature"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(logit_bias={"a": 1}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),  # it would make every draw token 0's
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(bad_words="word"), "bad_words"),
        (dict(detokenize="no"), "detokenize"),
        (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens"),
        (dict(stop=["."], detokenize=False), "stop"),  # stop strings are found in the text (vLLM refuses too)
    ],
)
def test_sampling_params_of_the_wrong_type_are_refused_naming_them(params, param):
    from pagoda.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match=param) as info:
        SamplingParams(**params)
    assert info.value.param == param


def test_a_refused_or_interrupted_call_leaves_the_llm_usable(tiny_llm, monkeypatch):
    """Token ids outside the vocabulary are refused before anything joins the engine, and a call
    interrupted half way (Ctrl-C) takes its requests out: the next call answers as if neither happened."""
    from pagoda.sampling_params import SamplingParamsError

    expected = tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    vocab = tiny_llm.engine.config.model.vocab_size
    for prompts, params, param in [
        ([[5, 6], [1, vocab]], GREEDY, "prompt"),  # the second prompt: the first had joined already
        ([[5, 6], [-1, 5]], GREEDY, "prompt"),
        ([5, 6], dataclasses.replace(GREEDY, logit_bias={vocab: 1.0}), "logit_bias"),
        ([5, 6], dataclasses.replace(GREEDY, stop_token_ids=(vocab + 3,)), "stop_token_ids"),
    ]:
        with pytest.raises(SamplingParamsError, match="outside the vocabulary") as info:
            tiny_llm.generate(prompts, params, use_tqdm=False)
        assert info.value.param == param and not tiny_llm.engine.has_unfinished
    with pytest.raises(SamplingParamsError, match="prompt must hold integer token ids, got 1.5"):
        tiny_llm.generate([[1.5, 2]], GREEDY, use_tqdm=False)
    step = tiny_llm.engine.step

    def interrupted():
        monkeypatch.setattr(tiny_llm.engine, "step", step)
        step()
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished and not tiny_llm.engine.outputs.sequences
    assert tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    with pytest.raises(TypeError, match="prompts must be"):
        tiny_llm.generate(5)
    with pytest.raises(TypeError, match="sampling_params must be"):
        tiny_llm.generate("hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="the prompt is empty"):
        tiny_llm.generate("")
    assert tiny_llm.generate([]) == [] and tiny_llm.chat([]) == []  # as vLLM's
    with pytest.raises(ValueError, match=r"messages\[0\]\.content must be a string"):  # the server's words
        tiny_llm.chat([{"role": "user", "content": 5}])
    assert not tiny_llm.engine.has_unfinished


def test_vllm_prompt_dicts_parts_tools_and_the_tokenizer(tiny_llm):
    """vLLM's offline shapes: prompt dicts, OpenAI content parts and tools in chat, get_tokenizer,
    and the model's sampling defaults where no SamplingParams is given."""
    ids = tiny_llm.get_tokenizer().encode("Hi there")
    by_text, by_ids, listed = (
        tiny_llm.generate({"prompt": "Hi there"}, GREEDY, use_tqdm=False)[0],
        tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0],
        tiny_llm.generate([{"prompt": "Hi there"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False),
    )
    assert by_text.prompt == "Hi there" and by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == listed[1].outputs[0].token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    (flat,) = tiny_llm.chat([{"role": "user", "content": "Hi there"}], GREEDY, use_tqdm=False)
    assert tiny_llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == flat.prompt_token_ids
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    (with_tools,) = tiny_llm.chat(parts, GREEDY, use_tqdm=False, tools=[tool])
    assert "get_weather" in with_tools.prompt and len(with_tools.prompt_token_ids) > len(flat.prompt_token_ids)
    assert tiny_llm.get_default_sampling_params() == SamplingParams()  # this model's config sets none
    with pytest.raises(ValueError, match="1 prompt"):
        tiny_llm.generate("Hi", [])
    # what the template's code fails on is refused as the server refuses it (a list where it adds strings)
    joins = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="template failed on these messages: TypeError.*content as a list"):
        tiny_llm.chat(parts, GREEDY, use_tqdm=False, chat_template=joins, chat_template_content_format="openai")
    for malformed in ("Hi there", [["user", "Hi there"]]):
        with pytest.raises(TypeError, match="messages must be a list of message dicts"):
            tiny_llm.chat(malformed, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams only"):
        tiny_llm.generate(["Hi", "there"], [GREEDY, None])


def test_a_prompt_dicts_cache_salt_is_its_prefix_cache_namespace(tiny_llm):
    """vLLM's prompt dicts carry a cache_salt: a prompt reuses cached KV only under the same salt."""
    ids = list(range(10, 60))  # three whole blocks of 16 and two tokens

    def cached(salt: str | None) -> tuple[int, list[int]]:
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        (out,) = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
        return out.num_cached_tokens, out.outputs[0].token_ids

    assert tiny_llm.reset_prefix_cache()
    first, tokens = cached("tenant-a")
    assert first == 0 and cached("tenant-b")[0] == 0 and cached(None)[0] == 0
    assert cached("tenant-a") == (48, tokens)
    assert cached("")[0] == 48  # vLLM's offline API takes an empty salt as none
    with pytest.raises(TypeError, match="cache_salt"):
        tiny_llm.generate({"prompt_token_ids": ids, "cache_salt": 7}, GREEDY, use_tqdm=False)
    assert tiny_llm.reset_prefix_cache(reset_running_requests=True) and cached(None)[0] == 0


def test_chat_continues_the_final_message_as_vllms(tiny_llm):
    opened = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    (result,) = tiny_llm.chat(opened, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert result.prompt.endswith("Hello, I am")
    (plain,) = tiny_llm.generate(result.prompt_token_ids, GREEDY, use_tqdm=False)
    assert result.outputs[0].token_ids == plain.outputs[0].token_ids
    (bare,) = tiny_llm.chat(opened[:1], GREEDY, add_generation_prompt=False)
    (headed,) = tiny_llm.chat(opened[:1], GREEDY)
    assert headed.prompt.startswith(bare.prompt) and len(headed.prompt) > len(bare.prompt)
    with pytest.raises(ValueError, match="cannot both be true"):
        tiny_llm.chat(opened, GREEDY, continue_final_message=True)


def test_generate_cli_refused_prompts_are_one_line(tmp_path, capsys):
    assert generate.main(["", "--max-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert err == "pagoda generate: the prompt is empty\n"


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(max_model_len=0), "max_model_len must be at least 1"),
        (dict(max_model_len=-5), "max_model_len must be at least 1"),
        (dict(seed="x"), "seed must be an integer"),
        (dict(seed=2**64), "seed must be an integer"),
    ],
)
def test_bad_engine_options_are_refused_before_loading(option, message):
    from pagoda.engine.args import EngineArgs
    from pagoda.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="/nonexistent", **option).create_config()


@pytest.mark.parametrize("gib", [float("inf"), float("nan"), 0.0])
def test_kv_cache_memory_must_be_finite_and_positive(gib):
    from pagoda.config import CacheConfig
    from pagoda.errors import ConfigError

    with pytest.raises(ConfigError, match=f"kv_cache_memory must be a finite number > 0 GiB, got {gib}"):
        CacheConfig(kv_cache_memory_gib=gib)


def test_ctrl_c_on_generate_is_one_line_and_exit_130(tiny_llm):
    """Ctrl-C while generating ends `pagoda generate` with a line and 130, not a traceback."""
    import signal

    model = tiny_llm.engine.config.model.path
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "generate", "hi", "--model", model]
    command += ["--max-tokens", "100000", "--max-model-len", "1024", "--kv-cache-memory", "0.01"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PAGODA_CONFIGURE_LOGGING": "1"},
        # SIGINT as a terminal's Ctrl-C finds it (a background job inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in process.stderr:  # type: ignore[union-attr]
        if "Allocating the KV cache" in line:  # loaded: generating follows
            break
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.rstrip().endswith("pagoda generate: interrupted")


def test_priority_scheduling_runs_the_lowest_priority_first_with_the_same_outputs(tiny_llm, tmp_path):
    """vLLM's scheduling_policy="priority" and generate(priority=[...]): one request at a time,
    the lowest priority value is scheduled first; each output is as under first come, first served."""
    path = tiny_llm.engine.config.model.path
    prompts = [[5, 6, 7], [9, 10, 11], [12, 13], [14, 15, 16, 17]]
    ranked = LLM(path, kv_cache_memory=0.01, max_model_len=128, scheduling_policy="priority", max_num_seqs=1)
    try:
        outs = ranked.generate(prompts, GREEDY, use_tqdm=False, priority=[2, -1, 2, 0])
    finally:
        ranked.engine.close()
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 0, 2]  # -1, 0, then the 2s in arrival order
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    ]
    with pytest.raises(ValueError, match="one priority per prompt"):
        tiny_llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1])
