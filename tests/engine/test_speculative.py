"""Speculative decoding never changes what a greedy request returns, and samples exactly the
target's distribution.

- n-gram lookup on the default model, several num_speculative_tokens: greedy outputs equal
  speculation off (near-tie rule against transformers), with real acceptance on an editing prompt;
  stop strings, stop tokens, max_tokens and logprobs as without speculation.
- A draft model: the model as its own draft and a deliberately bad one (a different random
  model of the same vocabulary) give the same greedy outputs.
- A tiny model with an oracle proposer (the outputs decoding one at a time gives, corrupted at
  random positions) and with a proposer that is always wrong: every acceptance length and every
  rollback, under preemption by a small pool, chunked prefill, the prefix cache, n > 1 and
  batches both below and above the speculation batch limit; KV integrity checked every step.
- Rejection sampling: a chi-square test of the joint distribution of two speculated tokens
  against the target's, computed exactly from transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import SPEC_MAX_BATCH_SIZE, SpeculativeConfig
from pagoda.core.spec_decode import NgramProposer, ngram_proposal
from pagoda.errors import ConfigError
from pagoda.model_files import apply_chat_template, default_model_path
from tests.reference import assert_greedy_match
from tests.tiny_models import write_tiny_model

EDIT_PROMPT = [
    {
        "role": "user",
        "content": "Rewrite this code with the variable `total` renamed to `acc`:\n```python\n"
        "def sum_list(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\n\ndef mean(values):\n    total = sum_list(values)\n"
        "    return total / len(values)\n```",
    }
]


# ---- the proposer ----------------------------------------------------------------------------
def test_ngram_proposal_takes_the_longest_then_the_most_recent_match():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_proposal(tokens, 2, 1, 3) == [9, 5]  # "1 2 3" at 0..2 beats the newer "2 3" at 5..6
    assert ngram_proposal(tokens, 2, 1, 2) == [7, 8]  # capped at 2: "2 3", newest first
    assert ngram_proposal(tokens, 5, 4, 5) == []  # nothing of 4 tokens recurs
    assert ngram_proposal([4, 4], 3, 1, 1) == [4]  # never proposes past the sequence's end
    assert ngram_proposal([1, 2, 3], 3, 1, 3) == []


def test_speculative_config_errors_name_the_field():
    from pagoda.engine.args import EngineArgs

    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}').speculative()
    with pytest.raises(ConfigError, match="method"):
        EngineArgs(speculative_config={"method": "eagle"}).speculative()
    with pytest.raises(ConfigError, match="unknown key"):
        EngineArgs(speculative_config={"prompt_lookup": 3}).speculative()
    with pytest.raises(ConfigError, match="quantization applies only to a draft model"):
        EngineArgs(speculative_config={"method": "ngram", "quantization": "gguf"}).speculative()
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngineArgs(speculative_config="{ngram").speculative()
    # a value of the wrong type is refused naming its key, not at the first draft (3.5 was, in a slice)
    for key, value in [("num_speculative_tokens", 3.5), ("num_speculative_tokens", "3"), ("max_batch_size", "8")]:
        with pytest.raises(ConfigError, match=f"speculative_config.{key} must be an integer, got {value!r}"):
            EngineArgs(speculative_config={key: value}).speculative()
    for key, value in [("num_speculative_tokens", True), ("prompt_lookup_max", None), ("prompt_lookup_min", 2.5)]:
        with pytest.raises(ConfigError, match=f"speculative_config.{key} must be an integer"):
            EngineArgs(speculative_config={key: value}).speculative()
    with pytest.raises(ConfigError, match="speculative_config.model must be a string, got 5"):
        EngineArgs(speculative_config={"model": 5}).speculative()
    spec = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}').speculative()
    assert spec == SpeculativeConfig(num_speculative_tokens=5)
    # each method's measured batch limit unless one is given: a draft model's passes cost more per request
    assert spec.max_batch_size == SPEC_MAX_BATCH_SIZE["ngram"]
    draft = SpeculativeConfig(method="draft_model", model="draft.gguf")
    assert draft.max_batch_size == SPEC_MAX_BATCH_SIZE["draft_model"] < spec.max_batch_size
    assert SpeculativeConfig(method="draft_model", model="draft.gguf", max_batch_size=6).max_batch_size == 6


# ---- the default model: n-gram lookup ------------------------------------------------------------
@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(
        kv_cache_memory=0.25,
        max_model_len=2048,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    )


def use_k(llm: LLM, k: int) -> None:
    llm.engine.core.scheduler.proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=k))


@pytest.mark.slow
def test_ngram_greedy_equals_plain_decoding_on_the_default_model(default_llm, ngram_llm, hf_reference):
    prompt = apply_chat_template(default_llm.tokenizer, EDIT_PROMPT)
    questions = [[{"role": "user", "content": q}] for q in ("Name three colors.", "Count from 1 to 12.")]
    prompts = [prompt] + [apply_chat_template(default_llm.tokenizer, q) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    report: list[str] = []
    for k in (1, 3, 5):
        use_k(ngram_llm, k)
        before = ngram_llm.engine.core.stats()
        got = [o.outputs[0].token_ids for o in ngram_llm.generate(prompts[:1], params, use_tqdm=False)]
        after = ngram_llm.engine.core.stats()
        got += [o.outputs[0].token_ids for o in ngram_llm.generate(prompts[1:], params, use_tqdm=False)]
        if default_llm.engine.config.deterministic and ngram_llm.engine.config.deterministic:
            assert got == expected  # batch-invariant kernels: verification rows score as decodes do
        for p, e, g in zip(prompts, expected, got):
            assert_greedy_match(hf_reference, list(p), e, g, report)
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        # the editing answer copies spans of its prompt (57% of 4-token drafts accepted when written)
        assert accepted > 0.3 * proposed, f"k={k}: {accepted} of {proposed} drafts accepted on an editing prompt"
        assert after.num_steps - before.num_steps < len(got[0]), "speculation saved no step"
    print(report)


@pytest.mark.slow
def test_ngram_keeps_stops_max_tokens_and_logprobs(default_llm, ngram_llm):
    use_k(ngram_llm, 4)
    prompt = apply_chat_template(default_llm.tokenizer, EDIT_PROMPT)
    plain = default_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)[0]
    text, ids = plain.outputs[0].text, plain.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=80, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=[ids[30]]),
        SamplingParams(temperature=0.0, max_tokens=37),
        SamplingParams(temperature=0.0, max_tokens=80, logprobs=2),
        SamplingParams(temperature=0.7, seed=3, max_tokens=80, logprobs=2),  # verified by the sampler's draws
    ]
    for params in cases:
        want = default_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = ngram_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for token, a, b in zip(got.token_ids, got.logprobs, want.logprobs):
                assert set(a) == set(b) and abs(a[token].logprob - b[token].logprob) < 1e-3


COPY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "tags", "admin"],
}


@pytest.mark.slow
def test_ngram_with_structured_outputs_on_the_default_model(default_llm, ngram_llm):
    """A JSON schema whose answer copies its prompt, a regex and a choice: greedy outputs of
    plain decoding, valid, and the JSON request's drafts accepted through the grammar's mask."""
    from pagoda.sampling_params import StructuredOutputsParams as S

    use_k(ngram_llm, 4)
    document = '{"name": "Ada Lovelace", "tags": ["math", "code", "poetry"], "admin": true}'
    asks = [f"Copy this JSON exactly, nothing else: {document}", "Give a code like 123-ab.", "Is water wet?"]
    prompts = [apply_chat_template(default_llm.tokenizer, [{"role": "user", "content": a}]) for a in asks]
    constraints = [S(json=COPY_SCHEMA), S(regex=GRAMMAR_REGEX), S(choice=GRAMMAR_CHOICES)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c, logprobs=1) for c in constraints]
    want = [o.outputs[0] for o in default_llm.generate(prompts, params, use_tqdm=False)]
    before = ngram_llm.engine.core.stats()
    got = [o.outputs[0] for o in ngram_llm.generate(prompts[:1], params[:1], use_tqdm=False)]
    after = ngram_llm.engine.core.stats()
    got += [o.outputs[0] for o in ngram_llm.generate(prompts[1:], params[1:], use_tqdm=False)]
    if default_llm.engine.config.deterministic and ngram_llm.engine.config.deterministic:
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].text == document  # the copy, drafted by lookup from the prompt
    for a, b in zip(got[0].logprobs, want[0].logprobs):  # the model's, before the mask
        assert set(a) == set(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    for p, out in zip(params, got):
        assert out.finish_reason == "stop"
        assert_follows_grammar(ngram_llm, p, list(out.token_ids))
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 0.5 * proposed > 0


@pytest.mark.slow
def test_ngram_with_a_thinking_budget_on_the_default_model(default_llm, ngram_llm):
    """A prompt the answer copies (drafts that would run past the budget): the end tag is forced
    after the budget's tokens as in plain decoding, and the drafts that pass it are cut there."""
    from pagoda.sampling_params import ReasoningSpan

    use_k(ngram_llm, 4)
    text = "one two three four five six seven eight nine ten eleven twelve"
    prompt = apply_chat_template(default_llm.tokenizer, [{"role": "user", "content": f"Repeat exactly: {text}"}])
    params = SamplingParams(
        temperature=0.0, max_tokens=30, reasoning=ReasoningSpan("</think>"), thinking_token_budget=6
    )
    want = default_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    before = ngram_llm.engine.core.stats()
    got = ngram_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    after = ngram_llm.engine.core.stats()
    end = default_llm.tokenizer.encode("</think>", add_special_tokens=False)
    assert list(got.token_ids[6 : 6 + len(end)]) == end
    if default_llm.engine.config.deterministic and ngram_llm.engine.config.deterministic:
        assert got.token_ids == want.token_ids
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens  # it did speculate


# ---- a tiny model: every acceptance length, rollback under preemption ----------------------------
class OracleProposer(NgramProposer):
    """Proposes what plain decoding produced, each draft token wrong with probability `error`."""

    def __init__(self, config: SpeculativeConfig, expected: dict[tuple[int, ...], list[int]], error: float) -> None:
        super().__init__(config)
        self.expected, self.error, self.rng = expected, error, random.Random(0)

    def draft(self, request, k):
        out = self.expected[tuple(request.prompt_token_ids)][request.num_output_tokens : request.num_output_tokens + k]
        return [t if self.rng.random() >= self.error else (t + 1) % 1000 for t in out]


TINY_LEN = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    path = write_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2", load_tokenizer(None))
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2  # K and V of 16 tokens, 2 kv heads of 16 dims, fp32, 2 layers
    engines = {
        spec: LLM(
            str(path),
            max_model_len=TINY_LEN,
            kv_cache_memory=24 * block_bytes / 2**30,  # a few requests at a time: preemption, eviction
            max_num_batched_tokens=64,  # chunked prefill
            # prompts share the decodes' steps, as on a GPU: with short prompts alone in their steps
            # the running set outgrows a max_batch_size of 3 before steps come that would speculate
            prefill_alone_threshold=0,
            speculative_config={"num_speculative_tokens": 3} if spec else None,
        )
        for spec in (False, True)
    }
    return path, engines


def run_checked(llm: LLM, prompts, params) -> list[list[list[int]]]:
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list[list[int]]] = {}
    while engine.has_unfinished:
        for update in engine.step():
            if update.finished:
                outputs.setdefault(update.request_id, []).append(update.token_ids)
        engine.core.check_integrity()
    assert engine.core.scheduler.kv.usage == 0.0
    return [outputs[i] for i in ids]


def tiny_workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [
        shared[: rng.randint(0, 40)] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 50))] for _ in range(10)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True, n=rng.choice([1, 1, 2]))
        for _ in prompts
    ]
    return prompts, params


@pytest.mark.parametrize(("k", "error", "max_batch"), [(1, 0.2, 4), (3, 0.3, 16), (5, 0.1, 3), (4, 1.0, 16)])
def test_verification_and_rollback_keep_greedy_outputs(tiny, k, error, max_batch):
    """error 1.0 is the deliberately bad draft: nothing accepted, outputs unchanged."""
    _, engines = tiny
    prompts, params = tiny_workload(k)
    want = run_checked(engines[False], prompts, params)
    expected = {tuple(p): w[0] for p, w in zip(prompts, want)}
    config = SpeculativeConfig(num_speculative_tokens=k, max_batch_size=max_batch)
    engines[True].engine.core.scheduler.proposer = OracleProposer(config, expected, error)
    before = engines[True].engine.core.stats()
    got = run_checked(engines[True], prompts, params)
    after = engines[True].engine.core.stats()
    assert got == want  # the same tiny model and kernels: exact, n > 1 siblings included
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert proposed > 0
    if error == 1.0:
        assert accepted == 0
    else:
        assert accepted > (1 - error) ** k * 0.5 * proposed / k
    assert after.num_preemptions > before.num_preemptions or k != 1  # k=1's workload is one that preempts


def test_ngram_on_the_tiny_model_keeps_greedy_outputs(tiny):
    _, engines = tiny
    prompts, params = tiny_workload(7)
    first = run_checked(engines[False], prompts, params)
    # each prompt, its own output, the prompt again: the lookup finds a continuation to propose
    prompts = [p + out[0][:20] + p for p, out in zip(prompts, first)]
    want = run_checked(engines[False], prompts, params)
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    engines[True].engine.core.scheduler.proposer = NgramProposer(config)
    before = engines[True].engine.core.stats()
    assert run_checked(engines[True], prompts, params) == want
    assert engines[True].engine.core.stats().spec_num_draft_tokens > before.spec_num_draft_tokens


# ---- structured outputs: drafts pass the grammar's mask ------------------------------------------
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
GRAMMAR_REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR_CHOICES = ["yes", "no", "maybe not"]


def constrained_workload(seed: int):
    """Constrained requests of each kind (a JSON schema, a regex, a choice), greedy and sampled,
    beside an unconstrained one; every constraint is bounded, so each ends complete."""
    from pagoda.sampling_params import StructuredOutputsParams as S

    rng = random.Random(seed)
    constraints = [S(json=GRAMMAR_SCHEMA), S(regex=GRAMMAR_REGEX), S(choice=GRAMMAR_CHOICES), S(json=GRAMMAR_SCHEMA)]
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 30))] for _ in range(len(constraints) + 1)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c) for c in constraints]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return prompts, params


def assert_follows_grammar(llm: LLM, params: SamplingParams, token_ids: list[int]) -> None:
    import json
    import re

    import jsonschema

    constraint = params.structured_outputs
    if constraint is None:
        return
    text = llm.tokenizer.decode(token_ids, skip_special_tokens=True)
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    else:
        assert text in constraint.choice, text


class CutRecorder(OracleProposer):
    """An oracle whose drafts are grammar-invalid from a random position on (`bad` there), and
    which records the drafts before and after the grammar's cut."""

    def __init__(self, config: SpeculativeConfig, expected, bad: int) -> None:
        super().__init__(config, expected, 0.0)
        self.bad, self.raw, self.cut = bad, [], []

    def draft(self, request, k):
        out = super().draft(request, k)
        if out and request.grammar is not None:
            out[self.rng.randrange(len(out)) :] = [self.bad] * (k - self.rng.randrange(len(out)))
        self.raw.append(list(out))
        return out

    def propose(self, requests):
        drafts = super().propose(requests)
        self.cut += [d for d in drafts.values() if d]
        return drafts


def test_constrained_requests_speculate_and_keep_their_greedy_outputs(tiny):
    """A JSON schema, a regex and a choice with speculation: the outputs of plain decoding, valid
    under the grammar. Drafts that are valid but wrong (the other JSON request's output) are
    rejected by verification under the mask; a proposer whose drafts turn grammar-invalid has
    them cut before verification. A sampled constrained request speculates and stays valid."""
    _, engines = tiny
    prompts, params = constrained_workload(3)
    want = run_checked(engines[False], prompts, params)
    for p, w in zip(params, want):
        assert_follows_grammar(engines[False], p, w[0])
    assert want[0] != want[3]  # the two JSON requests answer differently
    expected = {tuple(p): w[0] for p, w in zip(prompts, want)}
    swapped = {**expected, tuple(prompts[0]): want[3][0], tuple(prompts[3]): want[0][0]}
    sampled_prompt, sampled = (
        [7, 8, 9],
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, **{"structured_outputs": params[0].structured_outputs}),
    )
    swapped[tuple(sampled_prompt)] = want[0][0]
    config = SpeculativeConfig(num_speculative_tokens=3)
    spec = engines[True].engine.core.scheduler
    spec.proposer = OracleProposer(config, swapped, 0.0)
    before = spec.stats()
    got = run_checked(engines[True], prompts + [sampled_prompt], params + [sampled])
    after = spec.stats()
    assert got[:-1] == want
    assert_follows_grammar(engines[True], sampled, got[-1][0])
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < proposed
    # drafts turning grammar-invalid: " the" fits no position of these grammars
    bad = engines[True].tokenizer.encode(" the", add_special_tokens=False)[0]
    spec.proposer = recorder = CutRecorder(config, expected, bad)
    before = spec.stats()
    assert run_checked(engines[True], prompts, params) == want
    after = spec.stats()
    assert any(bad in d for d in recorder.raw) and not any(bad in d for d in recorder.cut)
    assert 0 < after.spec_num_draft_tokens - before.spec_num_draft_tokens <= sum(map(len, recorder.cut))
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens


def test_ngram_speculates_for_constrained_requests_on_the_tiny_model(tiny):
    """n-gram lookup for a JSON schema, a regex and a choice: each prompt holds its own earlier
    answer, so lookups find drafts, some of which the grammar and the target accept."""
    _, engines = tiny
    prompts, params = constrained_workload(3)
    prompts, params = prompts[:-1], params[:-1]  # the constrained requests alone: the counters are theirs
    first = run_checked(engines[False], prompts, params)
    prompts = [p + out[0] + p for p, out in zip(prompts, first)]
    want = run_checked(engines[False], prompts, params)
    spec = engines[True].engine.core.scheduler
    spec.proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    before = spec.stats()
    assert run_checked(engines[True], prompts, params) == want
    after = spec.stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    for p, w in zip(params, want):
        assert_follows_grammar(engines[True], p, w[0])


# ---- a draft model ------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["self", "bad"])
def test_a_draft_model_keeps_greedy_outputs(tiny, tmp_path_factory, draft):
    """The model as its own draft (every draft accepted) and a different random model of the same
    vocabulary (none accepted): the same outputs as plain decoding, under the small pool's
    preemptions, and the draft's own KV pool empty at the end; constrained requests too."""
    from pagoda.model_files import load_tokenizer

    path, engines = tiny
    draft_path = path if draft == "self" else tmp_path_factory.mktemp("draft") / "llama"
    if draft == "bad":
        write_tiny_model("llama", draft_path, load_tokenizer(None))
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2
    llm = LLM(
        str(path),
        max_model_len=TINY_LEN,
        kv_cache_memory=18 * block_bytes / 2**30,  # one max_model_len sequence and a little more
        max_num_batched_tokens=64,
        # every running request drafts, in batches of many (above the draft's default limit)
        speculative_config={"model": str(draft_path), "num_speculative_tokens": 3, "max_batch_size": 64},
    )
    prompts, params = tiny_workload(11)
    want = run_checked(engines[False], prompts, params)
    assert run_checked(llm, prompts, params) == want
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.num_preemptions > 0
    rate = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert rate > 0.95 if draft == "self" else rate < 0.05
    proposer = llm.engine.core.scheduler.proposer
    assert proposer.kv.usage == 0.0 and not proposer.mirrors
    sampled = llm.generate(prompts[:3], SamplingParams(temperature=1.0, max_tokens=20, seed=5), use_tqdm=False)
    again = llm.generate(prompts[:3], SamplingParams(temperature=1.0, max_tokens=20, seed=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in again]
    # constrained requests: the draft proposes without the grammar, which cuts its drafts
    prompts, params = constrained_workload(3)
    before = llm.engine.core.stats()
    assert run_checked(llm, prompts, params) == run_checked(engines[False], prompts, params)
    after = llm.engine.core.stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    if draft == "self":  # the valid part of its unconstrained argmax is the target's masked argmax
        assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens


@pytest.mark.slow
def test_the_quantized_file_drafts_for_its_fp32_load(default_llm):
    """The measured case: the default model's 4-bit file served natively (`"quantization": "gguf"`)
    drafts for the fp32 load of the same file, four requests drafted as one batch: the fp32
    model's greedy outputs exactly (the deterministic mode verifies k + 1 rows as it decodes
    one), and most drafts accepted."""
    llm = LLM(
        kv_cache_memory=0.25,
        max_model_len=2048,
        speculative_config={
            "model": default_model_path(),
            "quantization": "gguf",
            "num_speculative_tokens": 3,
            "max_batch_size": 4,  # above the draft's default (2): the four run as one batch
        },
    )
    proposer = llm.engine.core.scheduler.proposer
    assert proposer.runner.config.model.quantization == "gguf"
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens > 0.8 * stats.spec_num_draft_tokens > 0
    assert proposer.kv.usage == 0.0 and not proposer.mirrors


def test_a_draft_model_must_share_the_vocabulary(tiny, tmp_path):
    from pagoda.engine.args import EngineArgs
    from pagoda.model_files import load_tokenizer

    path, _ = tiny
    small = write_tiny_model("llama", tmp_path / "small", load_tokenizer(None), vocab_size=512)
    with pytest.raises(ConfigError, match="speculative_config.model: the draft's vocabulary"):
        EngineArgs(model=str(path), speculative_config={"model": str(small)}).create_config()


# ---- sampled verification: exactly the target's distribution, and plain decoding's tokens ----------
CHI2_SAMPLES = 3000
CHI2_ALPHA = 1e-3  # a correct sampler fails with probability 0.1% for a random choice of seeds


@torch.inference_mode()
def test_sampled_verification_matches_the_target_distribution_and_plain_decoding(tmp_path):
    """Token 1 is sampled by the prefill; tokens 2 and 3 by verifying two drafts. The joint of
    (t1, t2, t3) under top-k 4 at temperature 1 is computed exactly from transformers; a
    chi-square test compares the counts of 3000 seeded requests with it. Each seeded request's
    tokens are also those it gets without speculation (as when its batch is too large to speculate)."""
    from transformers import AutoModelForCausalLM

    from pagoda.model_files import load_tokenizer

    # a vocabulary of 512: the sampler's sort over it is cheap for thousands of requests
    path = write_tiny_model("llama", tmp_path / "llama", load_tokenizer(None), vocab_size=512)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [11, 22, 33, 44, 55]
    top_k = 4

    def dist(ids):
        logits = model(torch.tensor([ids])).logits[0, -1]
        values, tokens = logits.topk(top_k)
        return dict(zip(tokens.tolist(), values.softmax(-1).tolist()))

    expected: dict[tuple[int, ...], float] = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist(prompt + [t1]).items():
            for t3, p3 in dist(prompt + [t1, t2]).items():
                expected[(t1, t2, t3)] = p1 * p2 * p3
    # drafts: likely but not certain tokens of the most likely path, so both verdicts happen
    first = max(dist(prompt).items(), key=lambda kv: kv[1])[0]
    second = sorted(dist(prompt + [first]).items(), key=lambda kv: -kv[1])[1][0]
    third = max(dist(prompt + [first, second]).items(), key=lambda kv: kv[1])[0]

    class Fixed(NgramProposer):
        def draft(self, request, k):
            return [second, third][:k]

    # a pool for hundreds of requests at a time (the fixture's small one would run them a few at a time)
    llm = LLM(str(path), max_model_len=TINY_LEN, kv_cache_memory=0.05, max_num_batched_tokens=4096)
    llm.engine.core.scheduler.proposer = Fixed(SpeculativeConfig(num_speculative_tokens=2, max_batch_size=4096))
    before = llm.engine.core.stats()
    params = [
        SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, seed=s) for s in range(CHI2_SAMPLES)
    ]
    outs = llm.generate([prompt] * CHI2_SAMPLES, params, use_tqdm=False)
    after = llm.engine.core.stats()
    assert after.spec_num_drafts - before.spec_num_drafts == CHI2_SAMPLES
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids)
        assert key in expected, f"{key} is outside the target's support"
        counts[key] = counts.get(key, 0) + 1
    # cells expected fewer than 5 times are pooled into one
    stat, cells, pooled_e, pooled_o = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e, o = p * CHI2_SAMPLES, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    dof = cells - 1
    p_value = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    assert p_value > CHI2_ALPHA, f"chi-square {stat:.1f} on {dof} dof: p = {p_value:.2e}"
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < 2 * CHI2_SAMPLES  # drafts were accepted and rejected
    llm.engine.core.scheduler.proposer = None
    plain = llm.generate([prompt] * CHI2_SAMPLES, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
