"""Comparing greedy outputs with transformers under the project's near-tie rule: two greedy
sequences may differ only where the reference's top-2 logit margin is below 1e-3 (fp32)."""

from __future__ import annotations

import inspect

import torch

NEAR_TIE = 1e-3


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """transformers' greedy decoding with its own KV cache, stopping at any of `eos_ids`."""
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[int] = []
    step_ids, past = torch.tensor([prompt_ids]), None
    for _ in range(max_new_tokens):
        result = model(step_ids, use_cache=True, **{cache_arg: past})
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        step_ids = torch.tensor([[token]])
    return out


@torch.inference_mode()
def hf_margin(model, ids: list[int]) -> float:
    """The reference's top-2 logit margin for the token after `ids`."""
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_match(
    model, prompt_ids: list[int], expected: list[int], actual: list[int], report: list, near_tie: float = NEAR_TIE
) -> None:
    """Equal, or first diverging at a near-tie of the reference (recorded in `report`): a top-2
    margin below `near_tie`, the project's 1e-3 for float32 (a half-precision model's test passes
    the logprob tolerance it holds every token to)."""
    n = min(len(expected), len(actual))
    for i in range(n):
        if expected[i] != actual[i]:
            margin = hf_margin(model, prompt_ids + expected[:i])
            assert margin < near_tie, (
                f"diverged at output token {i}: reference {expected[i]} vs ours {actual[i]}, "
                f"reference top-2 margin {margin:.2e} is not a near-tie"
            )
            report.append(f"near-tie divergence at token {i} (margin {margin:.2e})")
            return
    assert len(expected) == len(actual), f"lengths differ: reference {len(expected)} vs ours {len(actual)}"
