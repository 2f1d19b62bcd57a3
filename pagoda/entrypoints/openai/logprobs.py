"""Log probabilities in the three shapes clients expect: chat (`logprobs.content`), the legacy
completions format (tokens / token_logprobs / top_logprobs / text_offset), and vLLM's
`prompt_logprobs`. A token is shown as its decoded text as vLLM shows it: its own, but a piece of a
character (its text alone ends in U+FFFD) read after the tokens before it in the sequence
(TokenTexts.text, the offline API's DecodedTokens), so that the tokens' texts join into the text."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache, lru_cache

from pagoda.outputs import CONTEXT, INCOMPLETE, DecodedTokens
from pagoda.request import TokenLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for one raw byte


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE: the character that stands for each byte in a token's piece."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Decoded text of single tokens, and their bytes, cached: the same few thousand tokens recur
    constantly."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoded = DecodedTokens(tokenizer)
        self._alone = self._decoded.own
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def text(self, token_id: int, before: Sequence[int] | None = None) -> str:
        """The token's text alone; or, given `before` (the tokens before it in its sequence, the
        last CONTEXT of them), its text as vLLM shows it (DecodedTokens: "" for a piece of a
        character, the character with the token that completes it)."""
        return self._alone(token_id) if before is None else self._decoded(token_id, before)

    def width(self, token_id: int, before: Sequence[int] | None = None) -> int:
        """Characters the token takes in the text (what text_offset counts)."""
        return len(self.text(token_id, before))

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes (OpenAI's `bytes`): its text's, except for a token holding
        part of a character, whose text alone decodes to U+FFFD: then its bytes from its piece (a
        byte-level BPE piece's characters, or SentencePiece's byte fallback), so that the bytes of a
        character's tokens, joined, decode to it."""
        text = self._alone(token_id)
        if INCOMPLETE in text:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, bytes):  # tiktoken-style vocabularies hold the bytes themselves
                return list(piece)
            if isinstance(piece, str) and (fallback := _BYTE_FALLBACK.fullmatch(piece)):
                return [int(fallback[1], 16)]
            alphabet = _byte_level_alphabet()
            if isinstance(piece, str) and piece and all(char in alphabet for char in piece):
                return [alphabet[char] for char in piece]
        return list(text.encode())


class TokenIdTexts:
    """Tokens shown as `token_id:N` (vLLM's return_tokens_as_token_ids: tokens whose text alone is
    not valid UTF-8 stay tellable apart); text offsets and bytes are still their text's."""

    def __init__(self, texts: TokenTexts) -> None:
        self.width, self.bytes = texts.width, texts.bytes

    @staticmethod
    def text(token_id: int, before: Sequence[int] | None = None) -> str:
        return f"token_id:{token_id}"


TokenNames = TokenTexts | TokenIdTexts  # how logprobs name tokens


def before_delta(logprobs: Sequence[TokenLogprob], delta: Sequence[TokenLogprob]) -> list[int]:
    """The tokens a stream's delta is read after: the last CONTEXT of its entries so far
    (`logprobs`, its last `delta` included) before that delta."""
    end = len(logprobs) - len(delta)
    return [lp.token_id for lp in logprobs[max(0, end - CONTEXT) : end]]


def _then(context: list[int], token_id: int) -> list[int]:
    """The context of the token after `token_id`."""
    return [*context[1 - CONTEXT :], token_id]


def chat_logprobs(
    texts: TokenNames, logprobs: Sequence[TokenLogprob], num_top: int, before: Sequence[int] = ()
) -> dict:
    """Chat's shape; `before`: the tokens sent earlier in the stream (before_delta), when streaming."""
    content, context = [], list(before)
    for lp in logprobs:
        content.append(_chat_entry(texts, lp, num_top, context))
        context = _then(context, lp.token_id)
    return {"content": content, "refusal": None}


def _chat_entry(texts: TokenNames, lp: TokenLogprob, num_top: int, context: list[int]) -> dict:
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_top]
    return {
        "token": texts.text(lp.token_id, context),
        "logprob": lp.logprob,
        "bytes": texts.bytes(lp.token_id),
        "top_logprobs": [{"token": texts.text(t, context), "logprob": v, "bytes": texts.bytes(t)} for t, v in top],
    }


def completion_logprobs(
    texts: TokenNames, logprobs: Sequence[TokenLogprob | None], text_offset: int, before: Sequence[int] = ()
) -> dict:
    """Legacy format; `text_offset` is where the first token starts in the choice's text, `before`
    as chat_logprobs'. The sampled token is listed first in top_logprobs, then the top alternatives
    (as vLLM does); a None entry (the first prompt token under echo) has no logprob."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    context = list(before)
    for lp in logprobs:
        if lp is None:
            continue
        token = texts.text(lp.token_id, context)
        top = {token: lp.logprob}
        for t, v in lp.top.items():
            top.setdefault(texts.text(t, context), v)
        result["tokens"].append(token)
        result["token_logprobs"].append(lp.logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += texts.width(lp.token_id, context)
        context = _then(context, lp.token_id)
    return result


def echo_logprobs(texts: TokenNames, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None]) -> dict:
    """The prompt's tokens in the legacy format: the first has no logprob (nothing precedes it); each
    read after the prompt's tokens before it (the first after none: "" where it opens a character)."""
    first = texts.text(prompt_ids[0], ())
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest = completion_logprobs(texts, prompt_logprobs[1:], texts.width(prompt_ids[0], ()), prompt_ids[:1])
    return {key: head[key] + rest[key] for key in head}


def join_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(
    texts: TokenTexts, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None]
) -> list:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's own token first, then the top ones by rank."""
    result: list[dict | None] = []
    context: list[int] = []
    for token_id, lp in zip(prompt_ids, prompt_logprobs):
        if lp is None:
            result.append(None)
        else:
            ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])
            shown = texts.text(token_id, context)
            entries = {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": shown}}
            for rank, (t, v) in enumerate(ranked, start=1):
                entries.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": texts.text(t, context)})
            result.append(entries)
        context = _then(context, token_id)
    return result
