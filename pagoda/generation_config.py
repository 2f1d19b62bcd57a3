"""The sampling defaults a model's generation_config.json sets, as vLLM reads them: the values a
request leaves unset take these before OpenAI's."""

from __future__ import annotations

from typing import Any

# the keys vLLM takes from it; transformers' max_new_tokens is SamplingParams' max_tokens
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys `generation_config` sets (not to null), and only those, by SamplingParams' names."""
    return {
        "max_tokens" if key == "max_new_tokens" else key: generation_config[key]
        for key in SAMPLING_KEYS
        if generation_config.get(key) is not None
    }
