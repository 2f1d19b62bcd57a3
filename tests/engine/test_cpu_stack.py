"""The C decoder stack (model_executor/cpu_stack.py, csrc/decoder.c): it takes every step of the
models it covers (prefill chunks, decodes, and both in one step), and every logprob, of prompt and
output tokens, is bitwise (==) what the module loop gives on the same requests: float32 on the
batch-invariant GEMM (with qkv biases: Qwen2; q/k norms: Qwen3), GGUF's Q4_1 and int8 (on AMX machines past 16 rows
a step, the int8 linears' tiles), and bfloat16 on AMX tiles. Models it does not cover run the modules."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model_executor.cpu_stack import CpuDecoderStack, chunk_tails_read
from tests.attention.helpers import make_inputs
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels cannot be built on this machine")
AMX = cpu_kernels.load() is not None and cpu_kernels.load().amx

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=1)
# without prompt logprobs a step reads the hidden states of the rows that sample only (its decodes,
# its chunks' last rows where they end a prompt), and the stack's last layer computes those only
NO_PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)


def outputs(llm: LLM, prompts) -> list[tuple]:
    done = llm.generate(prompts, PARAMS, use_tqdm=False)
    done_reading_some = llm.generate(prompts, NO_PROMPT_LOGPROBS, use_tqdm=False)
    # a new long prompt alone (not cached by the runs above): its first chunks' steps read no row
    alone = llm.generate([prompts[-1][::-1]], NO_PROMPT_LOGPROBS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in done] + [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done_reading_some + alone
    ]


def stack_steps(llm: LLM, monkeypatch) -> list[tuple[int, int]]:
    """The rows of each step the stack takes from now on, and how many of them the step reads (by
    wrapping its forward)."""
    stack = llm.engine.core.runner.model.cpu_stack
    assert isinstance(stack, CpuDecoderStack)
    rows: list[tuple[int, int]] = []
    forward = stack.forward

    def counted(embeddings, positions, kv_caches, metadata, read_rows=None):
        out = forward(embeddings, positions, kv_caches, metadata, read_rows)
        assert out[0].shape[0] == (embeddings.shape[0] if read_rows is None else len(read_rows))
        rows.append((embeddings.shape[0], out[0].shape[0]))
        return out

    monkeypatch.setattr(stack, "forward", counted)
    return rows


def assert_stack_equals_modules(model: str, prompts, monkeypatch, **engine_args) -> list[int]:
    """Each prompt's tokens and logprobs with the stack == without it (a fresh engine each, so no
    cached prefix crosses over), with prompt logprobs (every row read) and without (the rows that
    sample only, among them none of a chunk that does not end its prompt); returns the rows of the
    steps the stack took. Steps of at most 64 tokens: a long prompt's chunks share steps with the
    others' decodes."""
    engine_args = dict(max_model_len=512, kv_cache_memory=0.05, max_num_batched_tokens=64, **engine_args)
    with_stack = LLM(model, **engine_args)
    steps = stack_steps(with_stack, monkeypatch)
    got = outputs(with_stack, prompts)
    with_stack.engine.close()
    modules = LLM(model, **engine_args)
    modules.engine.core.runner.model.cpu_stack = None
    want = outputs(modules, prompts)
    modules.engine.close()
    assert got == want
    assert all(len(lp) == PARAMS.max_tokens and len(plp) == len(p) for (_, lp, plp), p in zip(got, prompts))
    assert any(0 < out < rows for rows, out in steps)  # steps that read some of their rows only
    assert any(rows > 1 and out == 0 for rows, out in steps)  # and none
    return [rows for rows, _ in steps]


def prompts_of(count: int) -> list[list[int]]:
    """`count` short prompts, then one of 200 tokens"""
    short = [[100 + 37 * i + j for j in range(3 + 5 * i)] for i in range(count)]
    return short + [[(7 * j) % 1500 + 50 for j in range(200)]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "smollm3", "granite", "phi3"])
def test_float32_tiny_models(arch, tmp_path, monkeypatch):
    from pagoda.model_files import load_tokenizer

    model = write_tiny_model(arch, tmp_path / arch, load_tokenizer(None), vocab_size=2048)
    rows = assert_stack_equals_modules(str(model), prompts_of(4), monkeypatch)
    assert 64 in rows and 1 in rows  # full steps (the long prompt's chunks beside decodes) and a lone decode


def test_default_model_gguf(monkeypatch):
    from pagoda.model_files import default_model_path

    rows = assert_stack_equals_modules(default_model_path(), prompts_of(3), monkeypatch, quantization="gguf")
    assert 64 in rows and 1 in rows


@pytest.mark.skipif(not AMX, reason="bf16 linears go on AMX tiles only where the CPU and OS give them")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "granite"])
def test_bfloat16_tiny_models(arch, tmp_path, monkeypatch):
    """The GEMV for lone decodes, the tile GEMM otherwise, attention on widened rows."""
    from pagoda.model_files import load_tokenizer

    model = write_tiny_model(arch, tmp_path / arch, load_tokenizer(None), vocab_size=2048)
    rows = assert_stack_equals_modules(str(model), prompts_of(4), monkeypatch, dtype="bfloat16")
    assert 64 in rows and 1 in rows


def test_int8_with_a_bias(tmp_path, monkeypatch):
    from pagoda.model_files import load_tokenizer

    model = write_tiny_model("qwen2", tmp_path / "qwen2", load_tokenizer(None), vocab_size=2048)
    rows = assert_stack_equals_modules(str(model), prompts_of(18), monkeypatch, quantization="int8")
    assert max(rows) >= 16  # AMX tiles where the CPU has them


def test_models_it_does_not_cover_run_the_modules(tmp_path, monkeypatch):
    from pagoda.model_files import load_tokenizer

    llama = write_tiny_model("llama", tmp_path / "llama", load_tokenizer(None), vocab_size=2048)
    fast = LLM(str(llama), max_model_len=512, kv_cache_memory=0.05, deterministic=False)  # oneDNN linears
    assert fast.engine.core.runner.model.cpu_stack is None
    fast.engine.close()
    monkeypatch.setattr(cpu_kernels.load(), "amx", False)  # bf16 linears on oneDNN (or torch), as without AMX
    bf16 = LLM(str(llama), max_model_len=512, kv_cache_memory=0.05, dtype="bfloat16")
    assert bf16.engine.core.runner.model.cpu_stack is None
    bf16.engine.close()


# (step: decodes then chunks as (context, new tokens), rows read, whether the last layer computes
# only those: the decodes and a run of last rows of each chunk)
READ_CASES = [
    ([(10, 1), (20, 1), (10, 5), (0, 7), (20, 3)], [0, 1, 16], True),  # one chunk (rows 14-16) ends its prompt
    ([(10, 1), (20, 1), (10, 5), (0, 7), (20, 3)], [0, 1, 6, 13, 15, 16], True),  # every chunk, some rows
    ([(10, 5), (0, 7), (20, 3)], [], True),  # nothing read: chunks that do not end their prompts
    ([(0, 60), (100, 40)], [59, 97, 98, 99], True),  # a verifier's last rows
    ([(10, 1), (20, 1), (10, 5)], [1, 6], False),  # a decode not read
    ([(10, 1), (20, 1), (10, 5)], [0, 1, 3, 4], False),  # not the chunk's (rows 2-6) last rows
]


def test_rows_read_are_the_same_bits(tmp_path):
    """A step's rows read, computed alone past the last layer's attention (or where they are not
    the decodes and chunk tails, all rows computed and those returned), are bitwise the rows of the
    full step, and every row's keys and values are stored alike."""
    from pagoda.model_files import load_tokenizer

    model_dir = write_tiny_model("llama", tmp_path / "llama", load_tokenizer(None), vocab_size=2048)
    llm = LLM(str(model_dir), max_model_len=512, kv_cache_memory=0.05)
    runner = llm.engine.core.runner
    model = runner.model

    def forward(requests, read_rows):
        generator = torch.Generator().manual_seed(0)
        query_lens, seq_lens = [n for _, n in requests], [c + n for c, n in requests]
        blocks = sum(-(-s // runner.block_size) for s in seq_lens) + 4
        inputs = make_inputs(query_lens, seq_lens, runner.block_size, blocks, generator)
        positions = torch.cat([torch.arange(c, c + n) for c, n in requests])
        metadata = runner.backend.build_metadata(inputs)
        for cache in runner.kv_caches:  # the contexts' keys and values
            cache.copy_(torch.randn(cache.shape, generator=generator))
        ids = torch.randint(0, 2048, positions.shape, generator=generator)
        read = None if read_rows is None else torch.tensor(read_rows, dtype=torch.long)
        hidden = model(ids, positions, runner.kv_caches, metadata, read)
        return hidden, [cache.clone() for cache in runner.kv_caches], metadata

    for requests, read_rows, trimmed in READ_CASES:
        every, caches, metadata = forward(requests, None)
        read, read_caches, _ = forward(requests, read_rows)
        assert (chunk_tails_read(metadata, read_rows) is not None) == trimmed, (requests, read_rows)
        assert torch.equal(read, every[read_rows]), (requests, read_rows)
        assert all(torch.equal(a, b) for a, b in zip(caches, read_caches)), (requests, read_rows)
    llm.engine.close()
