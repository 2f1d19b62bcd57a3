"""Engine configuration: frozen dataclasses, validated once at startup and never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says why and what is supported."""


@dataclass(frozen=True)
class ModelConfig:
    path: str  # an HF directory (a GGUF file is converted to one on first load)
    name: str  # the name the server reports
    architecture: str
    hf_config: object = field(repr=False, compare=False)
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    policy: Literal["fcfs", "lpm"] = "fcfs"
    max_queue: int | None = None  # waiting requests beyond this are refused (server: 503)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "lpm"):
            raise ConfigError(f"scheduling policy must be 'fcfs' or 'lpm', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    attention_backend: str  # "torch" or "triton"
    seed: int = 0
