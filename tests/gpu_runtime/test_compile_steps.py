"""At startup on a GPU the engine runs one step of each of the attention backend's first-use shapes,
so that no request waits for Triton to compile a kernel variant. Triton's interpreter compiles
nothing (the shapes are empty on CPU), so here the shapes a GPU would get are run by hand, with the
Triton backend under the interpreter: each runs as the shape says, and the engine serves the same
tokens as transformers after them."""

from __future__ import annotations

import pytest
import torch
import triton

from pagoda import LLM, SamplingParams
from pagoda.attention import triton_kernels
from pagoda.attention.triton_backend import TritonAttentionBackend
from tests.reference import assert_greedy_match, hf_greedy


def gpu_shapes(num_heads, num_kv_heads, head_dim, dtype, max_model_len, monkeypatch):
    """first_use_shapes as on a GPU (the interpreter off while it is asked: Triton's knob reads the
    environment at each use, unless set, which would pin it for the rest of the session)."""
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        assert not triton.knobs.runtime.interpret
        return TritonAttentionBackend().first_use_shapes(num_heads, num_kv_heads, head_dim, dtype, max_model_len)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype",
    [
        (32, 8, 128, torch.bfloat16),
        (9, 3, 64, torch.float32),
        (16, 16, 256, torch.float16),
        (64, 2, 128, torch.bfloat16),
    ],
)
def test_shapes_meet_every_tile_config_and_a_split_decode(num_heads, num_kv_heads, head_dim, dtype, monkeypatch):
    shapes = gpu_shapes(num_heads, num_kv_heads, head_dim, dtype, 4096, monkeypatch)
    group = num_heads // num_kv_heads

    def config(query_len):
        return triton_kernels.choose_config(group, head_dim, dtype, query_len)

    prompts = [q for q, total in shapes if q == total]
    assert sorted({config(q) for q in prompts}, key=str) == sorted({config(q) for q in range(1, 4097)}, key=str)
    assert len(prompts) == len({config(q) for q in prompts})  # one step a config
    (split,) = [(q, total) for q, total in shapes if q < total]
    assert split[0] == 1
    assert triton_kernels.choose_decode_splits(1, num_kv_heads, split[1], num_sms=132) >= 2
    # a model too short to split has no split step; the interpreter, nothing to compile
    assert all(q == total for q, total in gpu_shapes(32, 8, 128, dtype, 300, monkeypatch))
    assert TritonAttentionBackend().first_use_shapes(32, 8, 128, dtype, 4096) == ()


def test_the_compile_steps_fit_the_kv_pool(tiny_llama, monkeypatch):
    """A pool smaller than a shape (a draft model's: its pool is not checked against max_model_len)
    skips it rather than writing past its blocks. Here the pool is cut to its first 3 blocks (the
    null block and 2 of 16 tokens), and every shape stays within max_model_len."""
    llm = LLM(str(tiny_llama), attention_backend="triton", kv_cache_memory=0.01, max_model_len=600)
    runner = llm.engine.core.runner
    monkeypatch.setattr(runner, "kv_caches", [kv[:, :3] for kv in runner.kv_caches])
    free_tokens = 2 * runner.block_size
    shapes = ((3, 3), (1, free_tokens), (1, free_tokens + 1))
    monkeypatch.setattr(runner.backend, "first_use_shapes", lambda *model_shapes: shapes)
    ran = []
    build = runner.backend.build_metadata
    record = lambda inputs: ran.append(inputs.seq_lens_cpu) or build(inputs)  # noqa: E731
    monkeypatch.setattr(runner.backend, "build_metadata", record)
    runner.compile_kernels()
    assert ran == [(3,), (free_tokens,)]


def test_the_engine_runs_the_shapes_at_startup_and_then_serves(tiny_llama, monkeypatch):
    # the tiny Llama's shapes: 4 heads of 16, 2 kv heads, float32
    shapes = gpu_shapes(4, 2, 16, torch.float32, 600, monkeypatch)
    assert shapes[-1] == (1, 512)  # a split decode
    monkeypatch.setattr(TritonAttentionBackend, "first_use_shapes", lambda self, *model_shapes: shapes)
    ran = []  # every step's (query lengths, lengths) from here: on CPU the compile steps are the first
    build = TritonAttentionBackend.build_metadata
    monkeypatch.setattr(
        TritonAttentionBackend,
        "build_metadata",
        lambda self, inputs: ran.append((inputs.query_lens_cpu, inputs.seq_lens_cpu)) or build(self, inputs),
    )
    llm = LLM(str(tiny_llama), attention_backend="triton", kv_cache_memory=0.01, max_model_len=600)
    assert ran == [((q,), (total,)) for q, total in shapes]

    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((3, 17, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    report: list[str] = []
    for prompt, tokens in zip(prompts, got):
        assert_greedy_match(model, prompt, hf_greedy(model, prompt, 6), tokens, report)
