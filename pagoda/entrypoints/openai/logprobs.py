"""Log probabilities in the three shapes clients expect: chat (`logprobs.content`), the legacy
completions format (tokens / token_logprobs / top_logprobs / text_offset), and vLLM's
`prompt_logprobs`. A token is shown as its own decoded text, as OpenAI and vLLM do."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pagoda.request import TokenLogprob


class TokenTexts:
    """Decoded text of single tokens, cached: the same few thousand tokens recur constantly."""

    def __init__(self, tokenizer, cache_size: int = 65536) -> None:
        self.text = lru_cache(maxsize=cache_size)(lambda token_id: tokenizer.decode([token_id]))

    def width(self, token_id: int) -> int:
        """Characters the token takes in the text (what text_offset counts)."""
        return len(self.text(token_id))


class TokenIdTexts:
    """Tokens shown as `token_id:N` (vLLM's return_tokens_as_token_ids: tokens whose text alone is
    not valid UTF-8 stay tellable apart); text offsets still count their text."""

    def __init__(self, texts: TokenTexts) -> None:
        self.width = texts.width

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"


TokenNames = TokenTexts | TokenIdTexts  # how logprobs name tokens


def chat_logprobs(texts: TokenNames, logprobs: Sequence[TokenLogprob], num_top: int) -> dict:
    return {"content": [_chat_entry(texts, lp, num_top) for lp in logprobs], "refusal": None}


def _chat_entry(texts: TokenNames, lp: TokenLogprob, num_top: int) -> dict:
    token = texts.text(lp.token_id)
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_top]
    return {
        "token": token,
        "logprob": lp.logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": texts.text(t), "logprob": v, "bytes": list(texts.text(t).encode())} for t, v in top],
    }


def completion_logprobs(texts: TokenNames, logprobs: Sequence[TokenLogprob | None], text_offset: int) -> dict:
    """Legacy format; `text_offset` is where the first token starts in the choice's text. The
    sampled token is listed among top_logprobs along with the top alternatives (as vLLM does);
    a None entry (the first prompt token under echo) has no logprob."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        if lp is None:
            continue
        token = texts.text(lp.token_id)
        top = {texts.text(t): v for t, v in lp.top.items()}
        top.setdefault(token, lp.logprob)
        result["tokens"].append(token)
        result["token_logprobs"].append(lp.logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += texts.width(lp.token_id)
    return result


def echo_logprobs(texts: TokenNames, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None]) -> dict:
    """The prompt's tokens in the legacy format: the first has no logprob (nothing precedes it)."""
    first = texts.text(prompt_ids[0])
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest = completion_logprobs(texts, prompt_logprobs[1:], texts.width(prompt_ids[0]))
    return {key: head[key] + rest[key] for key in head}


def join_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def vllm_prompt_logprobs(
    texts: TokenTexts, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None]
) -> list:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    result: list[dict | None] = []
    for token_id, lp in zip(prompt_ids, prompt_logprobs):
        if lp is None:
            result.append(None)
            continue
        ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])
        entries = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": texts.text(t)}
            for rank, (t, v) in enumerate(ranked, start=1)
        }
        entries[str(token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": texts.text(token_id)}
        result.append(entries)
    return result
