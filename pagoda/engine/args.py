"""Everything a user can set, and turning it into a validated EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.selector import select_backend
from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig
from pagoda.model_files import display_name, resolve_model


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    kv_cache_memory: float = 2.0  # GiB
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_queue: int | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    gpu_memory_utilization: float = (
        0.9  # GPU: share of its memory the engine may use (kv_cache_memory sizes the pool on CPU)
    )
    enforce_eager: bool = False  # GPU: no CUDA graphs
    quantization: str | None = None  # "fp8": linear weights in float8 (compute capability >= 8.9)
    load_format: str = "auto"  # "dummy": random weights of the model's config, to time a model without its weights

    def create_config(self) -> EngineConfig:
        from pagoda.model_executor.loader import load_model_config

        device = torch.device(
            "cuda"
            if self.device == "auto" and torch.cuda.is_available()
            else ("cpu" if self.device == "auto" else self.device)
        )
        path = resolve_model(self.model)
        name = self.served_model_name or display_name(self.model)
        model = load_model_config(
            path, name, self.dtype, self.max_model_len, device, self.load_format, self.quantization
        )
        backend = select_backend(self.attention_backend, device, model.dtype, model.head_dim)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                self.block_size, self.kv_cache_memory, self.enable_prefix_caching, self.gpu_memory_utilization
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model.max_model_len,
                policy=self.scheduling_policy,
                max_queue=self.max_queue,
            ),
            device=device,
            attention_backend=backend.name,
            attention_cuda_graphs=backend.support.cuda_graphs,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
        )
