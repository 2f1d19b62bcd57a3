"""Fixtures for the GPU runtime's CPU tests. The graph runner is exercised with the Triton backend
under Triton's interpreter, which Triton reads when it is first imported: set it here, at import,
as tests/attention does."""

from __future__ import annotations

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/gpu_runtime set TRITON_INTERPRET=1; export it instead")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tests.tiny_models import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from pagoda.model_files import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_llama(tokenizer, tmp_path_factory):
    """A tiny random Llama with weights (config, safetensors, tokenizer)."""
    return write_tiny_model("llama", tmp_path_factory.mktemp("gpu_runtime") / "llama", tokenizer)


def write_config_dir(arch: str, out, tokenizer):
    """A model directory with no weights (config.json and tokenizer files): load_format="dummy"."""
    from transformers import AutoConfig

    write_tiny_model(arch, out, tokenizer)
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    return AutoConfig.from_pretrained(out)
