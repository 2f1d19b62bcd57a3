"""JSON schemas as the grammar library reads them: the keywords that hold sub-schemas, local
$refs, and the one rewrite Pagoda makes before compiling (a discriminated oneOf as anyOf, which
means the same). Pure Python: the compile worker and the server both import it."""

from __future__ import annotations

import json
from typing import Any

SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values are name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords whose values are lists of schemas
SCHEMA_VALUES = ("items", "additionalProperties")  # keywords whose value is a schema

MISSING = object()


def resolved(root: Any, ref: str) -> Any:
    """The part of `root` a local $ref names, or MISSING."""
    node = root
    for token in ref[1:].split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return MISSING
    return node


def discriminated_as_any_of(schema: Any, root: Any = None) -> Any:
    """The schema (a copy) with each `oneOf` whose branches all pin one required property to
    distinct constants (a discriminated union, as pydantic writes one) as `anyOf`: no value can
    match two such branches, so the two mean the same, and the grammar library enforces `anyOf`
    exactly where it only approximates `oneOf` (with a warning, which Pagoda refuses)."""
    if isinstance(schema, list):
        return [discriminated_as_any_of(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    root = schema if root is None else root
    result = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: discriminated_as_any_of(sub, root) for name, sub in value.items()}
        elif key in (*SCHEMA_LISTS, *SCHEMA_VALUES):
            result[key] = discriminated_as_any_of(value, root)
        else:
            result[key] = value
    branches = result.get("oneOf")
    if "anyOf" not in result and isinstance(branches, list) and _discriminated(branches, root):
        result["anyOf"] = result.pop("oneOf")
    return result


def _discriminated(branches: list[Any], root: Any) -> bool:
    """Whether some property is required by every branch and pinned by each to its own constant."""
    pinned: list[dict[str, str]] = []  # per branch: property -> its constant, as JSON text
    for branch in branches:
        if isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and branch["$ref"].startswith("#"):
            branch = resolved(root, branch["$ref"])
        # an object, or a value of another type would match every branch's properties and required
        if (
            not isinstance(branch, dict)
            or branch.get("type") != "object"
            or not isinstance(branch.get("properties"), dict)
        ):
            return False
        required = branch.get("required") if isinstance(branch.get("required"), list) else []
        constants = {}
        for name, sub in branch["properties"].items():
            if name in required and isinstance(sub, dict):
                if "const" in sub:
                    constants[name] = json.dumps(sub["const"], sort_keys=True)
                elif isinstance(sub.get("enum"), list) and len(sub["enum"]) == 1:
                    constants[name] = json.dumps(sub["enum"][0], sort_keys=True)
        pinned.append(constants)
    shared = set.intersection(*(set(p) for p in pinned)) if len(pinned) > 1 else set()
    return any(len({p[name] for p in pinned}) == len(pinned) for name in shared)
