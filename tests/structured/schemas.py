"""JSON schemas of many shapes, each bounded (string lengths, array sizes, number ranges) so that
the default 135M model completes a valid document well within MAX_TOKENS."""

from __future__ import annotations

MAX_TOKENS = 120

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "one string": {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    "bounded integer": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
    },
    "bounded number": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["score"],
    },
    "boolean": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "string enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "integer enum": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "user"}, "id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["kind", "id"],
    },
    "array with min and max items": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
    },
    "array of bounded integers": {
        "type": "object",
        "properties": {
            "values": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["values"],
    },
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
            }
        },
        "required": ["user"],
    },
    "optional fields": {
        "type": "object",
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}, "note": NAME},
        "required": ["title"],
    },
    "ref and defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "anyOf scalar": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
        "required": ["id"],
    },
    "anyOf objects": {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["radius"],
                    },
                    {
                        "type": "object",
                        "properties": {"side": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "null": {"type": "object", "properties": {"nothing": {"type": "null"}}, "required": ["nothing"]},
    "nullable string": {
        "type": "object",
        "properties": {"nick": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["nick"],
    },
    "array of objects": {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["name", "age"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["people"],
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "date-like pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    "several required of each type": {
        "type": "object",
        "properties": {
            "name": NAME,
            "count": {"type": "integer", "minimum": 0, "maximum": 50},
            "active": {"type": "boolean"},
            "kind": {"enum": ["a", "b"]},
        },
        "required": ["name", "count", "active", "kind"],
    },
    "top-level array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 3,
    },
    "deeply nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
}
