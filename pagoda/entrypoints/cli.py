"""The `pagoda` command. Each subcommand lives in its own module, imported only when used,
so that `pagoda bench` or `pagoda analyze` start without loading torch."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("pagoda.entrypoints.openai.serve", "start the OpenAI-compatible server"),
    "generate": ("pagoda.entrypoints.generate", "generate completions offline"),
    "bench": ("pagoda.bench.cli", "benchmark any OpenAI-compatible server"),
    "bakeoff": ("pagoda.bench.bakeoff", "run several engines one after another and compare"),
    "analyze": ("pagoda.analyze.cli", "measure prefix overlap in a request log"),
}


def usage() -> str:
    lines = ["usage: pagoda COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `pagoda COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from pagoda import __version__

        print(__version__)
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"pagoda: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
    except KeyboardInterrupt:  # Ctrl-C where a command does not handle it itself (generate)
        print(f"pagoda {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
