"""JSON Lines as `pagoda serve --request-log` writes them and `pagoda bench` (replay) and `pagoda
analyze` read them: one JSON object a line, lines numbered from 1 in the file, blank lines skipped.

Lines are read as bytes and decoded one at a time, so a line that is not UTF-8 is one bad line with
its number rather than an error for the whole file. Only the standard library: neither command may
import torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import BinaryIO


class BadLine(ValueError):
    """A line that cannot be read as what its reader wants; the message says why, without the line
    number (the reader adds it in its own form)."""


def numbered_lines(handle: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for each line of `handle` that is not blank; `on_bytes` hears the
    size of every line read, blank ones included."""
    for number, raw in enumerate(handle, start=1):
        if on_bytes is not None:
            on_bytes(len(raw))
        if not raw.isspace():
            yield number, raw


def decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        reason = exc.msg.removesuffix(" at")  # json's "Invalid control character at"
        raise BadLine(f"not valid JSON ({reason} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"a JSON {type(obj).__name__}, not an object")
    return obj
