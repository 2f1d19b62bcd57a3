"""Constraints compiled into grammars for one tokenizer, off the engine thread.

A compile looks in memory (an LRU of compiled grammars), then on disk (`$PAGODA_CACHE/grammars/`,
keyed by the constraint, the tokenizer and xgrammar's version, so a restart does not compile a
constraint it has seen), and only then asks the worker process (`worker.py`). One compile runs at
a time (`_compile_lock`); a look-up in memory never waits for it (`_memory_lock`). A compile that
passes its time limit is abandoned by killing the worker, which the next compile starts anew; the
request that asked gets a GrammarError.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured import worker
from pagoda.structured.schema import MISSING, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES, resolved

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process, on a busy machine
MEMORY_CACHE_SIZE = 256  # compiled grammars kept in memory


# what the library's errors say of its C++ code, nothing a client can act on: a source place ("[12:42:09]
# /project/cpp/grammar_compiler.cc:1318: ") and a failed check ("Check failed: (std::holds_alternative<Grammar>
# (result)) is false: "), before the reason
LIBRARY_INTERNALS = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: |Check failed: .*? is false: ")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: invalid, unsupported by the library, or too slow."""


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        timeout_s: float,
        cache_dir: Path | None,
    ) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        self.timeout_s = timeout_s
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self._info_json = self.tokenizer_info.serialize_json()
        # A disk entry is valid for one library version, tokenizer and set of compile options.
        identity = f"{importlib.metadata.version('xgrammar')}\n{worker.COMPILE_OPTIONS}\n{self._info_json}"
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        self._disk = cache_dir / "grammars" / digest if cache_dir is not None else None
        self._memory_lock = threading.Lock()  # guards _memory; held only for dict operations
        self._memory: OrderedDict[str, Any] = OrderedDict()
        self._compile_lock = threading.Lock()  # one compile at a time; guards the worker below
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    def cached(self, constraint: StructuredOutputsParams) -> Any | None:
        """The compiled grammar if it is in memory; never waits for a compile."""
        with self._memory_lock:
            compiled = self._memory.get(constraint.key)
            if compiled is not None:
                self._memory.move_to_end(constraint.key)
            return compiled

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The xgrammar CompiledGrammar of `constraint`; GrammarError with the reason if none (for
        a strict one, also where the grammar would enforce less than it asks)."""
        left: list[str] = []
        if constraint.json is not None:
            check_json_schema(constraint.json)
            left = check_supported(constraint.json, constraint.strict)
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        key = constraint.key
        with self._compile_lock:
            compiled = self.cached(constraint)  # compiled by the request this one waited behind?
            if compiled is None:
                compiled = self._load(key) or self._compile_in_worker(constraint, key, left)
        with self._memory_lock:
            self._memory[key] = compiled
            while len(self._memory) > MEMORY_CACHE_SIZE:
                self._memory.popitem(last=False)
        return compiled

    def close(self) -> None:
        with self._compile_lock:
            self._stop_worker()

    # ---- the disk cache --------------------------------------------------------------------
    def _path(self, key: str) -> Path | None:
        if self._disk is None:
            return None
        return self._disk / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def _load(self, key: str) -> Any | None:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            return self._xgrammar.CompiledGrammar.deserialize_json(path.read_text(), self.tokenizer_info)
        except Exception as exc:  # noqa: BLE001 - a stale or damaged entry is compiled again
            logger.warning("grammar cache entry %s unreadable (%s); compiling again", path.name, exc)
            return None

    def _store(self, key: str, serialized: str) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as f:
                f.write(serialized)
            os.replace(partial, path)  # atomic: a reader sees the whole entry or none
        except OSError as exc:
            logger.warning("cannot write the grammar cache %s: %s", path.parent, exc)

    # ---- the worker process ----------------------------------------------------------------
    def _compile_in_worker(self, constraint: StructuredOutputsParams, key: str, left: list[str]) -> Any:
        """`left`: what of the constraint is known to go unenforced (not strict), for the log line."""
        conn = self._worker()
        value = constraint.choice if constraint.kind == "choice" else getattr(constraint, constraint.kind)
        started = time.monotonic()
        try:
            conn.send((constraint.kind, value, constraint.strict))
            if not conn.poll(self.timeout_s):
                self._stop_worker()
                raise GrammarError(
                    f"compiling the {constraint.kind} constraint took longer than {self.timeout_s:g} s "
                    "(--grammar-compile-timeout); it was abandoned"
                )
            status, payload, weakened = conn.recv()
        except (EOFError, OSError):
            self._stop_worker()
            raise GrammarError(f"the grammar compiler's worker died on this {constraint.kind} constraint") from None
        if status != "ok":
            raise GrammarError(LIBRARY_INTERNALS.sub("", payload).strip())
        unenforced = [*left, *weakened]
        logger.info(
            "compiled a %s constraint in %.2f s%s",
            constraint.kind,
            time.monotonic() - started,
            f", not strict, leaving unenforced: {'; '.join(unenforced)}" if unenforced else "",
        )
        self._store(key, payload)
        return self._xgrammar.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def _worker(self) -> Connection:
        if self._process is not None and self._process.poll() is None and self._conn is not None:
            return self._conn
        self._stop_worker()
        ours, theirs = socket.socketpair()
        with ours, theirs:
            # A session of its own: a Ctrl-C at the server's terminal is the server's to handle.
            process = subprocess.Popen(
                [sys.executable, "-m", "pagoda.structured.worker", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
            conn = Connection(ours.detach())
        self._process, self._conn = process, conn
        try:
            conn.send(self._info_json)
            if conn.poll(WORKER_START_TIMEOUT_S) and conn.recv() == "ready":
                return conn
        except (EOFError, OSError):
            pass
        self._stop_worker()
        raise GrammarError("the grammar compiler's worker process did not start")

    def _stop_worker(self) -> None:
        if self._process is not None:
            self._process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


def check_json_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not valid JSON Schema, with the validator's reason."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply to check") from None
    except (TypeError, AttributeError, ValueError) as exc:  # e.g. a `$schema` that is not a URI
        raise GrammarError(f"invalid JSON schema: {type(exc).__name__}: {exc}") from None


# Keywords xgrammar would silently ignore (the output could then break the schema): refused where strict.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "multipleOf",
        "propertyNames",
        "patternProperties",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
    }
)


def check_supported(schema: Any, strict: bool = True) -> list[str]:
    """Refuse a schema with a reference to another document or a local reference to nothing, and
    where `strict` one with a part xgrammar would leave unenforced (a keyword it ignores, a required
    name its properties do not define), naming it and its place; returns those parts (none where
    strict), which a constraint that is not strict leaves unenforced."""
    left = []
    for problem, unenforced in _problems(schema, "", schema):
        if strict or not unenforced:
            raise GrammarError(problem)
        left.append(problem)
    return left


def _problems(schema: Any, where: str, root: Any) -> Iterator[tuple[str, bool]]:
    """(what, whether it is a part left unenforced rather than a reference the library cannot follow)."""
    if not isinstance(schema, dict):
        return
    place = f" at {where}" if where else ""
    for keyword in sorted(UNSUPPORTED_KEYWORDS & schema.keys()):
        yield f"the JSON schema uses `{keyword}`{place}, which structured outputs cannot enforce", True
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):  # xgrammar enforces a required name only beside its own property
        undefined = [name for name in required if not isinstance(properties, dict) or name not in properties]
        if undefined:
            yield (
                (
                    f"the JSON schema requires {', '.join(map(repr, undefined))}{place} without defining it in "
                    "`properties`, which structured outputs cannot enforce"
                ),
                True,
            )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"the JSON schema refers to another document ({ref}){place}; only local $refs work", False
    elif isinstance(ref, str) and not _resolves(root, ref):
        yield f"the JSON schema's $ref {ref}{place} points to nothing in the schema", False
    prefix = f"{where}/" if where else ""
    for key in SCHEMA_MAPS:
        subs = schema.get(key)
        for name, sub in subs.items() if isinstance(subs, dict) else ():
            yield from _problems(sub, f"{prefix}{key}/{name}", root)
    for key in SCHEMA_LISTS:
        subs = schema.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else ()):
            yield from _problems(sub, f"{prefix}{key}/{i}", root)
    for key in SCHEMA_VALUES:
        yield from _problems(schema.get(key), f"{prefix}{key}", root)


def _resolves(root: Any, ref: str) -> bool:
    """Whether a local $ref ("#", "#/$defs/a", a JSON pointer with ~0 ~1 escapes) names a part of `root`."""
    return resolved(root, ref) is not MISSING
