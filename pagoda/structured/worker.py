"""The grammar compiler's worker process: compiles one constraint at a time with xgrammar and sends
back the compiled grammar serialized, or the library's reason it cannot.

It lives in a process of its own so that a compile that runs away (a pathological schema or
regex) can be killed when it passes its time limit; nothing in the engine's process waits on it
but the request that asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from pagoda.structured.schema import discriminated_as_any_of

# How JSON is written under a schema or json_object: compact, one space after ':' and ','. (Free
# whitespace lets small models pad a document with blank lines until max_tokens.)
SEPARATORS = (", ", ": ")
JSON_WRITING = {"any_whitespace": False, "separators": SEPARATORS}  # every JSON grammar's, however compiled
# part of the disk cache's key: a grammar xgrammar warned about was cached before such warnings were
# refused, and is again for a constraint that is not strict (whose key differs from a strict one's);
# a structural tag's JSON took any whitespace before compact_json
COMPILE_OPTIONS = (
    f"any_whitespace=False separators={SEPARATORS} strict_mode=True warnings=refused-if-strict "
    "structural-tag-json=compact"
)
# xgrammar's C++ log line for a part of the constraint it does not enforce, e.g. "[13:12:09]
# /project/cpp/json_schema_converter.cc:1199: Warning: format combined with minLength/maxLength
# is not supported; ignoring minLength/maxLength"
LIBRARY_WARNING = re.compile(r"Warning: (.*)")
# the one warning that weakens nothing: an escaped character that is not an ASCII letter or digit
# matches itself, as in Python's re (re.escape writes "\ ", "\#", a backslash before a newline).
# The whole warning must be this one (a warning that quotes a pattern could hold its words); the
# character is shown as itself, or escaped where it is not printable ASCII ('\\n', '\\xe9'). An
# unknown escaped ASCII letter or digit (\q) stays refused, as Python's re refuses it.
LITERAL_ESCAPE = re.compile(
    r"Regex parsing warning at position \d+: Escape sequence "
    r"'\\(?P<char>[^\\]|\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[ntrfv0]))' "
    r"is not recognized\. The character itself will be matched"
)


def weakens(warning: str) -> bool:
    """Whether xgrammar's warning means its grammar enforces less than the constraint asks."""
    literal = LITERAL_ESCAPE.fullmatch(warning)
    return literal is None or (literal["char"].isascii() and literal["char"].isalnum())


def compile_constraint(compiler: Any, kind: str, value: Any) -> Any:
    """A CompiledGrammar for one constraint; raises the library's error when it cannot."""
    if kind == "json":
        schema = json.dumps(discriminated_as_any_of(value))
        return compiler.compile_json_schema(schema, **JSON_WRITING)
    if kind == "json_object":  # any object: not strict, so that it may hold any properties
        return compiler.compile_json_schema('{"type": "object"}', **JSON_WRITING, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if kind == "grammar":
        return compiler.compile_grammar(value)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), its JSON written as
    every JSON constraint's is (compact_json)."""
    return compiler.compile_structural_tag(json.dumps(compact_json(json.loads(text))))


def compact_json(node: Any) -> Any:
    """A structural tag's formats with each JSON schema (of the plain JSON style, without options the
    grammar of a JSON constraint has none of: any_order, excludes, max_whitespace_cnt, left to the
    library) as the grammar a JSON constraint compiles to (compact, one space after ':' and ',';
    objects only of their properties), where the library's own JSON format takes any whitespace."""
    import xgrammar

    if isinstance(node, list):
        return [compact_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    plain = not (node.get("any_order") or node.get("excludes") or node.get("max_whitespace_cnt"))
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" and plain:
        schema = json.dumps(discriminated_as_any_of(node["json_schema"]))
        grammar = xgrammar.Grammar.from_json_schema(schema, **JSON_WRITING, strict_mode=True)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: compact_json(value) for key, value in node.items()}


@contextlib.contextmanager
def library_warnings() -> Iterator[list[str]]:
    """The warnings the library's C++ code writes to file descriptor 2 while the block runs, which
    Python's own warnings machinery never sees; filled in when the block ends."""
    warnings: list[str] = []
    with tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield warnings
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            warnings.extend(m.group(1).strip() for m in map(LIBRARY_WARNING.search, text.splitlines()) if m)


def serve(conn: Connection) -> None:
    """The process's main loop: the tokenizer info first, then (kind, value, strict) in and ("ok",
    serialized grammar, the library's warnings of what it leaves unenforced) or ("error", reason,
    []) out, one at a time; a strict constraint the library would enforce less of is an error."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            kind, value, strict = conn.recv()
        except EOFError:
            return
        try:
            with library_warnings() as warnings:
                compiled = compile_constraint(compiler, kind, value)
        except Exception as exc:  # noqa: BLE001 - every library error is the client's to read
            conn.send(("error", f"{type(exc).__name__}: {exc}", []))
            continue
        weakening = [warning for warning in warnings if weakens(warning)]
        if weakening and strict:  # the library would enforce less than asked: outputs could break the constraint
            reason = f"structured outputs cannot enforce this {kind} constraint as given: {weakening[0]}"
            conn.send(("error", reason, []))
        else:
            conn.send(("ok", compiled.serialize_json(), weakening))


if __name__ == "__main__":  # python -m pagoda.structured.worker FD: FD is this end of a socket pair
    serve(Connection(int(sys.argv[1])))
