"""Tokenizers for the benchmark, loaded only when needed: importing transformers takes seconds,
and a run against a server that reports `usage` needs one only to build synthetic prompts."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagoda.bench.errors import BenchError

DEFAULT = "default"  # the tokenizer of Pagoda's default model


class Tokenizer:
    """The few operations the benchmark needs, over a Hugging Face tokenizer."""

    def __init__(self, hf: Any, source: str) -> None:
        self.source = source
        self._hf = hf
        self._special = frozenset(hf.all_special_ids)
        self._vocab_size = len(hf)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids))

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            token = rng.randrange(self._vocab_size)
            if token not in self._special:
                ids.append(token)
        return ids

    def random_text(self, rng: random.Random, n: int, prefix: Sequence[int] = ()) -> str:
        """Text of the ids `prefix`, then random vocabulary tokens, that re-encodes to len(prefix) + n
        tokens (decoding and re-encoding can merge or split tokens, so the ids are adjusted a few
        times, the prefix's kept)."""
        total = len(prefix) + n
        ids = [*prefix, *self.random_ids(rng, n)]
        for _ in range(5):
            text = self.decode(ids)
            encoded = self.encode(text)
            if len(encoded) == total:
                return text
            tail = encoded[len(prefix) : total]  # past the prefix's place: the prefix itself stays as drawn
            ids = [*prefix, *tail, *self.random_ids(rng, n - len(tail))]
        return self.decode(ids)

    def chat_text(self, user: str) -> str:
        """`user` as the one message of a chat, in the model's chat template with the generation
        prompt, as text (vLLM's custom dataset sends its prompts so to the completions endpoint)."""
        if not self._hf.chat_template:
            raise BenchError(f"the tokenizer {self.source} has no chat template: pass --skip-chat-template")
        return self._hf.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The ids a server would see for a chat or completions request body."""
        if "messages" in body:
            from pagoda.model_files import apply_chat_template

            return apply_chat_template(self._hf, body["messages"])
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return self._hf.encode(str(prompt))


def resolve_source(explicit: str | None, model: str | None) -> str | None:
    """Which tokenizer to use: the one given; else the served model's when it is a local path or
    Pagoda's default model; else None (unknown)."""
    if explicit:
        return explicit
    if not model:
        return None
    if Path(model).exists():
        return model
    from pagoda.model_files import DEFAULT_MODEL_NAME

    return DEFAULT if model.rstrip("/").split("/")[-1] == DEFAULT_MODEL_NAME else None


def load(source: str) -> Tokenizer:
    from pagoda.errors import ConfigError
    from pagoda.model_files import load_tokenizer

    try:
        return Tokenizer(load_tokenizer(None if source == DEFAULT else source), source)
    except ConfigError as exc:
        raise BenchError(f"cannot load tokenizer {source!r}: {exc}") from exc


class LazyTokenizer:
    """Loads the tokenizer on first use; `get` answers None when there is none to load."""

    def __init__(self, source: str | None) -> None:
        self.source = source
        self._tokenizer: Tokenizer | None = None
        self._failed = source is None

    def get(self) -> Tokenizer | None:
        if self._tokenizer is None and not self._failed:
            try:
                self._tokenizer = load(self.source)  # type: ignore[arg-type]
            except BenchError as exc:
                print(f"warning: {exc}", file=sys.stderr)
                self._failed = True
        return self._tokenizer

    def require(self, why: str) -> Tokenizer:
        if self.source is None:
            raise BenchError(
                f"{why} needs a tokenizer, and the served model's name is not a local path: "
                "pass --tokenizer PATH (an HF directory or .gguf file) or --tokenizer default"
            )
        if self._tokenizer is None:
            self._tokenizer = load(self.source)
        return self._tokenizer
