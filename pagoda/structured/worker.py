"""The grammar compiler's worker process: compiles one constraint at a time with xgrammar and sends
back the compiled grammar serialized, or the library's reason it cannot.

It lives in a process of its own so that a compile that runs away (a pathological schema or
regex) can be killed when it passes its time limit; nothing in the engine's process waits on it
but the request that asked.
"""

from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection
from typing import Any

# How JSON is written under a schema or json_object: compact, one space after ':' and ','. (Free
# whitespace lets small models pad a document with blank lines until max_tokens.)
SEPARATORS = (", ", ": ")
COMPILE_OPTIONS = f"any_whitespace=False separators={SEPARATORS} strict_mode=True"  # part of the disk cache's key


def compile_constraint(compiler: Any, kind: str, value: Any) -> Any:
    """A CompiledGrammar for one constraint; raises the library's error when it cannot."""
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(value), any_whitespace=False, separators=SEPARATORS)
    if kind == "json_object":  # any object: not strict, so that it may hold any properties
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=SEPARATORS, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if kind == "grammar":
        return compiler.compile_grammar(value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def serve(conn: Connection) -> None:
    """The process's main loop: the tokenizer info first, then (kind, value) in and ("ok",
    serialized grammar) or ("error", reason) out, one at a time."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            kind, value = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_constraint(compiler, kind, value).serialize_json()))
        except Exception as exc:  # noqa: BLE001 - every library error is the client's to read
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":  # python -m pagoda.structured.worker FD: FD is this end of a socket pair
    serve(Connection(int(sys.argv[1])))
