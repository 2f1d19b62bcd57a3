"""The analyzer's prediction against Pagoda's own engine, without the server: run requests one at
a time through the offline engine (whose prefix cache holds them all), log them as the server
would, and check that the predicted cached tokens (block granularity, unlimited cache) are
exactly the engine's `num_cached_tokens` for every request."""

from __future__ import annotations

import json
import uuid

import pytest

from pagoda.analyze.pipeline import analyze_log
from pagoda.analyze.tokenize import PromptTokenizer
from pagoda.sampling_params import SamplingParams

from .conftest import STORY, SYSTEM

pytestmark = pytest.mark.slow


def test_predicted_cached_tokens_match_the_engine(default_llm, default_tokenizer, tmp_path):
    from pagoda.model_files import apply_chat_template

    # The engine is shared with other tests: a fresh first block keeps their cached prefixes out.
    nonce = f"[session {uuid.uuid4().hex}] "
    params = SamplingParams(max_tokens=3, temperature=0.0)  # short: each engine step is slow on CPU
    lines: list[dict] = []

    def run(prompt_ids: list[int]) -> str:
        [result] = default_llm.generate([prompt_ids], params)
        output = result.outputs[0]
        lines.append(
            {
                "timestamp": float(len(lines)),
                "prompt_token_ids": prompt_ids,
                "output_token_ids": output.token_ids,
                "cached_tokens": result.num_cached_tokens,
            }
        )
        return output.text

    def chat(messages: list[dict]) -> str:
        return run(apply_chat_template(default_tokenizer, messages))

    first_turn = [
        {"role": "system", "content": nonce + SYSTEM},
        {"role": "user", "content": "Where is the Eiffel Tower?"},
    ]
    answer = chat(first_turn)
    chat([first_turn[0], {"role": "user", "content": "Where is the Colosseum?"}])
    chat(first_turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": "How tall is it?"}])
    chat(first_turn)  # a repeat: every block but the last is reused, one token is computed
    for prompt in (nonce + STORY, nonce + STORY + " sailed without lights"):
        run(default_tokenizer.encode(prompt))

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    reported = [line["cached_tokens"] for line in lines]
    predicted = analyze_log(log, PromptTokenizer(None, tokenizer=default_tokenizer)).simulation.reusable("block")
    assert all(reported[i] > 0 for i in (1, 2, 3, 5)), reported
    assert predicted.tolist() == reported
