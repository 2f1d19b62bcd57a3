"""The pooling runner (`runner="pooling"`, LLM.embed): a prompt's vector from its final hidden
states, LAST (the default), MEAN or CLS, against transformers' own model on the same weights
(`AutoModel`'s last_hidden_state); the same bits however the prompt is chunked, cached or
computed again; a bare decoder's checkpoint (`Qwen3Model`) served as one; sentence-transformers'
settings read; Matryoshka lengths; and what the runner refuses, by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from pagoda import LLM, PoolingParams, SamplingParams
from pagoda.errors import ConfigError
from pagoda.model_executor.pooler import Pooler
from pagoda.model_files import load_tokenizer
from pagoda.pooling_params import PoolerConfig, Pooling, sentence_transformers_pooling
from pagoda.request import Request
from pagoda.sampling_params import SamplingParamsError
from tests.tiny_models import write_tiny_model

TEXTS = [
    "The capital of France is Paris, a city on the Seine river with many bridges and museums.",
    "hello",
    "Embeddings map a text to a vector; texts of like meaning map to vectors close together, "
    "which search, clustering and retrieval-augmented generation rely on.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    return write_tiny_model("qwen3", tmp_path_factory.mktemp("embed") / "qwen3", tokenizer)


@pytest.fixture(scope="module")
def hidden(model_dir, tokenizer):
    """transformers' final hidden states of each text, [tokens, hidden], float32."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0] for t in TEXTS]


def pooling(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), runner="pooling", kv_cache_memory=0.02, **kwargs)


def vectors(llm: LLM, params: PoolingParams | None = None) -> list[list[float]]:
    return [out.outputs.embedding for out in llm.embed(TEXTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def last_llm(model_dir) -> LLM:
    return pooling(model_dir, max_num_batched_tokens=16)  # prompts of up to 30 tokens: 2 chunks


def test_last_token_pooling_equals_transformers(last_llm, hidden, tokenizer):
    outs = last_llm.embed(TEXTS, use_tqdm=False)
    for text, out, states in zip(TEXTS, outs, hidden):
        assert out.prompt_token_ids == tokenizer.encode(text)
        got = torch.tensor(out.outputs.embedding)
        want = torch.nn.functional.normalize(states[-1], dim=-1)
        assert out.outputs.hidden_size == states.shape[1] == 64
        assert (got - want).abs().max() < 1e-5 and abs(got.norm() - 1) < 1e-6


def test_chunks_batches_and_the_prefix_cache_leave_the_bits(model_dir, last_llm):
    chunked = vectors(last_llm)
    again = last_llm.embed(TEXTS, use_tqdm=False)  # every prompt's full blocks are cached hits now
    assert [out.outputs.embedding for out in again] == chunked and sum(out.num_cached_tokens for out in again) > 0
    whole = pooling(model_dir, max_num_batched_tokens=1024, enable_prefix_caching=False)
    assert vectors(whole) == chunked
    alone = [whole.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]  # one request a step
    assert alone == chunked


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_a_prompt_computed_again_from_its_start_pools_afresh(kind):
    """A preempted request computes its prompt again from the first token: what its first pass
    pooled is dropped, not added to (the runner's Pooler, fed as a step feeds it)."""
    torch.manual_seed(0)
    rows = torch.randn(10, 8)
    request = Request("r", list(range(10)), SamplingParams(), frozenset(), 64, pooling=Pooling(kind, None, False))
    pooler = Pooler()
    assert pooler.add(request, rows[:4], 0, ends=False) is None
    assert pooler.add(request, rows[4:6], 4, ends=False) is None  # preempted after this chunk
    assert pooler.add(request, rows[:7], 0, ends=False) is None
    got = pooler.add(request, rows[7:], 7, ends=True)
    want = rows.mean(dim=0) if kind == "MEAN" else rows[0]
    assert (torch.tensor(got) - want).abs().max() < 1e-6
    assert not pooler._partial  # nothing kept once the request has its vector


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_equal_transformers(model_dir, hidden, kind):
    config = {"pooling_type": kind.lower(), "use_activation": False}  # a lower-case name is vLLM's too
    llm = pooling(model_dir, max_num_batched_tokens=8, pooler_config=json.dumps(config))
    got = vectors(llm)
    for vector, states in zip(got, hidden):
        want = states.mean(dim=0) if kind == "MEAN" else states[0]
        assert (torch.tensor(vector) - want).abs().max() < 1e-5
    assert vectors(llm) == got  # no prefix-cache hit skips a row these read
    assert llm.engine.core.stats().prefix_cache_hits == 0
    whole = pooling(model_dir, max_num_batched_tokens=1024, pooler_config=config)  # a dict in LLM(...)
    assert vectors(whole) == got


def test_a_bare_decoder_checkpoint_is_a_pooling_model(tmp_path, model_dir, last_llm, tokenizer):
    bare = tmp_path / "bare"
    AutoModel.from_pretrained(model_dir).save_pretrained(bare)  # Qwen3Model: weights without "model.", no head
    tokenizer.save_pretrained(bare)
    assert json.loads((bare / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(bare), kv_cache_memory=0.02, max_num_batched_tokens=16)  # runner auto: pooling
    assert llm.engine.config.pooler == PoolerConfig() and not llm.engine.config.model.lm_head
    assert vectors(llm) == vectors(last_llm)
    with pytest.raises(ConfigError, match="runner pooling"):
        LLM(str(bare), runner="generate", kv_cache_memory=0.02)


def test_an_aborted_prompt_leaves_no_partial_vector(model_dir):
    llm = pooling(model_dir, max_num_batched_tokens=8, pooler_config={"pooling_type": "MEAN"})
    engine, partial = llm.engine, llm.engine.core.runner.pooler._partial
    request_id = engine.add_request(TEXTS[2], PoolingParams())
    engine.step()  # its first 8 tokens: their sum waits for the rest
    assert len(partial) == 1
    engine.abort([request_id])
    engine.add_request(TEXTS[1], PoolingParams())
    while engine.has_unfinished:  # the next step drops what the aborted request had summed
        engine.step()
    assert not partial


def test_the_startup_steps_pool(model_dir, monkeypatch):
    """A GPU's startup runs steps of its own before any request (its memory profile's largest step,
    the Triton kernels' first-use shapes): on the pooling runner they pool, as there is no LM head
    to sample from. Run here on the CPU's runner."""
    from pagoda.model_executor.gpu_memory import dummy_step

    llm = pooling(model_dir, max_num_batched_tokens=32, max_num_seqs=4)
    runner = llm.engine.core.runner
    step, _ = dummy_step(llm.engine.config)
    assert all(len(out) == 64 for out in runner.execute(step).embeddings)
    monkeypatch.setattr(runner.backend, "first_use_shapes", lambda *shape: ((1, 20), (8, 40)))
    runner.compile_kernels()  # as on a GPU: one request a shape, on blocks no request holds


def test_matryoshka_dimensions(tmp_path, model_dir, hidden):
    plain = pooling(model_dir)
    with pytest.raises(SamplingParamsError, match="Matryoshka") as refused:
        plain.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    assert refused.value.param == "dimensions"
    folder = tmp_path / "mrl"
    folder.mkdir()
    for file in model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = pooling(folder)
    out = llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    want = torch.nn.functional.normalize(hidden[0][-1][:16], dim=-1)  # cut first, then unit length
    assert len(out) == 16 and (torch.tensor(out) - want).abs().max() < 1e-5
    raw = llm.embed(TEXTS[0], PoolingParams(dimensions=32, use_activation=False), use_tqdm=False)[0]
    assert (torch.tensor(raw.outputs.embedding) - hidden[0][-1][:32]).abs().max() < 1e-5
    with pytest.raises(SamplingParamsError, match=r"\[16, 32, 64\], got 20"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=20), use_tqdm=False)
    assert len(vectors(pooling(folder, pooler_config={"dimensions": 32}))[0]) == 32  # the server's default length
    with pytest.raises(ConfigError, match=r"pooler_config.dimensions: .*\[16, 32, 64\], got 20"):
        pooling(folder, pooler_config={"dimensions": 20})  # refused at startup, not at every request


def test_sentence_transformers_settings(tmp_path):
    assert sentence_transformers_pooling(tmp_path) == {}  # no modules.json: the defaults
    transformer = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    (tmp_path / "modules.json").write_text(json.dumps([transformer]))
    assert sentence_transformers_pooling(tmp_path) == {}  # no Pooling module: the defaults (unit length), as vLLM
    pooling_module = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (tmp_path / "modules.json").write_text(json.dumps([transformer, pooling_module]))
    (tmp_path / "1_Pooling").mkdir()
    pooling_file = tmp_path / "1_Pooling" / "config.json"
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
    pooling_file.write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    assert PoolerConfig.resolve(str(tmp_path), None) == PoolerConfig("MEAN", use_activation=False)  # no Normalize
    chosen = PoolerConfig.resolve(str(tmp_path), '{"seq_pooling_type": "CLS"}')  # the flag's over the folder's
    assert chosen.pooling_type == "CLS"
    newer = "sentence_transformers.sentence_transformer.modules.normalize.Normalize"  # a later version's path
    (tmp_path / "modules.json").write_text(json.dumps([transformer, pooling_module, {"path": "2", "type": newer}]))
    for mode, kind in [("lasttoken", "LAST"), ("mean", "MEAN"), ("cls", "CLS")]:  # newer: one name
        pooling_file.write_text(json.dumps({"pooling_mode": mode}))
        assert PoolerConfig.resolve(str(tmp_path), None) == PoolerConfig(kind, True)
    both = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}
    for refused in ({"pooling_mode_max_tokens": True}, both):
        pooling_file.write_text(json.dumps(refused))
        with pytest.raises(ConfigError, match="is not one Pagoda makes"):
            PoolerConfig.resolve(str(tmp_path), None)
        assert PoolerConfig.resolve(str(tmp_path), {"pooling_type": "MEAN"}) == PoolerConfig("MEAN", True)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        PoolerConfig.resolve("/nonexistent", "[1]")
    with pytest.raises(ConfigError, match=r"unknown or unsupported key\(s\) \['normalize'\]"):
        PoolerConfig.resolve("/nonexistent", {"normalize": True})  # vLLM removed it for use_activation
    with pytest.raises(ConfigError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolerConfig.resolve("/nonexistent", '{"pooling_type": "ALL"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        PoolerConfig.resolve("/nonexistent", "{pooling")


def test_the_runners_refuse_each_others_requests(model_dir, last_llm, default_llm):
    with pytest.raises(SamplingParamsError, match="pooling runner") as refused:
        last_llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert refused.value.param == "model"
    with pytest.raises(SamplingParamsError, match="generate runner"):
        default_llm.embed("hello", use_tqdm=False)
    for options, field in [
        ({"quantization": "int8"}, "quantization"),
        ({"enable_lora": True}, "enable_lora"),
        ({"speculative_config": {"method": "ngram"}}, "speculative_config"),
    ]:
        with pytest.raises(ConfigError, match=f"{field} is not supported with the pooling runner"):
            pooling(model_dir, **options)
    with pytest.raises(ConfigError, match="pooler_config applies to the pooling runner only"):
        LLM(str(model_dir), pooler_config={"pooling_type": "MEAN"}, kv_cache_memory=0.02)


def test_a_prompt_fills_the_whole_context(model_dir, tokenizer):
    llm = pooling(model_dir, max_model_len=32)
    ids = (tokenizer.encode(TEXTS[2]) * 2)[:32]
    assert len(llm.embed([ids], use_tqdm=False)[0].outputs.embedding) == 64  # no room for output is needed
    with pytest.raises(ValueError, match="maximum context length is 32 tokens. However, you requested 33"):
        llm.embed([ids + ids[:1]], use_tqdm=False)
