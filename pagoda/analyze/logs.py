"""Reading request log lines: Pagoda's own request log (`pagoda serve --request-log`), OpenAI
request bodies (chat, completions or Responses; or an OpenAI Batch file's lines), Anthropic
Messages bodies, or `{"prompt": ...}` lines, one JSON object per line, the file plain or gzipped.

Memory does not grow with the file: lines stream through, and only a bounded window of them is
held to put requests back in arrival order (a server writes a line when a request finishes, so
concurrent requests can appear out of order).
"""

from __future__ import annotations

import gzip
import heapq
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from pagoda.analyze.errors import AnalyzeError
from pagoda.analyze.routing import request_text
from pagoda.jsonl import BadLine, decode, json_object, numbered_lines

Messages = tuple[dict, ...]  # chat messages, handed to the chat template as the server does
# the chat request's fields besides its messages that its rendered prompt depends on
TEMPLATE_FIELDS = (
    "tools",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "tool_choice",  # "none" renders no tools on a server with --exclude-tools-when-tool-choice-none
    "chat_template",  # a request's own, on a server with --trust-request-chat-template
)


@dataclass(frozen=True, eq=False)
class ChatPrompt:
    """A chat request as the chat template sees it: its messages and TEMPLATE_FIELDS."""

    messages: Messages
    fields: dict = field(default_factory=dict)


Prompt = np.ndarray | ChatPrompt | str  # token ids (int32), a chat request, or completion text

MAX_TOKEN_ID = 2**31 - 1
REORDER_WINDOW = 4096

# Pagoda's log lines are mostly token ids, and json.loads builds a Python int per id (about 35 s
# per 100k lines of 1,000 tokens here). The id arrays are cut out of the text with str.find and
# parsed by numpy instead, several times faster; the rest of the line goes through json, with a
# placeholder where each array was.
_ID_KEYS = ("prompt_token_ids", "output_token_ids")
_OPEN_ARRAY = re.compile(r"\s*:\s*\[")
_PLACEHOLDER = "\x00ids"
_PLACEHOLDER_JSON = '"\\u0000ids"'


@dataclass(frozen=True)
class LogEntry:
    """One request, with its prompt in whatever form the line gave it."""

    line: int
    prompt: Prompt
    # when the request arrived: the line's timestamp less its latency_s where it has one (Pagoda's log
    # is written as requests finish), else its timestamp
    arrival: float | None = None
    output_ids: np.ndarray | None = None  # generated token ids, when logged
    output_tokens: int | None = None  # generated token count, when logged
    logged_cached_tokens: int | None = None  # the server's own prefix-cache hit, when logged
    latency_s: float | None = None  # arrival to finish (Pagoda's log), for the routing forecast's loads
    text: str = ""  # what a gateway routes on (routing.request_text): the body's messages or prompt text
    cache_salt: str | None = None  # the body's cache_salt: its prefix cache namespace


@dataclass(frozen=True)
class Malformed:
    line: int
    reason: str

    def __str__(self) -> str:  # as the report and the all-malformed error list it
        return f"line {self.line}: {self.reason}"


def read_log(path: Path, on_bytes: Callable[[int], None]) -> Iterator[LogEntry | Malformed]:
    """Entries of the log at `path` in file order; `on_bytes` hears how much has been read."""
    try:
        with path.open("rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        handle = gzip.open(path, "rb") if gzipped else path.open("rb")
    except OSError as exc:
        raise AnalyzeError(f"Cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        for number, raw in numbered_lines(handle, on_bytes):
            yield from parse_line(raw, number)


def parse_line(raw: bytes, line: int) -> list[LogEntry] | list[Malformed]:
    try:
        return _entries(_object(raw), line)
    except BadLine as exc:
        return [Malformed(line, str(exc))]


def in_arrival_order(
    items: Iterable[LogEntry | Malformed], window: int = REORDER_WINDOW
) -> Iterator[LogEntry | Malformed]:
    """Entries sorted by arrival within a sliding window of `window` entries; entries without a
    time keep their place (they sort with the latest arrival seen before them). Malformed lines
    pass straight through, in file order."""
    heap: list[tuple[float, int, LogEntry]] = []
    latest = -math.inf
    for order, item in enumerate(items):
        if isinstance(item, Malformed):
            yield item
            continue
        stamp = item.arrival
        latest = latest if stamp is None else max(latest, stamp)
        heapq.heappush(heap, (latest if stamp is None else stamp, order, item))
        if len(heap) > window:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


# ---- one line -----------------------------------------------------------------------------


def _object(raw: bytes) -> dict:
    """The line's JSON object, its token-id arrays (`_ID_KEYS`) read by numpy."""
    text = decode(raw)
    spans: list[tuple[int, int]] = []
    lifted: dict[str, np.ndarray] = {}
    for key in _ID_KEYS:
        found = _id_array(text, key)
        if found is not None:
            spans.append(found[0])
            lifted[key] = found[1]
    if not lifted:
        return json_object(text)
    spans.sort()
    pieces, done = [], 0
    for start, end in spans:
        pieces += [text[done:start], _PLACEHOLDER_JSON]
        done = end
    try:
        obj = json_object("".join(pieces) + text[done:])
    except BadLine:
        return json_object(text)  # for the error's true column
    if any(obj.get(key) != _PLACEHOLDER for key in lifted):
        return json_object(text)  # the first match sat inside a nested object: read the line plainly
    obj.update(lifted)
    return obj


def _id_array(text: str, key: str) -> tuple[tuple[int, int], np.ndarray] | None:
    """The span of the value of the first `"key": [ints]` in `text`, and the ints; None when the
    key is absent or its value is not a plain list of integers (json then decides)."""
    quoted = f'"{key}"'
    at = text.find(quoted)
    if at < 0:
        return None
    opening = _OPEN_ARRAY.match(text, at + len(quoted))
    closing = text.find("]", opening.end()) if opening else -1
    if closing < 0:
        return None
    try:
        ids = np.fromstring(text[opening.end() : closing], dtype=np.int64, sep=",")
    except ValueError:
        return None
    return (opening.end() - 1, closing + 1), ids


def _entries(obj: dict, line: int) -> list[LogEntry]:
    output_ids = _optional_ids(obj, "output_token_ids")
    output_tokens = _optional_count(obj, "output_tokens")
    if output_tokens is None and output_ids is not None:
        output_tokens = len(output_ids)
    latency = _seconds(obj, "latency_s")
    finished = _timestamp(obj)
    common = {
        "line": line,
        "arrival": finished - latency if finished is not None and latency is not None else finished,
        "output_ids": output_ids,
        "output_tokens": output_tokens,
        "logged_cached_tokens": _optional_count(obj, "cached_tokens"),
        "latency_s": latency,
    }
    body = obj["body"] if isinstance(obj.get("body"), dict) else obj  # Pagoda's log, an OpenAI Batch line
    salt = body.get("cache_salt")
    common["cache_salt"] = salt if isinstance(salt, str) and salt else None
    if "prompt_token_ids" in obj:
        text = request_text(_messages(body["messages"])) if "messages" in body else _text_prompt(body)
        return [LogEntry(prompt=_ids(obj["prompt_token_ids"], "prompt_token_ids"), text=text, **common)]
    if "messages" in body or ("input" in body and "prompt" not in body):  # chat, Messages or Responses
        chat = _chat(body)
        return [LogEntry(prompt=chat, text=request_text(chat.messages), **common)]
    if "prompt" in body:
        return [LogEntry(prompt=prompt, text=request_text(prompt), **common) for prompt in _prompts(body["prompt"])]
    raise BadLine('no "prompt_token_ids", "messages" or "prompt"')


def _chat(body: dict) -> ChatPrompt:
    """A chat request's prompt: its messages (a Messages request's `system` first; a Responses
    request's `instructions` and `input` items as the server turns them into messages) and the
    fields its rendering depends on."""
    fields = {name: body[name] for name in TEMPLATE_FIELDS if body.get(name) is not None}
    if "messages" in body:
        messages = _messages(body["messages"])
        system = body.get("system")  # Anthropic's Messages API keeps the system prompt apart
        if isinstance(system, list):
            system = "\n".join(b.get("text", "") for b in system if isinstance(b, dict))
        if isinstance(system, str) and system:
            messages = ({"role": "system", "content": system}, *messages)
        return ChatPrompt(messages, fields)
    from pagoda.entrypoints.openai.errors import APIError
    from pagoda.entrypoints.openai.responses import input_messages

    instructions = body.get("instructions")
    try:
        items = input_messages(body.get("input") or [])
    except APIError as exc:
        raise BadLine(f"the server would refuse this Responses input: {exc.message}") from None
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    return ChatPrompt(_messages(system + items), fields)


def _text_prompt(body: dict) -> str:
    """A completion's prompt text, or a Responses request's input (a string, or items whose text
    contents count as a chat's messages')."""
    if isinstance(body.get("input"), list):
        return request_text(tuple(item for item in body["input"] if isinstance(item, dict)))
    prompt = body.get("prompt", body.get("input"))
    return prompt if isinstance(prompt, str) else ""


def _ids(value: object, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        ids = value
    elif isinstance(value, list) and all(type(t) is int for t in value):
        ids = np.array(value, dtype=np.int64)
    else:
        raise BadLine(f"{name} must be a list of integers")
    if len(ids) == 0:
        raise BadLine(f"{name} is empty")
    if ids.view(np.uint64).max() > MAX_TOKEN_ID:  # negative ids wrap to huge ones
        raise BadLine(f"{name} holds an id outside 0..{MAX_TOKEN_ID}")
    return ids.astype(np.int32)


def _optional_ids(obj: dict, name: str) -> np.ndarray | None:
    value = obj.get(name)
    if value is None or (isinstance(value, (list, np.ndarray)) and len(value) == 0):
        return None
    return _ids(value, name)


def _optional_count(obj: dict, name: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise BadLine(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _timestamp(obj: dict) -> float | None:
    return _seconds(obj, "timestamp")


def _seconds(obj: dict, name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, str) and name == "timestamp":  # an ISO 8601 time, as many exporters write it
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise BadLine(f"timestamp must be a number or an ISO 8601 time, got {value!r}") from None
    if type(value) not in (int, float) or not math.isfinite(value):
        raise BadLine(f"{name} must be a number, got {value!r}")
    return float(value)


def _messages(value: object) -> Messages:
    """Checked only for shape here; the server's own reading of them comes with tokenizing."""
    if not isinstance(value, list) or not value:
        raise BadLine("messages must be a non-empty list")
    if not all(isinstance(message, dict) for message in value):
        raise BadLine("each message must be a JSON object")
    return tuple(value)


def _prompts(value: object) -> list[np.ndarray | str]:
    """A completions prompt: text, token ids, or a batch of either (one request each)."""
    batch = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
    return [_prompt(item) for item in batch]


def _prompt(value: object) -> np.ndarray | str:
    if isinstance(value, str):
        if not value:
            raise BadLine("prompt is empty")
        return value
    if isinstance(value, list):
        return _ids(value, "prompt")
    raise BadLine("prompt must be text, token ids, or a non-empty list of either")
