"""The sampling defaults a model's generation_config.json sets, as vLLM reads them: the values a
request leaves unset take these before OpenAI's."""

from __future__ import annotations

from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys `generation_config` sets, and only those."""
    return {key: generation_config[key] for key in SAMPLING_KEYS if key in generation_config}
