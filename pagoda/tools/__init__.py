"""Tool calling and reasoning in model output: parsers that find tool calls (several model formats and Pagoda's
generic one) and reasoning, in the whole text or as it streams. Pure Python: the server feeds them text."""

from pagoda.tools.parsers import (
    HELD_PARSERS,
    PARSERS,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    detect_parser,
    get_parser,
)
from pagoda.tools.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStreamer, get_reasoning_parser

__all__ = [
    "HELD_PARSERS",
    "PARSERS",
    "REASONING_PARSERS",
    "ParsedOutput",
    "ReasoningParser",
    "ReasoningStreamer",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "detect_parser",
    "get_parser",
    "get_reasoning_parser",
]
