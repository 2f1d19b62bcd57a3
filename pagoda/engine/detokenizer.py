"""Incremental detokenization and stop strings.

Text is decoded over a short window of recent ids and only emitted once it no longer ends in an
incomplete character (U+FFFD), so multi-byte characters and byte-fallback tokens never reach the
stream broken; an output that ends inside a character (cut by max_tokens) leaves that character
out, as vLLM does. While a request runs, the last (longest stop string - 1) characters are held back
so that a stop string is never emitted unless asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded along, so the first word's leading space is right


def text_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> tokenizer.decode(ids, skip_special_tokens=...). Straight from the `tokenizers` backend
    where transformers' decode only wraps it (its own _decode, not a subclass's, and no clean-up of
    spaces): the same text, without the wrapper's argument checks and conversions, which took
    longer than the decode itself (a server streams one token at a time, two decodes each)."""
    try:
        import tokenizers
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        TokenizersBackend is not None
        and isinstance(backend, tokenizers.Tokenizer)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._decode = text_decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """The new complete text that `token_id` adds (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end, but a last character whose bytes never completed."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :].rstrip("\ufffd")


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_in_output: bool) -> None:
        self.stop = list(stop)  # never empty strings: SamplingParams refuses them
        self.include_in_output = include_in_output
        self.holdback = 0 if include_in_output or not self.stop else max(map(len, self.stop)) - 1

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """(stop string, cut position) of the first stop string that new text completes."""
        best = None
        for s in self.stop:
            start = max(0, len(text) - num_new_chars - len(s) + 1)
            at = text.find(s, start)
            if at >= 0 and (best is None or at < best[1]):
                best = (s, at)
        if best is None:
            return None
        s, at = best
        return s, at + len(s) if self.include_in_output else at
