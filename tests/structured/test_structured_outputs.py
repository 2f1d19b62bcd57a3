"""Structured outputs on the default model, offline: every constrained output is valid by
construction, unconstrained neighbours are untouched, and preemption keeps a grammar's place."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import ReasoningSpan, SamplingParamsError, StructuredOutputsParams
from pagoda.structured.compiler import GrammarError

from .schemas import MAX_TOKENS, SCHEMAS


def chat(llm: LLM, text: str) -> list[int]:
    from pagoda.model_files import apply_chat_template

    return apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}])


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def assert_valid(text: str, schema: dict, label: str) -> None:
    try:
        document = json.loads(text)
    except ValueError as exc:
        pytest.fail(f"{label}: not JSON ({exc}): {text!r}")
    jsonschema.validate(document, schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_gives_valid_json(default_llm, temperature: float) -> None:
    names = list(SCHEMAS)
    prompts = [chat(default_llm, f"Give me an example of {name} as JSON.") for name in names]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=MAX_TOKENS,
            structured_outputs=constrained(json=SCHEMAS[name]),
        )
        for i, name in enumerate(names)
    ]
    results = default_llm.generate(prompts, params)
    for name, result in zip(names, results):
        out = result.outputs[0]
        assert out.finish_reason == "stop", (
            f"{name}: {out.finish_reason} after {len(out.token_ids)} tokens: {out.text!r}"
        )
        assert_valid(out.text, SCHEMAS[name], name)


def test_regex_choice_grammar_and_json_object(default_llm) -> None:
    prompt = chat(default_llm, "Answer briefly.")
    cases = {
        "regex": constrained(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "choice": constrained(choice=["yes", "no", "maybe not"]),
        "grammar": constrained(grammar='root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'),
        "json_object": constrained(json_object=True),
    }
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c) for c in cases.values()]
    regex, choice, grammar, json_object = (r.outputs[0] for r in default_llm.generate([prompt] * 4, params))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", regex.text), regex.text
    assert choice.text in ("yes", "no", "maybe not")
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", grammar.text), grammar.text
    assert isinstance(json.loads(json_object.text), dict)
    assert {o.finish_reason for o in (regex, choice, grammar, json_object)} == {"stop"}


def test_n_sequences_each_follow_the_grammar(default_llm) -> None:
    schema = SCHEMAS["several required of each type"]
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, structured_outputs=constrained(json=schema)
    )
    (result,) = default_llm.generate([chat(default_llm, "Describe an item as JSON.")], params)
    assert len(result.outputs) == 3
    for out in result.outputs:
        assert out.finish_reason == "stop"
        assert_valid(out.text, schema, f"sequence {out.index}")
    assert len({out.text for out in result.outputs}) > 1  # each sibling samples its own path


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(default_llm) -> None:
    plain = [chat(default_llm, text) for text in ("Name a fruit.", "Count to five.", "Say hello in French.")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [default_llm.generate([p], greedy)[0].outputs[0].token_ids for p in plain]
    schema = SCHEMAS["nested object"]
    json_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constrained(json=schema))
    mixed = default_llm.generate(plain + plain, [greedy] * 3 + [json_params] * 3)
    assert [r.outputs[0].token_ids for r in mixed[:3]] == alone
    for r in mixed[3:]:
        assert_valid(r.outputs[0].text, schema, "constrained neighbour")


def test_min_tokens_does_not_hold_a_complete_grammar_open(default_llm) -> None:
    schema = SCHEMAS["boolean"]
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, structured_outputs=constrained(json=schema))
    (result,) = default_llm.generate([chat(default_llm, "Is it true?")], params)
    out = result.outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 30
    assert_valid(out.text, schema, "with min_tokens")


def test_a_thinking_budget_ends_the_thinking_and_changes_nothing_else(default_llm) -> None:
    """Thinking from the first token (deepseek_r1's span), greedy, a budget of 5: the output's first
    5 tokens are the unbounded output's, then the end tag's tokens, then what greedy decoding goes
    on with from there (the same tokens as a prompt); a neighbour in the same batch is unchanged,
    a budget of -1 is none (vLLM's), and settings that would ban the tag do not stop it."""
    prompt = chat(default_llm, "Why is the sky blue?")
    end = default_llm.tokenizer.encode("</think>", add_special_tokens=False)
    free = SamplingParams(temperature=0.0, max_tokens=20)
    bounded = SamplingParams(
        temperature=0.0, max_tokens=20, reasoning=ReasoningSpan("</think>"), thinking_token_budget=5
    )
    unbounded = SamplingParams(
        temperature=0.0, max_tokens=20, reasoning=ReasoningSpan("</think>"), thinking_token_budget=-1
    )
    banning = dataclasses.replace(bounded, bad_words=("think",), min_tokens=8, stop_token_ids=(end[0],))
    outputs = default_llm.generate([prompt] * 4, [free, bounded, unbounded, banning])
    alone, cut, uncut, banned = (r.outputs[0].token_ids for r in outputs)
    assert uncut == alone and len(alone) == 20 and end[0] not in alone
    assert cut[:5] == alone[:5] and cut[5:8] == end
    assert banned[:8] == cut[:8] and outputs[3].outputs[0].finish_reason == "length"
    (after,) = default_llm.generate([prompt + cut[:8]], SamplingParams(temperature=0.0, max_tokens=12))
    assert cut[8:] == after.outputs[0].token_ids
    with pytest.raises(SamplingParamsError, match="thinking"):
        SamplingParams(thinking_token_budget=5)


def test_preemption_in_the_middle_of_a_constrained_output_still_ends_valid() -> None:
    # 0.02 GiB holds 29 blocks of 16 tokens: six requests of ~30 + 120 tokens cannot all stay.
    llm = LLM(kv_cache_memory=0.02, max_model_len=256, enable_prefix_caching=False)
    schema = SCHEMAS["array of objects"]
    prompts = [chat(llm, f"List people number {i} as JSON.") for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constrained(json=schema))
    results = llm.generate(prompts, params)
    assert llm.engine.core.stats().num_preemptions > 0
    for result in results:
        assert result.outputs[0].finish_reason == "stop"
        assert_valid(result.outputs[0].text, schema, "after preemption")
    llm.engine.close()


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "invalid JSON schema"),
        ({"regex": "([a-z]"}, "parenthesis is not closed"),
        ({"grammar": "root ::= missing_rule"}, 'Rule "missing_rule" is not defined'),
        (
            {"json": {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}, "strict": True},
            "`uniqueItems` at",
        ),
    ],
)
def test_a_constraint_the_library_refuses_is_a_grammar_error(default_llm, kwargs, reason) -> None:
    params = SamplingParams(max_tokens=8, structured_outputs=constrained(**kwargs))
    with pytest.raises(GrammarError, match=reason):
        default_llm.generate([chat(default_llm, "Hi")], params)
    assert not default_llm.engine.has_unfinished
