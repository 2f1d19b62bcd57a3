"""Engine behaviour on the default model: stop conditions, aborts, n > 1 sharing, logprobs,
incremental detokenization."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.engine.detokenizer import IncrementalDetokenizer, text_decoder
from pagoda.model_files import apply_chat_template

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_prompt(default_llm):
    return apply_chat_template(default_llm.tokenizer, QUESTION)


def generate_one(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_eos_ends_the_answer(default_llm, chat_prompt):
    out = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=64).outputs[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    assert out.token_ids[-1] in default_llm.engine.config.model.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_ignore_eos_and_max_tokens(default_llm, chat_prompt):
    out = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=20, ignore_eos=True).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_stop_string_is_cut_and_reported(default_llm, chat_prompt):
    full = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=64).outputs[0].text
    out = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=64, stop=["Paris"]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == full[: full.index("Paris")]
    kept = generate_one(
        default_llm, chat_prompt, temperature=0.0, max_tokens=64, stop=["Paris"], include_stop_str_in_output=True
    ).outputs[0]
    assert kept.text == full[: full.index("Paris") + len("Paris")]
    # vLLM's rule: a stop string counts only in the text after the first min_tokens tokens
    late = generate_one(
        default_llm, chat_prompt, temperature=0.0, max_tokens=40, min_tokens=20, stop=["Paris"]
    ).outputs[0]
    assert late.text.startswith(full[: full.index("Paris") + len("Paris")]) and len(late.token_ids) >= 20


def test_stop_token_ids(default_llm, chat_prompt):
    full = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=64).outputs[0]
    stop_token = full.token_ids[3]
    out = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=64, stop_token_ids=[stop_token]).outputs[0]
    assert out.token_ids == full.token_ids[:4] and out.stop_reason == stop_token
    # the stop token's text is left out (vLLM's rule), unless asked into the output
    before = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=3).outputs[0].text
    through = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=4).outputs[0].text
    kept = generate_one(
        default_llm,
        chat_prompt,
        temperature=0.0,
        max_tokens=64,
        stop_token_ids=[stop_token],
        include_stop_str_in_output=True,
    ).outputs[0]
    assert before != through and out.text == before and kept.text == through


def _contains(ids: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(part)]) == part for i in range(len(ids) - len(part) + 1))


def test_allowed_token_ids_and_bad_words(default_llm, chat_prompt):
    """vLLM's allowed_token_ids (only those sampled) and bad_words (a word's tokens never completed):
    greedy output is the plain one up to where it would have broken them."""
    full = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=32, ignore_eos=True).outputs[0]
    allowed = sorted(set(full.token_ids[1:6]) - {full.token_ids[0]})
    for temperature in (0.0, 1.0):
        out = generate_one(
            default_llm, chat_prompt, temperature=temperature, seed=1, max_tokens=12, allowed_token_ids=allowed
        )
        assert set(out.outputs[0].token_ids) <= set(allowed)
    spaced = tuple(default_llm.tokenizer.encode(" Paris", add_special_tokens=False))
    assert _contains(full.token_ids, spaced)  # the precondition: greedy output says " Paris"
    at = next(i for i in range(len(full.token_ids)) if tuple(full.token_ids[i : i + len(spaced)]) == spaced)
    banned = generate_one(
        default_llm, chat_prompt, temperature=0.0, max_tokens=32, ignore_eos=True, bad_words=["Paris"]
    ).outputs[0]
    assert not _contains(banned.token_ids, spaced)
    assert banned.token_ids[: at + len(spaced) - 1] == full.token_ids[: at + len(spaced) - 1]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        generate_one(default_llm, chat_prompt, allowed_token_ids=[default_llm.engine.config.model.vocab_size])
    eos = sorted(default_llm.engine.config.model.eos_token_ids)
    with pytest.raises(ValueError, match="only stop tokens, which min_tokens bans"):
        generate_one(default_llm, chat_prompt, allowed_token_ids=eos, min_tokens=3)
    (paris,) = default_llm.tokenizer.encode(" Paris", add_special_tokens=False)  # one token: banned every step
    with pytest.raises(ValueError, match="every token allowed_token_ids holds is one of bad_words") as refused:
        generate_one(default_llm, chat_prompt, allowed_token_ids=[paris], bad_words=[" Paris"])
    assert refused.value.param == "allowed_token_ids"


def test_max_model_len_ends_a_request(default_llm):
    limit = default_llm.engine.config.model.max_model_len
    prompt = list(range(1000, 1000 + limit - 5))
    out = generate_one(default_llm, prompt, temperature=0.0, max_tokens=None, ignore_eos=True).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_too_long_prompt_is_rejected_and_the_queue_goes_on(default_llm, chat_prompt):
    limit = default_llm.engine.config.model.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {limit}"):
        default_llm.generate([list(range(limit + 10))], SamplingParams(max_tokens=4))
    assert generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=4).outputs[0].token_ids


def test_abort_frees_blocks_at_once(default_llm, chat_prompt):
    engine = default_llm.engine
    rid = engine.add_request(chat_prompt, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.core.scheduler.running
    engine.core.finish_requests([f"{rid}#0"], "abort")
    engine.core.check_integrity()
    assert not engine.core.scheduler.running and engine.core.scheduler.kv.usage == 0.0
    engine.outputs.drop(f"{rid}#0")


def test_n_samples_share_the_prompt_blocks(default_llm, chat_prompt):
    core = default_llm.engine.core
    assert core.reset_prefix_cache()
    hits_before = core.stats().prefix_cache_hits
    result = generate_one(default_llm, chat_prompt, temperature=1.0, seed=3, n=4, max_tokens=12)
    assert len(result.outputs) == 4 and [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1  # different samples
    block_size = core.scheduler.kv.block_size
    shared = (len(chat_prompt) - 1) // block_size * block_size
    assert core.stats().prefix_cache_hits - hits_before == 3 * shared  # siblings 1..3 took the prompt from sibling 0
    again = generate_one(default_llm, chat_prompt, temperature=1.0, seed=3, n=4, max_tokens=12)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in result.outputs]  # seeded


def test_logprobs_and_prompt_logprobs(default_llm, chat_prompt):
    result = generate_one(default_llm, chat_prompt, temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = result.outputs[0]
    assert len(out.logprobs) == 5
    for token, position in zip(out.token_ids, out.logprobs):
        chosen = position[token]
        assert chosen.rank == 1 and chosen.logprob <= 0 and len(position) == 3  # greedy: the chosen is the top one
        assert chosen.decoded_token == default_llm.tokenizer.decode([token])
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(chat_prompt)
    assert all(t in p for p, t in zip(result.prompt_logprobs[1:], chat_prompt[1:]))


def test_incremental_detokenization_never_breaks_characters(default_llm):
    tokenizer = default_llm.tokenizer
    text = "Café naïve — 世界 says 🎉🐍 and ⅞ of ünïcödé"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens held back mid-character


def test_an_output_cut_inside_a_character_leaves_it_out(default_llm):
    """As vLLM: max_tokens that ends an output amid a character's bytes drops the partial character
    rather than ending the text in U+FFFD."""
    tokenizer = default_llm.tokenizer
    ids = tokenizer.encode("Party 🎉", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    text = "".join(detok.add(t) for t in ids[:cut]) + detok.flush()
    assert text == tokenizer.decode(ids[:cut]).rstrip("\ufffd") == "Party "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_decoder_is_the_tokenizers_decode(default_llm, skip_special_tokens):
    """The detokenizer decodes straight through the `tokenizers` backend where transformers' decode
    only wraps it: the same text for every window, special tokens skipped or kept."""
    tokenizer = default_llm.tokenizer
    decode = text_decoder(tokenizer, skip_special_tokens)
    assert decode.__code__.co_names == ("decode",) and "backend" in decode.__code__.co_freevars  # the fast path
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Café — 世界 🎉 ⅞"}], tokenize=False)
    ids = tokenizer.encode(chat)
    assert any(i in tokenizer.all_special_ids for i in ids)
    for start in range(len(ids)):
        for end in range(start, min(len(ids), start + 6) + 1):
            assert decode(ids[start:end]) == tokenizer.decode(ids[start:end], skip_special_tokens=skip_special_tokens)
