"""Shared fixtures: the default model loaded once, its transformers reference, tiny random models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pagoda.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_reference(default_model_dir):
    """transformers' own model on the same weights, fp32 CPU: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():
    """The default model with default settings (many requests in flight)."""
    from pagoda import LLM

    return LLM(kv_cache_memory=0.5, max_model_len=2048)
