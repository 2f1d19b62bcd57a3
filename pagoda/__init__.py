"""Pagoda: an LLM inference engine."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str):
    # Lazy, so that `pagoda bench` and `pagoda analyze` do not import torch.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from pagoda.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from pagoda.lora import LoRARequest

        return LoRARequest
    if name in ("SamplingParams", "StructuredOutputsParams", "RequestOutputKind"):
        from pagoda import sampling_params

        return getattr(sampling_params, name)
    if name == "PoolingParams":
        from pagoda.pooling_params import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput"):
        from pagoda import outputs

        return getattr(outputs, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from pagoda import inputs

        return getattr(inputs, name)
    raise AttributeError(name)
