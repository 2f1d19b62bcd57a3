"""The exception types of `pagoda bench` and `pagoda bakeoff`."""

from __future__ import annotations


class BenchError(Exception):
    """A failure the user can act on (bad option, unreachable server, malformed file, launch
    failure); its message says what went wrong and, where it can, what to do."""


class NotAnswering(BenchError):
    """The server does not answer yet: nothing listens, or it answers 503 (still loading)."""
