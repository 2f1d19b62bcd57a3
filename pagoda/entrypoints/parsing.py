"""The argument parser every `pagoda` subcommand uses: an unknown flag names the closest known one,
and `--help` shows every flag's default. Pure Python (no torch), so `--help` stays instant."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any

UNRECOGNIZED = "unrecognized arguments: "


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends `(default: ...)` to a flag's help unless the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, foreign: dict[str, str] | None = None, **kwargs: Any) -> None:
        """`foreign`: flags of a peer's command (vLLM's) that this one does not take, each with why
        and what to do instead, said where one is given (rather than a "did you mean" that may
        name a flag of another meaning)."""
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.foreign = foreign or {}

    def error(self, message: str) -> None:  # type: ignore[override]
        super().error(with_suggestions(message, self))


def with_suggestions(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's message about unrecognized arguments, with "did you mean --X?" for each flag
    that has a close known spelling."""
    if not message.startswith(UNRECOGNIZED):
        return message
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    foreign = getattr(parser, "foreign", {})
    hints = []
    for arg in message.removeprefix(UNRECOGNIZED).split():
        flag = arg.split("=", 1)[0]
        if flag in foreign:
            hints.append(f"{flag} is a vLLM flag {parser.prog} does not take: {foreign[flag]}")
        elif re.fullmatch(r"--[\w-]+", flag) and (close := difflib.get_close_matches(flag, known, n=1, cutoff=0.6)):
            hints.append(f"{flag}: did you mean {close[0]}?")
    return "; ".join([message, *hints])
