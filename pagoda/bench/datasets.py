"""Workloads: seeded streams of requests, the same for every engine and every rerun.

A workload yields `Session`s. A single-turn request is a session of one turn; a multi-turn
session sends its follow-ups one after another, each resending the history plus the server's
previous reply. Synthetic streams (random, shared-prefix, multi-turn) never end; file-based ones
(replay, ShareGPT, vLLM's custom) end with the file. Files are parsed once, up front, so a malformed line stops
the run before any server is started. A prompt whose body asks for a JSON schema, made here or
replayed, has its answer graded against it (see schemas.py); one that must call a tool has its
calls graded against the tools it offers (see tool_calls.py).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pagoda import jsonl
from pagoda.bench import schemas, tool_calls
from pagoda.bench.errors import BenchError
from pagoda.bench.tokens import Tokenizer

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# what else a Pagoda request log holds: skipped on replay, with a warning (the benchmark sends neither)
UNSENT_PATHS = ("/v1/responses", "/v1/messages")
# fields a replayed body drops: a streamed request cannot carry them (the benchmark streams every
# request, and sets n itself)
NOT_STREAMED = ("prompt_logprobs", "best_of")
KINDS = ("random", "shared-prefix", "multi-turn", "replay", "sharegpt", "custom", "structured", "tools")
DEFAULT_OUTPUT_LEN = 64
STRUCTURED_OUTPUT_LEN = 128  # room for the longest of schemas.TASKS' documents
TOOLS_OUTPUT_LEN = 200  # room for a call of any of tool_calls.TOOLS, in any server's format
# Fields of a completions body that mean the same in a chat body, kept when a replayed
# `{"prompt", ...}` line is sent to the chat endpoint.
SHARED_FIELDS = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty")
# ShareGPT filter, as vLLM's benchmark applies it.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class LengthDist:
    """A token length: fixed ("256"), uniform over a range ("128:512"), or normal ("normal:256,64")."""

    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        try:
            if text.startswith("normal:"):
                mean, std = (float(x) for x in text.removeprefix("normal:").split(","))
                dist = cls("normal", mean, std)
            elif ":" in text:
                low, high = (int(x) for x in text.split(":"))
                dist = cls("uniform", low, high)
            else:
                dist = cls("fixed", int(text))
        except ValueError:
            raise BenchError(f"bad length {text!r}: use N, LOW:HIGH or normal:MEAN,STD") from None
        if dist.a < 1 or dist.b < 0 or (dist.kind == "uniform" and dist.b < dist.a):
            raise BenchError(f"bad length {text!r}: lengths are >= 1 and LOW <= HIGH")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return {"fixed": f"{self.a:g}", "uniform": f"{self.a:g}:{self.b:g}"}.get(
            self.kind, f"normal:{self.a:g},{self.b:g}"
        )


@dataclass(frozen=True)
class Prompt:
    """One request before the target's model name and streaming options are added. `body` is
    read-only by convention: the messages or prompt, max_tokens, and any replayed fields."""

    endpoint: Endpoint
    body: dict[str, Any]
    token_ids: tuple[int, ...] | None = None  # as the server tokenizes it, when known ahead
    # The answer must call one of the body's tools: the tools workload's prompts, and replayed
    # bodies whose tool_choice forces a call.
    calls_expected: bool = False

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the body's response_format asks for, to grade the answer against."""
        return schemas.schema_of(self.body)

    @property
    def tools(self) -> dict[str, dict[str, Any]] | None:
        """The tools (name -> parameters schema) to grade the answer's calls against; None when
        no call is expected."""
        return tool_calls.tools_of(self.body) if self.calls_expected else None


@dataclass(frozen=True)
class FollowUp:
    text: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    first: Prompt
    follow_ups: tuple[FollowUp, ...] = ()
    think_time_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return 1 + len(self.follow_ups)


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str
    endpoint: Endpoint
    input_len: LengthDist
    output_len: LengthDist | None  # None: DEFAULT_OUTPUT_LEN, or a ShareGPT reply's own length
    groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    turns: int
    think_time_s: float
    dataset: Path | None
    tool_choice: str = "required"  # the tools workload's: one of tool_calls.TOOL_CHOICES
    prefix_len: int = 0  # random: tokens every prompt of a level opens with (vLLM's --random-prefix-len)
    # custom (vLLM's custom dataset): every request's max_tokens, -1 for each line's output_tokens;
    # whether a completions prompt goes as it is rather than in the chat template
    custom_output_len: int = 256
    skip_chat_template: bool = False
    shuffle: bool = True  # sharegpt and custom: the file's entries in a seeded order, as vLLM's

    @property
    def needs_tokenizer(self) -> bool:
        """Whether prompts are made of tokens; replayed, structured and tools ones are text as they
        are, and a custom file's prompts too unless they go into the chat template."""
        if self.kind == "custom":
            return self.endpoint == "completions" and not self.skip_chat_template
        return self.kind not in ("replay", "structured", "tools")

    def default_num_prompts(self) -> int | None:
        """None for replay and custom: the whole file."""
        default = {"shared-prefix": self.groups * self.prompts_per_group, "replay": None, "custom": None}
        return default.get(self.kind, 100)

    def output(self) -> LengthDist:
        default = {"structured": STRUCTURED_OUTPUT_LEN, "tools": TOOLS_OUTPUT_LEN}.get(self.kind, DEFAULT_OUTPUT_LEN)
        return self.output_len or LengthDist("fixed", default)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    # Parsed file contents: Prompts for replay, (prompt, reply) pairs for ShareGPT; else empty.
    entries: tuple[Any, ...] = ()

    def requests_per_level(self, num_prompts: int | None) -> int | None:
        """How many requests a level sends at most; None: unbounded (a duration stops it)."""
        if self.spec.kind in ("replay", "sharegpt", "custom"):
            return min(num_prompts or len(self.entries), len(self.entries))
        return num_prompts


def load_workload(spec: WorkloadSpec) -> Workload:
    if spec.kind == "replay":
        return Workload(spec, tuple(load_replay(_dataset(spec), spec.endpoint)))
    if spec.kind == "sharegpt":
        return Workload(spec, tuple(load_sharegpt(_dataset(spec))))
    if spec.kind == "custom":
        return Workload(spec, tuple(load_custom(_dataset(spec), spec.custom_output_len == -1)))
    return Workload(spec)


def _dataset(spec: WorkloadSpec) -> Path:
    if spec.dataset is None:
        raise BenchError(f"the {spec.kind} workload needs --dataset FILE")
    if not spec.dataset.is_file():
        what = "is a directory, not a file" if spec.dataset.is_dir() else "not found"
        raise BenchError(f"dataset file {spec.dataset} {what}")
    return spec.dataset


def sessions(workload: Workload, tokenizer: Tokenizer | None, seed: int, label: str) -> Iterator[Session]:
    """The workload's session stream for one purpose (`label`: "warmup", "level0", ...).
    Equal (seed, kind, label) give equal streams; a different label or workload kind gives fresh
    prompts, so that one level, or a run of another kind on the same server, does not find these
    prompts in the prefix cache."""
    spec = workload.spec
    rng = random.Random(f"{seed}:{spec.kind}:{label}")
    if spec.kind == "replay":
        return (Session(prompt) for prompt in workload.entries)
    if spec.kind == "structured":
        return _structured_sessions(spec, rng)
    if spec.kind == "tools":
        return _tools_sessions(spec, rng)
    if spec.kind == "custom":
        return _custom_sessions(workload, tokenizer, seed)
    assert tokenizer is not None, "every workload but replay needs a tokenizer"
    if spec.kind == "sharegpt":
        return _sharegpt_sessions(workload, tokenizer, rng)
    builders = {
        "random": _random_sessions,
        "shared-prefix": _shared_prefix_sessions,
        "multi-turn": _multi_turn_sessions,
    }
    return builders[spec.kind](spec, tokenizer, rng)


def take_requests(stream: Iterable[Session], n: int) -> Iterator[Session]:
    """Sessions holding exactly `n` requests in all (fewer when the stream ends first)."""
    for session in stream:
        if n <= 0:
            return
        if session.num_requests > n:
            session = replace(session, follow_ups=session.follow_ups[: n - 1])
        n -= session.num_requests
        yield session


def make_prompt(endpoint: Endpoint, tokenizer: Tokenizer, system: str | None, user: str, max_tokens: int) -> Prompt:
    body = prompt_body(endpoint, system, user, max_tokens)
    return Prompt(endpoint, body, tuple(tokenizer.prompt_ids(body)))


def prompt_body(endpoint: Endpoint, system: str | None, user: str, max_tokens: int) -> dict[str, Any]:
    if endpoint == "chat":
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}
        ]
        return {"messages": messages, "max_tokens": max_tokens}
    return {"prompt": user if system is None else f"{system}\n{user}", "max_tokens": max_tokens}


def next_turn(prompt: Prompt, reply: str, follow_up: FollowUp) -> Prompt:
    """The next request of a conversation: the history, the server's reply, the next question."""
    if prompt.endpoint == "chat":
        messages = [
            *prompt.body["messages"],
            {"role": "assistant", "content": reply},
            {"role": "user", "content": follow_up.text},
        ]
        body = {**prompt.body, "messages": messages, "max_tokens": follow_up.max_tokens}
    else:
        body = {
            **prompt.body,
            "prompt": f"{prompt.body['prompt']}{reply}\n{follow_up.text}",
            "max_tokens": follow_up.max_tokens,
        }
    return Prompt(prompt.endpoint, body)


def _random_sessions(spec: WorkloadSpec, tok: Tokenizer, rng: random.Random) -> Iterator[Session]:
    # the level's prompts all open with these ids (of a text that re-encodes to them)
    prefix = tuple(tok.encode(tok.random_text(rng, spec.prefix_len))) if spec.prefix_len else ()
    while True:
        text = tok.random_text(rng, spec.input_len.sample(rng), prefix)
        yield Session(make_prompt(spec.endpoint, tok, None, text, spec.output().sample(rng)))


def _shared_prefix_sessions(spec: WorkloadSpec, tok: Tokenizer, rng: random.Random) -> Iterator[Session]:
    """Groups take turns (request i belongs to group i mod groups), so a group's later requests
    arrive while other groups' prefixes compete for the cache; each round of
    groups x prompts_per_group requests draws fresh system prompts."""
    while True:
        systems = [tok.random_text(rng, spec.system_prompt_len) for _ in range(spec.groups)]
        for i in range(spec.groups * spec.prompts_per_group):
            question = tok.random_text(rng, spec.question_len)
            yield Session(
                make_prompt(spec.endpoint, tok, systems[i % spec.groups], question, spec.output().sample(rng))
            )


def _multi_turn_sessions(spec: WorkloadSpec, tok: Tokenizer, rng: random.Random) -> Iterator[Session]:
    while True:
        turns = [
            (tok.random_text(rng, spec.input_len.sample(rng)), spec.output().sample(rng)) for _ in range(spec.turns)
        ]
        first = make_prompt(spec.endpoint, tok, None, turns[0][0], turns[0][1])
        yield Session(first, tuple(FollowUp(text, n) for text, n in turns[1:]), spec.think_time_s)


def _structured_sessions(spec: WorkloadSpec, rng: random.Random) -> Iterator[Session]:
    """Rounds of one request per task, each round in its own shuffled order, so that every
    schema is asked as often as the others (to within one round); subjects vary the prompts.
    A completions prompt ends on a line that invites the document."""
    order = list(schemas.TASKS)
    while True:
        rng.shuffle(order)
        for task in order:
            text = schemas.user_message(task, rng.choice(task.subjects))
            user = text if spec.endpoint == "chat" else f"{text}\nJSON:"
            body = prompt_body(spec.endpoint, None, user, spec.output().sample(rng))
            body["response_format"] = schemas.response_format(task)
            yield Session(Prompt(spec.endpoint, body))


def _tools_sessions(spec: WorkloadSpec, rng: random.Random) -> Iterator[Session]:
    """Rounds of one request per tool, each round in its own shuffled order, as the structured
    workload takes its schemas. Each request offers the tool its prompt is about and others,
    in a seeded order, and asks for one call (parallel_tool_calls false)."""
    order = list(tool_calls.TOOLS)
    while True:
        rng.shuffle(order)
        for tool in order:
            others = rng.sample([t for t in tool_calls.TOOLS if t is not tool], tool_calls.TOOLS_PER_REQUEST - 1)
            offered = rng.sample([tool, *others], tool_calls.TOOLS_PER_REQUEST)
            body = prompt_body("chat", None, tool.request.format(rng.choice(tool.subjects)), spec.output().sample(rng))
            body |= {
                "tools": [t.spec() for t in offered],
                "tool_choice": tool_calls.tool_choice(spec.tool_choice, tool),
                "parallel_tool_calls": False,
            }
            yield Session(Prompt("chat", body, calls_expected=True))


def _sharegpt_sessions(workload: Workload, tok: Tokenizer, rng: random.Random) -> Iterator[Session]:
    order = list(range(len(workload.entries)))
    spec = workload.spec
    if spec.shuffle:
        rng.shuffle(order)
    for index in order:
        prompt, reply = workload.entries[index]
        prompt_len, reply_len = len(tok.encode(prompt)), len(tok.encode(reply))
        if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + reply_len > SHAREGPT_MAX_TOTAL:
            continue
        max_tokens = spec.output_len.sample(rng) if spec.output_len else reply_len
        yield Session(make_prompt(spec.endpoint, tok, None, prompt, max_tokens))


def _custom_sessions(workload: Workload, tok: Tokenizer | None, seed: int) -> Iterator[Session]:
    """vLLM's custom dataset: the file's prompts in the order vLLM's `--seed` shuffles them into
    (every level the same), each one's max_tokens --custom-output-len or its line's output_tokens;
    to the completions endpoint in the chat template, as vLLM sends them, unless
    --skip-chat-template; to the chat endpoint as the user's message."""
    spec = workload.spec
    entries = list(workload.entries)
    if spec.shuffle:
        random.Random(seed).shuffle(entries)
    for text, output_tokens in entries:
        max_tokens = output_tokens if spec.custom_output_len == -1 else spec.custom_output_len
        if spec.endpoint == "chat":
            yield Session(Prompt("chat", prompt_body("chat", None, text, max_tokens)))
        elif spec.skip_chat_template:
            yield Session(Prompt("completions", prompt_body("completions", None, text, max_tokens)))
        else:
            assert tok is not None, "the chat template needs the tokenizer"
            yield Session(Prompt("completions", prompt_body("completions", None, tok.chat_text(text), max_tokens)))


def _json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each line's place ("FILE:N") and JSON object; a line that is not one stops the run."""
    with path.open("rb") as lines:
        for number, raw in jsonl.numbered_lines(lines):
            where = f"{path}:{number}"
            try:
                yield where, jsonl.json_object(jsonl.decode(raw))
            except jsonl.BadLine as exc:
                raise BenchError(f"{where}: {exc}") from None


def load_custom(path: Path, needs_output_tokens: bool) -> list[tuple[str, int | None]]:
    """vLLM's custom dataset: JSONL lines of {"prompt": TEXT} with an optional "output_tokens",
    which every line needs when `needs_output_tokens` (--custom-output-len -1)."""
    entries = []
    for where, obj in _json_lines(path):
        if not isinstance(obj.get("prompt"), str):
            raise BenchError(f"{where}: a custom dataset line needs a text 'prompt'")
        output_tokens = obj.get("output_tokens")
        if output_tokens is None and needs_output_tokens:
            raise BenchError(f"{where}: no 'output_tokens', which --custom-output-len -1 takes from each line")
        if output_tokens is not None and not (type(output_tokens) is int and output_tokens >= 1):
            raise BenchError(f"{where}: 'output_tokens' must be a positive integer")
        entries.append((obj["prompt"], output_tokens))
    if not entries:
        raise BenchError(f"{path}: no prompts in the file")
    return entries


def load_replay(path: Path, endpoint: Endpoint) -> list[Prompt]:
    """Parse a JSONL file of OpenAI request bodies, `{"prompt", "max_tokens"}` lines, or Pagoda
    request-log records; every line is checked before any is sent. Bodies keep their endpoint
    (messages: chat, prompt and model: completions); bare prompt lines take `endpoint`."""
    lines = list(_json_lines(path))
    skipped = Counter(obj["endpoint"] for _, obj in lines if _unsent(obj))
    prompts = [_replay_line(obj, endpoint, where) for where, obj in lines if not _unsent(obj)]
    if skipped:
        counts = ", ".join(f"{count} of {route}" for route, count in sorted(skipped.items()))
        print(
            f"pagoda bench: warning: {path}: skipped request-log records it does not send ({counts})", file=sys.stderr
        )
    if not prompts:
        raise BenchError(f"{path}: no requests in the file")
    return prompts


def _unsent(obj: dict[str, Any]) -> bool:
    """A request-log record of an endpoint the benchmark does not send to."""
    return "body" in obj and obj.get("endpoint") in UNSENT_PATHS


def _replay_line(obj: dict[str, Any], endpoint: Endpoint, where: str) -> Prompt:
    if "body" in obj:  # a Pagoda request-log record
        if obj.get("endpoint") not in ENDPOINT_PATHS:
            known = sorted([*ENDPOINT_PATHS, *UNSENT_PATHS])
            raise BenchError(f"{where}: request-log 'endpoint' must be one of {known}")
        prompt = _body_prompt(obj["body"], ENDPOINT_PATHS[obj["endpoint"]], where)
        ids = obj.get("prompt_token_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise BenchError(f"{where}: 'prompt_token_ids' must be a list of integers")
        return replace(prompt, token_ids=tuple(ids) if ids is not None else None)
    if "messages" in obj:
        return _body_prompt(obj, "chat", where)
    if "prompt" in obj:
        # A body with a model is a completions request; a bare {"prompt", "max_tokens"} line
        # goes to the run's endpoint.
        if endpoint == "completions" or "model" in obj:
            return _body_prompt(obj, "completions", where)
        if not isinstance(obj["prompt"], str):
            raise BenchError(f"{where}: only a text 'prompt' can be sent to the chat endpoint")
        chat = {"messages": [{"role": "user", "content": obj["prompt"]}]}
        return _body_prompt(chat | {k: obj[k] for k in SHARED_FIELDS if k in obj}, "chat", where)
    raise BenchError(
        f"{where}: expected an OpenAI request body ('messages' or 'prompt') or a Pagoda request-log record ('body')"
    )


def _body_prompt(body: Any, endpoint: Endpoint, where: str) -> Prompt:
    if not isinstance(body, dict):
        raise BenchError(f"{where}: the request body must be a JSON object")
    if endpoint == "chat":
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise BenchError(f"{where}: 'messages' must be a non-empty list of objects")
    elif not isinstance(body.get("prompt"), (str, list)):
        raise BenchError(f"{where}: 'prompt' must be a string or a list of token ids")
    max_tokens = _lax_int(body.get("max_tokens", body.get("max_completion_tokens")))
    if _scores_prompt(body, endpoint):
        pass  # echo with max_tokens 0: scoring the prompt (lm-eval's loglikelihood requests)
    elif max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise BenchError(f"{where}: 'max_tokens' must be a positive integer (or 0 with echo, to score the prompt)")
    sent = {key: value for key, value in body.items() if key not in NOT_STREAMED}
    return Prompt(endpoint, sent, calls_expected=tool_calls.requires_calls(body))


def _scores_prompt(body: dict[str, Any], endpoint: Endpoint) -> bool:
    return endpoint == "completions" and body.get("echo") is True and _lax_int(body.get("max_tokens")) == 0


def _lax_int(value: Any) -> Any:
    """An integer field as the servers' lax parsing reads it (pydantic's, vLLM's and Pagoda's: "10",
    "+10" and 10.0 are 10), which a request log keeps as sent; anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (str, float)):
        return value
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(int).validate_python(value)
    except ValidationError:
        return value


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first human message, the reply to it) of each ShareGPT conversation with both."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise BenchError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for index, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns
        ):
            raise BenchError(f"{path}: item {index} has no 'conversations' list of {{'from', 'value'}} objects")
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise BenchError(f"{path}: no conversation has a prompt and a reply")
    return pairs


def prefix_share(sequences: Iterable[tuple[str | None, Sequence[int]]]) -> tuple[int, int]:
    """(tokens that continue a prefix some earlier sequence of the same cache salt already had, all
    tokens) over (cache_salt, token ids) pairs: the hit rate an unbounded prefix cache would reach
    over these prompts, sent in this order (a server shares cached KV only within a salt)."""
    seen: set[int] = set()
    shared = total = 0
    for salt, sequence in sequences:
        key, matching = hash(salt), True
        for token in sequence:
            key = hash((key, token))
            matching = matching and key in seen
            shared += matching
            seen.add(key)
        total += len(sequence)
    return shared, total


def short_name(spec: WorkloadSpec) -> str:
    """The workload in a few words, for a plot's title."""
    if spec.kind in ("random", "multi-turn"):
        return f"{spec.kind}, {spec.input_len} in / {spec.output()} out"
    return spec.kind


def describe(spec: WorkloadSpec) -> str:
    out = f"output {spec.output()} tokens" if spec.kind != "sharegpt" or spec.output_len else "output as in the file"
    return {
        "random": f"random: input {spec.input_len} tokens, {out}",
        "shared-prefix": (
            f"shared-prefix: {spec.groups} groups x {spec.prompts_per_group} prompts, system prompt "
            f"{spec.system_prompt_len} tokens, question {spec.question_len} tokens, {out}"
        ),
        "multi-turn": (
            f"multi-turn: {spec.turns} turns per session, question {spec.input_len} tokens, {out}, "
            f"think time {spec.think_time_s:g} s; each turn resends the history and the replies"
        ),
        "replay": f"replay of {spec.dataset}",
        "custom": (
            f"vLLM's custom dataset {spec.dataset}"
            + (
                ", each line's output_tokens"
                if spec.custom_output_len == -1
                else f", output {spec.custom_output_len} tokens"
            )
            + (", in the chat template" if spec.needs_tokenizer else "")
        ),
        "sharegpt": f"ShareGPT conversations from {spec.dataset}, {out}",
        "structured": (
            f"structured: {len(schemas.TASKS)} JSON schemas taken in turn (nested objects, arrays, enums, "
            f"bounded numbers, optional fields, $ref, anyOf), each sent as response_format json_schema (strict) "
            f"to the {spec.endpoint} endpoint, {out}; every answer must parse as JSON and match its schema"
        ),
        "tools": (
            f"tools: {len(tool_calls.TOOLS)} tools (weather, time, currency, search, calendar, ...), each request "
            f"offering {tool_calls.TOOLS_PER_REQUEST} of them and asking for what one does, tool_choice "
            f"{spec.tool_choice}, to the chat endpoint, {out}; every answer must call an offered tool with arguments "
            "that parse and match its parameters schema; after each level, every completed request sent at "
            "temperature 0 is sent again without streaming (untimed) and its calls compared with the streamed ones"
        ),
    }[spec.kind]


def token_lists(
    stream: Iterable[Session], limit: int, tokenizer: Tokenizer | None
) -> list[tuple[str | None, tuple[int, ...]]] | None:
    """The cache salt and prompt token ids of the first `limit` first turns, or None when some ids
    are unknown."""
    lists = []
    for session in itertools.islice(stream, limit):
        ids = session.first.token_ids
        if ids is None and tokenizer is None:
            return None
        salt = session.first.body.get("cache_salt")
        ids = ids if ids is not None else tuple(tokenizer.prompt_ids(session.first.body))  # type: ignore[union-attr]
        lists.append((salt if isinstance(salt, str) else None, ids))
    return lists
