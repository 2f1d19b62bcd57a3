"""Prompts to token ids, exactly as Pagoda's server makes them: chat messages read by the server's
own `parse_messages` and rendered as it renders them (`render_ids`: the model's chat template,
tool turns as text where the template takes no tools), completion text through
`tokenizer.encode` with the tokenizer's default special tokens, token ids as they are.

The tokenizer loads on first need, so a log of token ids never imports transformers (nor torch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.logs import Prompt


class PromptError(ValueError):
    """This one prompt cannot be tokenized (the chat template rejects it, say)."""


class PromptTokenizer:
    def __init__(self, model: str | None, chat_template: str | None = None, tokenizer: object | None = None) -> None:
        self.model = model  # None: Pagoda's default model, as for `pagoda serve`
        self.chat_template = chat_template
        self._tokenizer = tokenizer  # `model`'s tokenizer, when the caller has it loaded already

    def ids(self, prompt: Prompt) -> np.ndarray:
        if isinstance(prompt, np.ndarray):
            return prompt
        tokenizer = self.load()
        if isinstance(prompt, str):
            return np.array(tokenizer.encode(prompt), dtype=np.int32)
        return np.array(self._chat_ids(tokenizer, list(prompt)), dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return self.load().decode(ids.tolist())

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self):
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    def _load(self):
        if self.model is not None and not Path(self.model).exists():  # say so before importing torch
            raise AnalyzeError(
                f"Cannot load the tokenizer of {self.model}: no such file or directory. Give a local "
                "Hugging Face model directory or a .gguf file (nothing is downloaded from a model hub)."
            )
        from pagoda.errors import ConfigError
        from pagoda.model_files import display_name, load_tokenizer

        try:
            return load_tokenizer(self.model)
        except ConfigError as exc:
            raise AnalyzeError(f"Cannot load the tokenizer of {self.model or display_name(None)}: {exc}") from None

    def _chat_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        from pagoda.entrypoints.openai.chat import parse_messages, render_ids
        from pagoda.entrypoints.openai.errors import APIError
        from pagoda.errors import ConfigError

        try:
            return render_ids(tokenizer, parse_messages(messages), self.chat_template)
        except APIError as exc:
            raise PromptError(f"the server would refuse these messages: {exc.message}") from None
        except ConfigError as exc:  # no chat template: every chat line would fail alike
            raise AnalyzeError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - templates raise anything; it is this line's fault
            raise PromptError(f"the chat template rejects these messages: {exc}") from None
