"""The structured-output workload's tasks, and the grading of what a server answered.

Each task asks for a JSON document of one schema. The schemas differ in shape (nested objects,
arrays with minItems/maxItems, enums, bounded numbers, optional fields, $ref/$defs, anyOf,
nullable values, nested arrays) and bound every string and array, so that a small model can
finish a valid document well within the workload's default max_tokens (SmolLM2-135M's longest
answers take about 70 tokens; its tokenizer spends one token per digit). Every object sets
`additionalProperties: false`, so a document with invented keys does not validate.

Grading is strict, as a program reading the output would be: the whole text must parse as JSON
(surrounding whitespace aside; no Markdown fences, no prose) and validate against the schema.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

MESSAGE_LIMIT = 200  # characters of a grading failure kept in a record


@dataclass(frozen=True)
class JsonTask:
    name: str  # the response_format's json_schema name
    instruction: str  # with one "{}" for the subject
    subjects: tuple[str, ...]
    schema: dict[str, Any]  # read-only by convention


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema; every property required unless `required` lists fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def _text(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _num(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def _list(items: dict[str, Any], low: int, high: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


CITIES = ("Lisbon", "Osaka", "Nairobi", "Lima", "Oslo", "Hanoi", "Quebec", "Perth")
SENTENCES = (
    "Maria met Tom in Paris last spring.",
    "The delivery to Berlin arrived two days late.",
    "Ahmed and Lena hiked from Zermatt to Saas-Fee.",
    "I loved the food but the service in Rome was slow.",
    "Priya flew from Mumbai to Toronto to see Sam.",
    "The new phone is fast, cheap and easy to use.",
    "Nobody answered the phone at the office in Dublin.",
    "Kenji taught Ana to cook ramen in Sapporo.",
)

TASKS: tuple[JsonTask, ...] = (
    JsonTask(
        "person",
        "Describe a fictional {} as JSON.",
        ("nurse from Lisbon", "chess player", "retired pilot", "young baker", "museum guide", "farmer in Peru"),
        _obj({"name": _text(20), "age": _int(0, 120), "job": _text(20)}),
    ),
    JsonTask(
        "product",
        "Create a shop listing for {} as JSON.",
        ("a red kettle", "hiking boots", "a desk lamp", "a wool scarf", "a phone case", "garden gloves"),
        _obj(
            {
                "name": _text(24),
                "price": _num(0, 1000),
                "in_stock": {"type": "boolean"},
                "tags": _list(_text(10), 1, 3),
            }
        ),
    ),
    JsonTask(
        "weather",
        "Give today's weather in {} as JSON.",
        CITIES,
        _obj(
            {
                "city": _text(16),
                "temperature_c": _num(-50, 60),
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog", "wind"]},
            }
        ),
    ),
    JsonTask(
        "book",
        "Invent a book about {} and describe it as JSON.",
        ("lighthouses", "a lost cat", "space travel", "old maps", "a jazz band", "mountain trains"),
        _obj(
            {
                "title": _text(32),
                "author": _text(24),
                "year": _int(1450, 2030),
                "genres": _list({"enum": ["fiction", "history", "science", "poetry", "travel", "mystery"]}, 1, 2),
            }
        ),
    ),
    JsonTask(
        "address",
        "Write a made-up postal address in {} as JSON.",
        CITIES,
        _obj(
            {
                "recipient": _text(24),
                "address": _obj(
                    {"street": _text(32), "city": _text(16), "country": _text(16)},
                ),
            }
        ),
    ),
    JsonTask(
        "order",
        "Record an online order for {} as JSON.",
        ("three notebooks", "a bike light and a bell", "coffee beans", "two lamps", "a tent", "paint and brushes"),
        _obj(
            {
                "order_id": _int(1, 99999),
                "items": _list(_obj({"sku": _text(6), "quantity": _int(1, 10)}), 1, 2),
                "total": _num(0, 10000),
            }
        ),
    ),
    JsonTask(
        "event",
        "Plan {} and give it as JSON.",
        ("a birthday party", "a team meeting", "a book club", "a concert", "a picnic", "a chess tournament"),
        _obj(
            {
                "title": _text(32),
                "month": _int(1, 12),
                "day": _int(1, 31),
                "location": _text(24),
                "online": {"type": "boolean"},
            },
            required=["title", "month", "day"],
        ),
    ),
    JsonTask(
        "shape",
        "Describe {} as JSON: a circle or a rectangle.",
        ("a coin", "a door", "a pizza", "a window", "a clock face", "a sheet of paper"),
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj({"kind": {"const": "circle"}, "radius": _num(0, 100)}),
                        _obj({"kind": {"const": "rectangle"}, "width": _num(0, 100), "height": _num(0, 100)}),
                    ]
                }
            }
        ),
    ),
    JsonTask(
        "route",
        "Give a short walking route near {} as grid points in JSON.",
        CITIES,
        _obj(
            {
                "start": {"$ref": "#/$defs/point"},
                "end": {"$ref": "#/$defs/point"},
                "stops": _list({"$ref": "#/$defs/point"}, 0, 2),
            },
            **{"$defs": {"point": _obj({"x": _int(-99, 99), "y": _int(-99, 99)})}},
        ),
    ),
    JsonTask(
        "review",
        "Review {} as JSON.",
        ("a silent film", "a space opera", "a cooking show", "a war drama", "a cartoon", "a detective series"),
        _obj(
            {
                "title": _text(24),
                "stars": _int(1, 5),
                "summary": _text(40),
                "recommended": {"type": "boolean"},
            }
        ),
    ),
    JsonTask(
        "recipe",
        "Write a short recipe for {} as JSON.",
        ("pancakes", "tomato soup", "fried rice", "lemonade", "guacamole", "banana bread"),
        _obj(
            {
                "dish": _text(20),
                "servings": _int(1, 12),
                "ingredients": _list(_obj({"name": _text(12), "grams": _int(1, 1000)}), 2, 3),
            }
        ),
    ),
    JsonTask(
        "todo",
        "List the tasks for {} as JSON.",
        ("moving house", "a school trip", "a garden party", "a job interview", "a bike repair", "a tax return"),
        _obj(
            {
                "tasks": _list(
                    _obj({"title": _text(24), "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}}),
                    1,
                    3,
                )
            }
        ),
    ),
    JsonTask(
        "sentiment",
        'Classify the sentiment of this sentence as JSON: "{}"',
        SENTENCES,
        _obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": _num(0, 1)}),
    ),
    JsonTask(
        "entities",
        'Extract the people and places from this sentence as JSON: "{}"',
        SENTENCES,
        _obj({"people": _list(_text(16), 0, 3), "places": _list(_text(16), 0, 3)}),
    ),
    JsonTask(
        "contact",
        "Give the contact card of {} as JSON; use null for an unknown phone number.",
        ("a plumber", "a dentist", "a neighbour", "a piano teacher", "a taxi firm", "a florist"),
        _obj({"name": _text(24), "phone": {"anyOf": [_text(15), {"type": "null"}]}}),
    ),
    JsonTask(
        "grid",
        "Fill a small grid of digits for {} as JSON.",
        ("a sudoku corner", "a game board", "a pixel icon", "a seating plan", "a heat map", "a dice game"),
        _obj({"rows": _list(_list(_int(0, 9), 2, 3), 2, 3)}),
    ),
)


def user_message(task: JsonTask, subject: str) -> str:
    """The request's text: the task and, as vLLM's structured-output benchmark does, the schema,
    so that a server that ignores response_format still has a fair chance."""
    return (
        f"{task.instruction.format(subject)} Reply with only the JSON document, "
        f"following this JSON schema: {json.dumps(task.schema, separators=(',', ':'))}"
    )


def response_format(task: JsonTask) -> dict[str, Any]:
    """OpenAI's spelling, the one every OpenAI-compatible server that takes schemas reads."""
    return {"type": "json_schema", "json_schema": {"name": task.name, "schema": task.schema, "strict": True}}


def schema_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The schema a request body's `response_format` asks for (json_object: any object); None
    when it asks for none."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if fmt.get("type") == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return spec["schema"]
    return None


def grade(text: str, schema: dict[str, Any], cut: bool = False) -> str | None:
    """None when `text` is a JSON document valid against `schema`, else why not (`cut`: the
    output ended at max_tokens, which is said, as it is the usual reason for broken JSON)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        ending = " (the output reached max_tokens)" if cut else ""
        return shorten(f"not JSON{ending}: {exc.msg} at character {exc.pos}")
    try:
        error = jsonschema.exceptions.best_match(_validator(json.dumps(schema, sort_keys=True)).iter_errors(document))
    except jsonschema.SchemaError as exc:
        return shorten(f"the request's schema is not valid JSON Schema: {exc.message}")
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "the top level"
    return shorten(f"does not match the schema at {where}: {error.message}")


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def shorten(message: str) -> str:
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 3] + "..."
