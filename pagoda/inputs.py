"""vLLM's prompt shapes (`vllm.inputs`), for scripts that build their prompts with them: both are
plain dicts, which `LLM.generate` takes as they are."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # its prefix cache namespace


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]
