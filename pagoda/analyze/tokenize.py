"""Prompts to token ids, exactly as Pagoda's server makes them: chat messages through the model's
chat template (`pagoda.model_files.apply_chat_template`), completion text through
`tokenizer.encode` with the tokenizer's default special tokens, token ids as they are.

The tokenizer loads on first need, so a log of token ids never imports transformers (nor torch).
"""

from __future__ import annotations

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
        from pagoda.config import ConfigError
        from pagoda.model_files import display_name, load_tokenizer, resolve_model

        try:
            resolve_model(self.model)  # first, so that an unknown model fails before transformers loads
            return load_tokenizer(self.model)
        except ConfigError as exc:
            raise AnalyzeError(f"Cannot load the tokenizer of {self.model or display_name(None)}: {exc}") from None

    def _chat_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        from pagoda.config import ConfigError
        from pagoda.model_files import apply_chat_template

        try:
            return apply_chat_template(tokenizer, messages, self.chat_template)
        except ConfigError as exc:
            raise AnalyzeError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - templates raise anything; it is this line's fault
            raise PromptError(f"the chat template rejects these messages: {exc}") from None
