"""The argument parser every `pagoda` subcommand uses: an unknown flag names the closest known one,
`--help` shows every flag's default, and where asked for, `--config FILE` reads flags from a YAML
file as vLLM's does. Pure Python (no torch), so `--help` stays instant."""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
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
    def __init__(
        self, *args: Any, foreign: dict[str, str] | None = None, config_file: bool = False, **kwargs: Any
    ) -> None:
        """`foreign`: flags of a peer's command (vLLM's) that this one does not take, each with why
        and what to do instead, said where one is given (rather than a "did you mean" that may
        name a flag of another meaning). `config_file`: take `--config FILE`."""
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.foreign = foreign or {}
        self.config_file = config_file
        self._reading: str | None = None  # the --config file whose flags are being parsed
        if config_file:
            self.add_argument(
                "--config",
                action=_Once,
                metavar="FILE",
                default=None,
                help="a YAML file of flags, as vLLM's --config: each key a flag's name without its dashes "
                "(`max-num-seqs: 64`; underscores also do), true or false for an on/off flag, a list for "
                "several values, a mapping for a JSON flag; the command line's flags win over the file's, "
                "its MODEL over the file's model (default: none)",
            )

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """With --config, the file's flags parsed first, then the command line's over them: what the
        command line sets wins, the file's values stand for the rest, the defaults for what neither
        names (argparse only fills in defaults a namespace lacks). A flag of several values given on
        the command line replaces the file's (rather than adding to them: a key replaced there must
        stop working), and a key naming a positional argument fills it where the command line
        leaves it out (vLLM's rule for the model)."""
        parsed, extras = super().parse_known_args(args, namespace)
        path = getattr(parsed, "config", None) if self.config_file and namespace is None else None
        if path is None:
            return parsed, extras
        self._reading = path
        try:
            words, positionals = self.config_flags(path)
            from_file, stray = super().parse_known_args(words)
            if stray:
                self.error(f"values argparse read as flags: {' '.join(stray)}")
        finally:
            self._reading = None
        merged, extras = super().parse_known_args(args, from_file)
        for action in self._actions:
            if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
                if getattr(parsed, action.dest) != action.default:
                    setattr(merged, action.dest, getattr(parsed, action.dest))
        for dest, value in positionals.items():
            spelled = self._option_string_actions.get("--" + dest.replace("_", "-"))  # serve's --model
            given = spelled is not None and getattr(parsed, spelled.dest) != spelled.default
            if getattr(merged, dest) in (None, []) and not given:
                setattr(merged, dest, value)
                merged.filled_from_config = (*getattr(merged, "filled_from_config", ()), dest)
        return merged, extras

    def config_flags(self, path: str) -> tuple[list[str], dict[str, str]]:
        """The YAML file's flags as command-line words, each key checked against this command's
        flags; and the values of the keys that name a positional argument, by its name."""
        import yaml

        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            self.error(f"cannot read it: {getattr(exc, 'strerror', None) or exc}")
        except yaml.YAMLError as exc:
            self.error(f"not YAML: {exc}")
        if config is None:  # an empty file
            return [], {}
        if not isinstance(config, dict):
            self.error(f"a YAML mapping of flag names to values, such as 'port: 8000', not a {type(config).__name__}")
        positional = {action.dest: action for action in self._actions if not action.option_strings}
        words, positionals = [], {}
        for key, value in config.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name in positional:
                positionals[name] = self._positional_value(positional[name], key, value)
                continue
            flag = "--" + name.replace("_", "-")
            action = self._option_string_actions.get(flag)
            if flag == "--config" or action is None:
                hint = "a file cannot name another file" if flag == "--config" else flag_hint(flag, self)
                self.error(f"unknown key {key!r}" + (f" ({hint})" if hint else ""))
            words += self._flag_words(flag, action, key, value)
        return words, positionals

    def _positional_value(self, action: argparse.Action, key: object, value: object) -> str | list[str]:
        """A file's value for a positional argument: a string, or for one of several values (generate's
        prompts) a string or a list of them."""
        several = action.nargs in ("*", "+")
        if isinstance(value, str):
            return [value] if several else value
        if several and isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        self.error(f"{key!r} must be {'a string or a list of strings' if several else 'a string'}, not {value!r}")

    def _flag_words(self, flag: str, action: argparse.Action, key: object, value: object) -> list[str]:
        if value is None:
            self.error(f"{key!r} has no value")
        if action.nargs == 0:  # an on/off flag
            if not isinstance(value, bool):
                self.error(f"{key!r} is on or off: true or false, not {value!r}")
            off = "--no-" + flag.removeprefix("--")
            return [flag] if value else [off] if off in self._option_string_actions else []
        if isinstance(value, list) and action.nargs in ("+", "*"):
            if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):  # each value its own word
                return [f"{flag}={_word(item)}" for item in value]  # an empty list: none given (vLLM's rule)
            if any(_word(item).startswith("-") for item in value):
                self.error(f"{key!r}: a value of a list may not start with '-'")
            return [flag, *map(_word, value)] if value else []
        return [f"{flag}={_word(value)}"]  # one word: a value that starts with "-" stays a value

    def error(self, message: str) -> None:  # type: ignore[override]
        if self._reading is not None:
            message = f"--config {self._reading}: {message}"
        super().error(with_suggestions(message, self))


class _Once(argparse.Action):
    """A flag given at most once (a second --config would silently drop the first)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"give {option} once")
        setattr(namespace, self.dest, values)


def _word(value: object) -> str:
    """A YAML value as a flag's word: JSON for a list or mapping, true/false for a boolean."""
    if isinstance(value, (list, dict, bool)):
        return json.dumps(value)
    return str(value)


def with_suggestions(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's message about unrecognized arguments, with "did you mean --X?" for each flag
    that has a close known spelling."""
    if not message.startswith(UNRECOGNIZED):
        return message
    hints = [hint for arg in message.removeprefix(UNRECOGNIZED).split() if (hint := flag_hint(arg, parser))]
    return "; ".join([message, *hints])


def flag_hint(arg: str, parser: argparse.ArgumentParser) -> str | None:
    """For a word the parser does not know: why, where it is a peer's flag this command does not
    take, else the closest known flag, if any."""
    flag = arg.split("=", 1)[0]
    foreign = getattr(parser, "foreign", {})
    if flag in foreign:
        return f"{flag} is a vLLM flag {parser.prog} does not take: {foreign[flag]}"
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    if re.fullmatch(r"--[\w-]+", flag) and (close := difflib.get_close_matches(flag, known, n=1, cutoff=0.6)):
        return f"{flag}: did you mean {close[0]}?"
    return None
