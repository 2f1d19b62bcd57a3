"""Prompts to token ids, exactly as Pagoda's server makes them: a chat request read by the server's
own `template_inputs` (its messages, its tools, its template variables) and rendered as it renders
it (`render_ids`: the model's chat template, tools and tool turns as text where the template takes
no tools), completion text through
`tokenizer.encode` with the tokenizer's default special tokens, token ids as they are.

The tokenizer loads on first need, so a log of token ids never imports transformers (nor torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.logs import ChatPrompt, Prompt


class PromptError(ValueError):
    """This one prompt cannot be tokenized (the chat template rejects it, say)."""


@dataclass(frozen=True)
class ChatFlags:
    """The server's flags that change the prompt a chat request renders to (`pagoda serve`'s, by
    vLLM's names)."""

    template: str | None = None  # --chat-template (None: the model's)
    content_format: str = "auto"  # --chat-template-content-format
    exclude_tools_when_none: bool = False  # --exclude-tools-when-tool-choice-none
    trust_request_template: bool = False  # --trust-request-chat-template: a body's chat_template is used


class PromptTokenizer:
    def __init__(self, model: str | None, flags: ChatFlags = ChatFlags(), tokenizer: object | None = None) -> None:
        self.model = model  # None: Pagoda's default model, as for `pagoda serve`
        self.flags = flags
        self._tokenizer = tokenizer  # `model`'s tokenizer, when the caller has it loaded already

    def ids(self, prompt: Prompt) -> np.ndarray:
        if isinstance(prompt, np.ndarray):
            return prompt
        tokenizer = self.load()
        if isinstance(prompt, str):
            return np.array(tokenizer.encode(prompt), dtype=np.int32)
        return np.array(self._chat_ids(tokenizer, prompt), dtype=np.int32)

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

    def _chat_ids(self, tokenizer, prompt: ChatPrompt) -> list[int]:
        from pydantic import ValidationError

        from pagoda.entrypoints.openai.chat import render_ids, template_inputs
        from pagoda.entrypoints.openai.errors import APIError
        from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
        from pagoda.errors import ConfigError

        try:
            body = ChatCompletionRequest.model_validate({"messages": list(prompt.messages), **prompt.fields})
            messages, tools, kwargs = template_inputs(tokenizer, body)
            flags = self.flags
            if body.chat_template is not None and not flags.trust_request_template:
                raise PromptError(
                    "the server would refuse this request: its own chat_template needs --trust-request-chat-template"
                )
            if flags.exclude_tools_when_none and body.tool_choice == "none":
                tools = None
            template = body.chat_template or flags.template
            return render_ids(tokenizer, messages, template, tools, kwargs, flags.content_format)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise PromptError(f"the server would refuse this request: {where}: {error['msg']}") from None
        except APIError as exc:
            raise PromptError(f"the server would refuse this request: {exc.message}") from None
        except ConfigError as exc:  # no chat template: every chat line would fail alike
            raise AnalyzeError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - templates raise anything; it is this line's fault
            raise PromptError(f"the chat template rejects these messages: {exc}") from None
