"""Schemathesis hooks for test_server_fuzz (loaded by the `st` process through SCHEMATHESIS_HOOKS):
every generation request the fuzzer sends asks for at most MAX_NEW_TOKENS, so a case costs the
engine milliseconds. Only an absent/null limit or one in (MAX_NEW_TOKENS, CONTEXT] is lowered;
wrong types, negative values and limits past the context still reach the server as generated."""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_NEW_TOKENS = 4
CONTEXT = 2048  # the `server` fixture's --max-model-len
# each generating route's limit on new tokens, always bounded, and its other spelling, where given
GENERATING = {
    "/v1/completions": ("max_tokens", None),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens", None),
}


def bounded(value: Any) -> Any:
    if value is None:
        return MAX_NEW_TOKENS
    if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW_TOKENS < value <= CONTEXT:
        return MAX_NEW_TOKENS
    return value


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if case.operation.path not in GENERATING or not isinstance(case.body, dict):
        return
    limit, other = GENERATING[case.operation.path]
    case.body[limit] = bounded(case.body.get(limit))
    if other in case.body:
        case.body[other] = bounded(case.body[other])
