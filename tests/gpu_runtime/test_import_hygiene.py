"""The GPU machine has no fastapi, pydantic, uvicorn or gguf: the engine, model and attention code
must import, and the offline engine run, without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABSENT = ("fastapi", "pydantic", "pydantic_core", "uvicorn", "starlette", "gguf")

SCRIPT = """
import importlib, pkgutil, sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` now raises ImportError, and find_spec returns None
for package in ("pagoda.engine", "pagoda.model_executor", "pagoda.attention"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(info.name)
from pagoda import LLM, SamplingParams
llm = LLM({model!r}, load_format="dummy", kv_cache_memory=0.01, max_model_len=64)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
loaded = [name for name in {absent!r} if sys.modules.get(name) is not None]
assert not loaded, loaded
print("ok")
"""


def test_engine_imports_and_runs_without_server_or_gguf_packages(tokenizer, tmp_path):
    from .conftest import write_config_dir

    write_config_dir("llama", tmp_path / "llama", tokenizer)
    script = SCRIPT.format(absent=ABSENT, model=str(tmp_path / "llama"))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
