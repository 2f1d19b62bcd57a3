"""Quantized weights on the CPU end to end: `--quantization gguf` on the shipped Q4_1 file and
`--quantization int8` on the HF directory give each request the same tokens whatever batch it shares
(int8 activations, one arithmetic); every format stays
within its documented accuracy bounds against the float32 model on the same weights (bounds in
docs/quantization.md, set from benchmarks/quantization_accuracy.py's measurements); loading holds
no float copy of the model (RSS growth under twice the resident weights)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.args import EngineArgs
from pagoda.errors import ConfigError
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.quant_loader import rotary_row_order
from pagoda.model_files import default_model_path
from tests.gguf_files import requantize_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine"),
]

# A fixed public-domain text (the Gettysburg Address) of about 330 tokens, scored position by position
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    "and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate -- "
    "we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, "
    "far above our poor power to add or detract. The world will little note, nor long remember what we say "
    "here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here "
    "to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to "
    "be here dedicated to the great task remaining before us -- that from these honored dead we take increased "
    "devotion to that cause for which they gave the last full measure of devotion -- that we here highly "
    "resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth "
    "of freedom -- and that government of the people, by the people, for the people, shall not perish from "
    "the earth."
)
# per format: (max mean |delta logprob|, min top-1 agreement, max perplexity ratio) against fp32,
# each format with its default cache (bf16); the measured values on this text are in
# docs/quantization.md (with int8 activations, bf16 cache; then the float32 cache's)
BOUNDS = {
    "gguf-Q4_1": (0.14, 0.93, 1.03),  # measured: 0.086, 0.952, 1.0061 (float32 cache: 0.090, 0.968, 1.0101)
    "gguf-Q8_0": (0.2, 0.9, 1.03),  # measured: 0.150, 0.936, 1.0212 (0.144, 0.943, 1.0075)
    "gguf-Q4_0": (1.4, 0.45, 1.9),  # measured: 1.09, 0.554, 1.671 (1.09, 0.535, 1.706; Q4_1 weights rounded twice)
    "int8": (0.2, 0.87, 1.03),  # measured: 0.155, 0.920, 0.9995 (0.153, 0.901, 1.0093)
}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "1, 2, 3, 5, 8,"]


@pytest.fixture(scope="module")
def requantized(request, tmp_path_factory) -> dict[str, str]:
    """Q8_0 and Q4_0 files made once from the shipped Q4_1 file, kept in pytest's cache (in a
    temporary folder where the cache plugin is off: `-p no:cacheprovider`)."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("pagoda-requantized") if cache is not None else tmp_path_factory.mktemp("requantized")
    source = default_model_path()
    return {
        fmt: str(requantize_gguf(source, folder / f"SmolLM2-135M-Instruct.{fmt}.gguf", fmt)) for fmt in ("Q8_0", "Q4_0")
    }


def load(model: str | None, quantization: str) -> LLM:
    return LLM(model, quantization=quantization, kv_cache_memory=0.2, max_model_len=1024)


def scores(llm: LLM, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each position's logprob of the text's next token, and its top-1 token."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    positions = out.prompt_logprobs[1:]
    return [p[t].logprob for t, p in zip(ids[1:], positions)], [
        next(t for t, lp in p.items() if lp.rank == 1) for p in positions
    ]


@pytest.fixture(scope="module")
def fp32_scores(default_llm) -> tuple[list[int], tuple[list[float], list[int]]]:
    ids = default_llm.tokenizer.encode(TEXT)
    return ids, scores(default_llm, ids)


def assert_batch_invariant(llm: LLM) -> None:
    """Activations are quantized, so greedy output is not the float model's (the bounds say how
    close it is); but a request's tokens are the same alone as in a batch of four."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    batched = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_gguf_q4_1_batch_invariant_and_within_bounds(fp32_scores):
    llm = load(None, "gguf")
    assert llm.engine.core.runner.kv_caches[0].dtype == torch.bfloat16  # the quantized formats' default
    assert_batch_invariant(llm)
    check_bounds("gguf-Q4_1", llm, fp32_scores)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_requantized_gguf_within_bounds(requantized, fp32_scores, fmt):
    check_bounds(f"gguf-{fmt}", load(requantized[fmt], "gguf"), fp32_scores)


def test_int8_batch_invariant_and_within_bounds(default_model_dir, fp32_scores):
    llm = load(default_model_dir, "int8")
    assert_batch_invariant(llm)
    check_bounds("int8", llm, fp32_scores)


def check_bounds(name: str, llm: LLM, fp32_scores) -> None:
    ids, (ref_lp, ref_top) = fp32_scores
    lp, top = scores(llm, ids)
    mean_delta = sum(abs(a - b) for a, b in zip(ref_lp, lp)) / len(lp)
    agreement = sum(a == b for a, b in zip(ref_top, top)) / len(top)
    ppl_ratio = math.exp((sum(ref_lp) - sum(lp)) / len(lp))
    max_delta, min_agreement, max_ratio = BOUNDS[name]
    measured = f"{name}: mean |delta| {mean_delta:.2e}, top-1 {agreement:.3f}, perplexity ratio {ppl_ratio:.4f}"
    print(measured)
    assert mean_delta <= max_delta and agreement >= min_agreement and ppl_ratio <= max_ratio, measured


def test_rotary_row_order_undoes_llama_cpp_permutation():
    """llama.cpp's converter: w.reshape(heads, 2, D/2, ...).swapaxes(1, 2); the order undoes it."""
    heads, rows = 3, 24
    checkpoint = torch.arange(rows)
    in_file = checkpoint.reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    assert in_file[rotary_row_order(rows, heads)].tolist() == checkpoint.tolist()


def test_quantization_refused_where_it_cannot_serve(default_model_dir):
    with pytest.raises(ConfigError, match="needs a .gguf model file"):
        EngineArgs(default_model_dir, quantization="gguf").create_config()
    with pytest.raises(ConfigError, match="computes in float32"):
        EngineArgs(default_model_dir, quantization="int8", dtype="bfloat16").create_config()
    from pagoda.model_executor.quant_loader import unsupported_reason

    cpu_fp32 = (torch.device("cpu"), torch.float32, "phi-3.gguf")
    for architecture in ("Phi3ForCausalLM", "Qwen2ForCausalLM"):  # a fused attn_qkv; biases load_gguf leaves out
        assert "served dequantized" in unsupported_reason("gguf", *cpu_fp32, architecture)
    assert unsupported_reason("gguf", *cpu_fp32, "LlamaForCausalLM") is None


MEASURE_LOAD = """
import json, sys, torch
from pagoda.engine.args import EngineArgs
from pagoda.model_executor.loader import load_model
from pagoda.model_executor.quant_loader import resident_bytes
from pagoda.attention.selector import select_backend

config = EngineArgs(sys.argv[1] or None, quantization=sys.argv[2]).create_config()
backend = select_backend(config.attention_backend, torch.device("cpu"), torch.float32, config.model.head_dim)
def rss(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
baseline = rss("VmRSS")
model = load_model(config.model, backend, torch.device("cpu"))
lookup, head = model.quant_embedding, model.cpu_lm_head
shared = lookup is not None and head.weight is lookup.weight  # the tied head reads the quantized table
print(json.dumps({"growth": rss("VmHWM") - baseline, "resident": resident_bytes(model), "shared": shared}))
"""


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_loading_holds_no_float_copy(default_model_dir, quantization):
    """Peak RSS growth while loading, over the baseline after imports and config, stays below twice
    the weights the quantized model keeps (a float32 copy would be 6x for Q4_1, 4x for int8); the
    GGUF model's tied head is its quantized embedding table."""
    model = "" if quantization == "gguf" else default_model_dir
    done = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, model, quantization], capture_output=True, text=True, check=True
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["shared"] == (quantization == "gguf")  # int8: a float table for the lookup, int8 head
    assert measured["resident"] < 300 * 2**20  # the float model is 540 MB
    assert measured["growth"] < 2 * measured["resident"], measured
