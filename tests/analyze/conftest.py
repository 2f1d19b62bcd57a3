"""Helpers for the `pagoda analyze` tests. No test here reaches a model hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # for this process and the servers and CLIs it starts

# Prompts for the validations against the engine and the server: a system prompt several blocks
# long shared by chat turns, and a completion text whose continuations share its prefix.
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in one short sentence, name the city "
    "first, and never invent facts. If you are unsure, say so plainly and suggest where to check."
)
STORY = (
    "Once upon a time, in a harbour town where the fog rolled in every evening, an old lighthouse "
    "keeper kept a logbook of every ship that passed. One night he wrote down a ship that"
)


def write_log(path: Path, lines: list[dict | str]) -> Path:
    """A JSON-lines file; dicts are dumped, strings written as they are (to make bad lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def default_tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)
