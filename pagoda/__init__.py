"""Pagoda: an LLM inference engine."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `pagoda bench` and `pagoda analyze` do not import torch.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagoda.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
