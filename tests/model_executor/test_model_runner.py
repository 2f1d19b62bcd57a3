"""The model runner lays each batch out decodes first, as the attention backends' contract asks,
whatever the scheduler's order, and hands every result back in the step's order."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from tests.reference import assert_greedy_match, hf_greedy
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    return write_tiny_model("llama", tmp_path_factory.mktemp("runner") / "llama", load_tokenizer(None))


def test_a_prefill_scheduled_before_a_decode_runs_after_it(tiny_llama):
    # prefill_alone_threshold=0: the short prompts share the decode's step, the mixed batch under test
    llm = LLM(
        str(tiny_llama),
        block_size=4,
        kv_cache_memory=0.01,
        max_model_len=64,
        max_num_batched_tokens=100,
        prefill_alone_threshold=0,
    )
    engine, runner = llm.engine, llm.engine.core.runner
    steps, batches = [], []
    execute, build = runner.execute, runner.backend.build_metadata
    runner.execute = lambda step: steps.append([n for _, n in step.scheduled]) or execute(step)
    runner.backend.build_metadata = lambda inputs: batches.append(inputs) or build(inputs)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = {"warm": list(range(10, 19)), "d": [50, 51, 52], "q": list(range(200, 205)), "hit": list(range(10, 19))}

    engine.add_request(prompts["warm"], SamplingParams(temperature=0.0, max_tokens=1), "warm")
    engine.add_request(prompts["d"], greedy, "d")
    results = {u.request_id: u for u in engine.step() if u.finished}  # warm done and cached, d decoding
    engine.add_request(prompts["q"], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1), "q")
    engine.add_request(prompts["hit"], greedy, "hit")  # 8 of its 9 prompt tokens cached: one to compute
    while engine.has_unfinished:
        results.update({u.request_id: u for u in engine.step() if u.finished})

    mixed = steps.index([1, 5, 1])  # d decodes; q's prompt, then hit's last prompt token
    assert batches[mixed].query_lens_cpu == (1, 1, 5) and batches[mixed].num_decodes == 2
    assert all(set(b.query_lens_cpu[: b.num_decodes]) <= {1} for b in batches)
    assert all(1 not in b.query_lens_cpu[b.num_decodes :] for b in batches)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for name, prompt in prompts.items():
        want = hf_greedy(model, prompt, len(results[name].token_ids))
        assert_greedy_match(model, prompt, want, results[name].token_ids, [])
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompts["q"]])).logits[0, :-1], dim=-1)
    got = results["q"].prompt_logprobs[1:]
    assert [p.token_id for p in got] == prompts["q"][1:]
    torch.testing.assert_close(
        torch.tensor([p.logprob for p in got]), expected[range(4), prompts["q"][1:]], atol=1e-4, rtol=1e-4
    )


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's pages that are resident (mincore), whatever else the process allocates or frees."""
    import ctypes

    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, pages) == 0, os.strerror(ctypes.get_errno())
    return int((np.frombuffer(pages, dtype=np.uint8) & 1).sum()) * page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kv_cache_is_zero_aligned_and_resident_only_once_written(dtype):
    from pagoda.model_executor.model_runner import zeros_on_first_touch

    shape = (2, 8192, 16, 3, 64)  # 768 MiB of float32, 384 of bf16: one layer of a 24 GiB cache
    cache = zeros_on_first_touch(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0
    assert resident_bytes(cache) < 4 << 20, "resident right after allocating"
    block = cache[1, 4000]
    block.fill_(1.5)
    # writing one block makes its pages resident (a 2 MB huge page where the OS gives those), no more
    assert block.nbytes <= resident_bytes(cache) < 8 << 20
    assert float(cache[1, 4000].sum()) == 1.5 * block.numel()
    assert torch.count_nonzero(cache[1, 3999]) == 0 and torch.count_nonzero(cache[0, 100:200]) == 0


def test_the_cpu_kv_cache_is_faulted_in_at_idle_priority_without_changing_a_block():
    from pagoda.model_executor.model_runner import prefault_at_idle_priority, zeros_on_first_touch

    caches = [zeros_on_first_touch((2, 512, 16, 3, 64), torch.float32) for _ in range(3)]  # 12 MiB each
    caches[1][0, 7].fill_(2.5)  # a block written before the thread reaches it keeps its values
    prefault_at_idle_priority(caches).join(timeout=60)
    assert [resident_bytes(c) for c in caches] == [c.nbytes for c in caches]
    assert float(caches[1][0, 7].sum()) == 2.5 * caches[1][0, 7].numel()
    assert sum(torch.count_nonzero(c) for c in caches) == caches[1][0, 7].numel()

    # the thread never holds a cache: freeing them frees them here and then (a cache the thread
    # freed, on its way out, could abort the process at exit), and ends the thread
    caches = [zeros_on_first_touch((2, 16384, 16, 3, 64), torch.float32) for _ in range(8)]  # 3 GiB
    refs = [weakref.ref(c) for c in caches]
    thread = prefault_at_idle_priority(caches)
    del caches
    assert all(ref() is None for ref in refs)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_kv_cache_larger_than_the_memory_available_is_refused_at_load(tiny_llama):
    from pagoda.model_executor.model_runner import available_memory_bytes

    available = available_memory_bytes()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo here")
    with pytest.raises(ConfigError, match="larger than the memory available.*lower --kv-cache-memory"):
        LLM(str(tiny_llama), kv_cache_memory=2 * available / 2**30, max_model_len=64)
