"""The tool-calling workload's tools and prompts, and the grading of the calls a server answered.

Each request offers a few of the built-in tools (OpenAI's `tools`, each with a JSON-schema
`parameters`) and asks, in the user's words, for something one of them does. Every string is
bounded, every number has a range and several choices are enums, so that a small model can
finish a valid call well within the workload's default max_tokens; every parameters object sets
`additionalProperties: false`, so invented arguments do not validate.

Grading is what an agent loop reading the answer needs: at least one call, each naming one of the
request's tools, with `arguments` that parse as a JSON object valid against that tool's
parameters (`jsonschema`). Agreement compares a streamed answer's calls with the calls of the
same request answered without streaming: names and argument strings byte for byte, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.bench import schemas

TOOL_CHOICES = ("required", "auto", "named")  # named: force the tool the prompt is about
TOOLS_PER_REQUEST = 3  # the one the prompt is about and two others, in a seeded order
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a tool without parameters


@dataclass(frozen=True)
class Call:
    """One tool call as the server wrote it: `arguments` is its JSON text, byte for byte."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # read-only by convention
    request: str  # what a user asks that needs this tool, with one "{}" for the subject
    subjects: tuple[str, ...]

    def spec(self) -> dict[str, Any]:
        """OpenAI's spelling of the tool, as every OpenAI-compatible server reads it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _params(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A parameters object; every property required unless `required` lists fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _text(max_length: int, description: str) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length, "description": description}


def _int(low: int, high: int, description: str) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high, "description": description}


def _enum(values: Sequence[str], description: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values), "description": description}


CURRENCIES = ("USD", "EUR", "GBP", "JPY", "INR", "BRL", "CHF")

TOOLS: tuple[Tool, ...] = (
    Tool(
        "get_weather",
        "Current weather in a city.",
        _params(
            {"city": _text(24, "city name"), "unit": _enum(("celsius", "fahrenheit"), "temperature unit")},
            required=["city"],
        ),
        "What is the weather like in {} right now?",
        schemas.CITIES,
    ),
    Tool(
        "get_time",
        "Current local time in a city.",
        _params({"city": _text(24, "city name")}),
        "What time is it in {} at the moment?",
        schemas.CITIES,
    ),
    Tool(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        _params(
            {
                "amount": _int(1, 1000000, "amount to convert"),
                "from_currency": _enum(CURRENCIES, "currency of the amount"),
                "to_currency": _enum(CURRENCIES, "currency wanted"),
            }
        ),
        "How much is {}?",
        (
            "250 US dollars in euros",
            "80 pounds in Japanese yen",
            "1200 Swiss francs in dollars",
            "40 euros in Indian rupees",
            "500 Brazilian reais in pounds",
            "9000 yen in euros",
        ),
    ),
    Tool(
        "search_web",
        "Search the web and return the top results.",
        _params({"query": _text(48, "search terms"), "max_results": _int(1, 10, "number of results")}, ["query"]),
        "Search the web for {}.",
        (
            "cheap flights to Oslo",
            "the history of the bicycle",
            "vegan lasagne recipes",
            "the tallest waterfall in Africa",
            "reviews of electric scooters",
            "opening hours of the Louvre",
        ),
    ),
    Tool(
        "create_calendar_event",
        "Add an event to the user's calendar.",
        _params(
            {
                "title": _text(32, "what the event is"),
                "month": _int(1, 12, "month, 1-12"),
                "day": _int(1, 31, "day of the month"),
                "hour": _int(0, 23, "starting hour, 0-23"),
            }
        ),
        "Put {} in my calendar.",
        (
            "a dentist appointment on March 3 at 9am",
            "lunch with Sara on June 12 at 1pm",
            "the team meeting on October 7 at 10am",
            "a flight to Lima on December 20 at 6am",
            "yoga class on April 15 at 6pm",
            "my mother's birthday dinner on August 2 at 8pm",
        ),
    ),
    Tool(
        "send_email",
        "Send a short email.",
        _params(
            {
                "to": _text(40, "recipient's email address"),
                "subject": _text(40, "subject line"),
                "body": _text(80, "the message"),
            }
        ),
        "Send an email to {}.",
        (
            "ana@example.com saying the meeting moved to Friday",
            "tom@example.org to thank him for the book",
            "hr@example.com asking for a day off on Monday",
            "lena@example.net that I will be ten minutes late",
            "support@example.com about my broken order",
            "sam@example.com with the address of the party",
        ),
    ),
    Tool(
        "set_timer",
        "Start a countdown timer.",
        _params({"minutes": _int(1, 720, "length in minutes"), "label": _text(24, "what it is for")}, ["minutes"]),
        "Set a timer for {}.",
        (
            "15 minutes for the pasta",
            "45 minutes of study",
            "5 minutes for the tea",
            "90 minutes for the bread",
            "20 minutes for a nap",
            "2 minutes for the eggs",
        ),
    ),
    Tool(
        "translate_text",
        "Translate a short text into another language.",
        _params(
            {
                "text": _text(60, "the text to translate"),
                "target_language": _enum(("French", "Spanish", "German", "Japanese", "Italian"), "language wanted"),
            }
        ),
        "Translate {}.",
        (
            "'good morning' into French",
            "'where is the station?' into German",
            "'thank you very much' into Japanese",
            "'the bill, please' into Italian",
            "'I am lost' into Spanish",
            "'see you tomorrow' into French",
        ),
    ),
    Tool(
        "get_stock_price",
        "Latest price of a company's shares.",
        _params({"symbol": _text(6, "ticker symbol, like AAPL")}),
        "What are {} shares trading at?",
        ("Apple", "Tesla", "Microsoft", "Amazon", "Nvidia", "Netflix"),
    ),
    Tool(
        "book_restaurant",
        "Reserve a table at a restaurant.",
        _params(
            {
                "restaurant": _text(32, "restaurant name"),
                "party_size": _int(1, 12, "number of people"),
                "hour": _int(11, 23, "hour of the booking, 11-23"),
            }
        ),
        "Book a table for {}.",
        (
            "four at Luigi's at 8pm",
            "two at Sakura Sushi at 7pm",
            "six at The Green Fork at noon",
            "three at Casa Lola at 9pm",
            "two at Le Petit Bistro at 1pm",
            "eight at Golden Dragon at 6pm",
        ),
    ),
    Tool(
        "play_music",
        "Play music on the user's speaker.",
        _params({"query": _text(32, "song, artist or genre"), "shuffle": {"type": "boolean"}}, ["query"]),
        "Play {}.",
        (
            "some jazz by Miles Davis",
            "Bohemian Rhapsody",
            "relaxing piano music",
            "the latest album by Adele",
            "80s rock",
            "bossa nova",
        ),
    ),
    Tool(
        "get_directions",
        "Directions from one place to another.",
        _params(
            {
                "origin": _text(32, "where to start"),
                "destination": _text(32, "where to go"),
                "mode": _enum(("walking", "driving", "transit", "cycling"), "how to travel"),
            }
        ),
        "How do I get {}?",
        (
            "from the train station to the museum by bike",
            "from my hotel to the airport by bus",
            "from the harbour to the old town on foot",
            "from the university to the stadium by car",
            "from Central Park to the Brooklyn Bridge by subway",
            "from the beach to the castle walking",
        ),
    ),
)
BY_NAME = {tool.name: tool for tool in TOOLS}


def tool_choice(choice: str, tool: Tool) -> str | dict[str, Any]:
    """The request's `tool_choice` for one of TOOL_CHOICES; "named" forces `tool`."""
    if choice == "named":
        return {"type": "function", "function": {"name": tool.name}}
    return choice


def requires_calls(body: dict[str, Any]) -> bool:
    """Whether a body offers tools and forces a call ("required" or a named function): its
    answer must call one, so a replayed body like it is graded."""
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def tools_of(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The body's tools, name -> parameters schema (a tool without parameters takes any object)."""
    functions = [tool.get("function") for tool in body.get("tools") or () if isinstance(tool, dict)]
    return {
        f["name"]: f.get("parameters") or ANY_ARGUMENTS
        for f in functions
        if isinstance(f, dict) and isinstance(f.get("name"), str)
    }


def grade_calls(calls: Sequence[Call], tools: dict[str, dict[str, Any]], cut: bool = False) -> str | None:
    """None when there is a call and every call names one of `tools` with arguments that parse as
    a JSON object valid against its parameters, else why not (`cut`: the output ended at
    max_tokens, which is said, as it is the usual reason for broken or missing calls)."""
    if not calls:
        return "no tool calls" + (" (the output reached max_tokens)" if cut else "")
    for i, call in enumerate(calls):
        if call.name not in tools:
            return schemas.shorten(f"call {i}: {call.name!r} is not one of the request's tools {sorted(tools)}")
        problem = schemas.grade(call.arguments, tools[call.name], cut)
        if problem is not None:
            return schemas.shorten(f"call {i} ({call.name}) arguments: {problem}")
    return None


def compare_calls(streamed: Sequence[Call], whole: Sequence[Call]) -> str | None:
    """None when the streamed calls equal the non-streamed ones (names and argument text, in
    order), else the first difference."""
    if len(streamed) != len(whole):
        return f"{len(streamed)} calls streamed, {len(whole)} not streamed"
    for i, (a, b) in enumerate(zip(streamed, whole)):
        if a.name != b.name:
            return schemas.shorten(f"call {i}: streamed {a.name!r}, not streamed {b.name!r}")
        if a.arguments != b.arguments:
            return schemas.shorten(
                f"call {i} ({a.name}) arguments: streamed {a.arguments!r}, not streamed {b.arguments!r}"
            )
    return None
