"""Helpers for the `pagoda analyze` tests. No test here reaches a model hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # for this process and the servers and CLIs it starts


def write_log(path: Path, lines: list[dict | str]) -> Path:
    """A JSON-lines file; dicts are dumped, strings written as they are (to make bad lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def default_tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)
