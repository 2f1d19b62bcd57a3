"""--kv-cache-dtype bfloat16: a float32 model's keys and values stored rounded to bf16 (CPU, cpu
attention backend). The cache is bf16 and holds twice the tokens per GiB; the C decoder stack reads
and writes it as the modules do (==); on the default model the outputs stay within the bounds
measured for it (docs/engine.md, benchmarks/quantization_accuracy.py); where it cannot apply it is
refused, naming the option. `auto` takes it for the CPU's quantized formats, `float32` declines it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from pagoda import LLM
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels
from tests.engine.test_cpu_stack import assert_stack_equals_modules, prompts_of
from tests.model_executor.test_cpu_quantization import TEXT, scores
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")

# (max mean |delta logprob|, min top-1 agreement, max perplexity ratio) against the float32 cache on
# the default model and TEXT
BOUNDS = (0.02, 0.97, 1.01)  # measured: 9.0e-3, 0.994, 0.9997


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    from pagoda.model_files import load_tokenizer

    return str(write_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), load_tokenizer(None), vocab_size=2048))


def test_cache_is_bfloat16_with_twice_the_tokens(tiny_qwen2):
    """The cache's dtype and capacity; the cache config stays plain JSON (the server's
    /get_server_info sends it as it is)."""
    sizes = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype=kv)
        runner = llm.engine.core.runner
        assert json.loads(json.dumps(dataclasses.asdict(llm.engine.config.cache)))["kv_cache_dtype"] == kv
        assert runner.kv_caches[0].dtype == (torch.bfloat16 if kv == "bfloat16" else torch.float32)
        sizes[kv] = runner.kv_caches[0].shape[1]  # blocks
        llm.engine.close()
    assert 0 <= sizes["bfloat16"] - 2 * sizes["auto"] <= 1  # whole blocks of the same GiB


def test_stack_reads_and_writes_it_as_the_modules_do(tiny_qwen2, monkeypatch):
    rows = assert_stack_equals_modules(tiny_qwen2, prompts_of(4), monkeypatch, kv_cache_dtype="bfloat16")
    assert 64 in rows and 1 in rows


@pytest.mark.parametrize(
    ("quantization", "kv", "cache_dtype"),
    [(None, "auto", torch.float32), ("int8", "auto", torch.bfloat16), ("int8", "float32", torch.float32)],
)
def test_auto_is_bfloat16_for_a_quantized_model(tiny_qwen2, quantization, kv, cache_dtype):
    """A model served with int8 activations (--quantization int8 or gguf) takes the 16-bit cache
    unless asked for float32; a float32 model keeps its own dtype."""
    llm = LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype=kv, quantization=quantization)
    assert llm.engine.core.runner.kv_caches[0].dtype == cache_dtype
    assert llm.engine.config.cache.kv_cache_dtype == ("bfloat16" if cache_dtype == torch.bfloat16 else "auto")
    llm.engine.close()


def test_refused_where_it_cannot_apply(tiny_qwen2):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'auto', 'bfloat16' or 'float32', got 'fp8'"):
        LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype="fp8", dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype='bfloat16' needs a float32 model on the cpu attention"):
        LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype="bfloat16", attention_backend="torch")
    with pytest.raises(
        ConfigError, match="kv_cache_dtype='float32' needs a float32 model; this model runs in bfloat16"
    ):
        LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype="float32", dtype="bfloat16")
    bf16 = LLM(tiny_qwen2, max_model_len=512, kv_cache_memory=0.05, kv_cache_dtype="bfloat16", dtype="bfloat16")
    assert bf16.engine.core.runner.kv_caches[0].dtype == torch.bfloat16  # a bf16 model's cache already is
    bf16.engine.close()


def test_default_model_within_bounds(default_llm):
    ids = default_llm.tokenizer.encode(TEXT)
    ref_lp, ref_top = scores(default_llm, ids)
    llm = LLM(kv_cache_memory=0.2, max_model_len=1024, kv_cache_dtype="bfloat16")
    lp, top = scores(llm, ids)
    llm.engine.close()
    mean_delta = sum(abs(a - b) for a, b in zip(ref_lp, lp)) / len(lp)
    agreement = sum(a == b for a, b in zip(ref_top, top)) / len(top)
    ppl_ratio = math.exp((sum(ref_lp) - sum(lp)) / len(lp))
    max_delta, min_agreement, max_ratio = BOUNDS
    measured = f"mean |delta| {mean_delta:.2e}, top-1 {agreement:.3f}, perplexity ratio {ppl_ratio:.4f}"
    print(measured)
    assert mean_delta <= max_delta and agreement >= min_agreement and ppl_ratio <= max_ratio, measured
