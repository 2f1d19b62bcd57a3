"""Engine configuration: frozen dataclasses, validated once at startup and never mutated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pagoda.errors import ConfigError

if TYPE_CHECKING:  # the scheduler's configs stay importable without torch
    import torch

    from pagoda.pooling_params import PoolerConfig


@dataclass(frozen=True)
class ThreadConfig:
    num_threads: int | None = None  # None: auto (all allowed CPUs, adapting to other processes' load)
    bind_cores: tuple[int, ...] | None = None  # pin thread i to bind_cores[i]; fixes the count

    @property
    def adaptive(self) -> bool:
        return self.num_threads is None and self.bind_cores is None


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6); ValueError on anything else."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a list of CPU ids like 0-3,6")
        if int(last or first) < int(first):
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cores += range(int(first), int(last or first) + 1)
    if len(set(cores)) != len(cores):
        raise ValueError(f"{text!r} names a CPU twice")
    return tuple(cores)


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
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict = field(default_factory=dict, compare=False)
    tokenizer: str | None = None  # an HF directory or .gguf file of another tokenizer; None: the model's
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights of the config's shapes
    # fp8: linear weights in float8_e4m3fn (GPU); gguf: a GGUF file's Q4_0/Q4_1/Q8_0 tensors kept as
    # stored; int8: per-channel int8 linear weights and LM head (CPU)
    quantization: Literal["fp8", "gguf", "int8"] | None = None
    gguf_file: str | None = None  # the .gguf file `path` was converted from, if any
    expert_layers: tuple[int, ...] = ()  # the layers whose MLP is a mixture of experts
    # the checkpoint is the bare decoder (an `XModel` architecture, `architecture` naming its
    # XForCausalLM): no LM head, its weights' names without "model."; served as a pooling model
    headless: bool = False
    lm_head: bool = True  # the model computes logits; False: a pooling model's (no LM head read or built)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0  # sizes the pool on CPU
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # on a GPU: the share of its memory for weights, activations, graphs and KV
    kv_cache_dtype: Literal["auto", "bfloat16"] = "auto"  # auto: the model's dtype (EngineArgs resolves the flag)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.kv_cache_memory_gib < math.inf:  # NaN fails too
            raise ConfigError(f"kv_cache_memory must be a finite number > 0 GiB, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    policy: Literal["fcfs", "lpm", "priority"] = "fcfs"
    max_queue: int | None = None  # waiting requests beyond this are refused (server: 503)
    # while any running request decodes, a step takes at most this many prompt tokens, so a long
    # prefill chunk does not stall every decode in the step; None: only max_num_batched_tokens
    max_prefill_with_decodes: int | None = None
    # while any running request decodes, a prompt with at most this many tokens left to compute
    # gets a step of its own, one prompt a step, at most two in a row, then one beside the decodes;
    # None: prompts share the decodes' steps (docs/engine.md: How a step works)
    prefill_alone_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_with_decodes is not None and self.max_prefill_with_decodes < 1:
            raise ConfigError(f"max_prefill_with_decodes must be >= 1, got {self.max_prefill_with_decodes}")
        if self.prefill_alone_threshold is not None and self.prefill_alone_threshold < 1:
            raise ConfigError(f"prefill_alone_threshold must be >= 1, got {self.prefill_alone_threshold}")
        if self.policy not in ("fcfs", "lpm", "priority"):
            raise ConfigError(f"scheduling policy must be 'fcfs', 'lpm' or 'priority', got {self.policy!r}")


# Speculation is off for a step whose running batch is larger than its method's limit: verifying
# k + 1 rows per request stops paying once a plain decode step is no longer bound by reading the
# weights, and a draft model's k passes cost more the larger the batch they run over
# (docs/speculative_decoding.md says how each was measured).
SPEC_MAX_BATCH_SIZE = {"ngram": 8, "draft_model": 2}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`): "ngram" proposes the continuation of
    the longest recent match of the request's last prompt_lookup_min..max tokens in its own
    tokens, "draft_model" the greedy tokens of a smaller model with the same vocabulary; the
    target verifies num_speculative_tokens per request in one forward pass."""

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch_size: int | None = None  # larger batches decode without speculation; None: SPEC_MAX_BATCH_SIZE[method]
    model: str | None = None  # draft_model: the draft's HF directory or GGUF file
    quantization: str | None = None  # draft_model: how the draft's weights are kept (--quantization)
    draft: EngineConfig | None = field(default=None, repr=False, compare=False)  # the draft's engine

    def __post_init__(self) -> None:
        # the JSON of --speculative-config reaches here unchecked: a float or a string where a count
        # belongs would pass the comparisons below, or fail in them, or only at the first draft
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch_size"):
            value = getattr(self, name)
            if not (value is None and name == "max_batch_size") and (type(value) is not int):
                raise ConfigError(f"speculative_config.{name} must be an integer, got {value!r}")
        for name in ("model", "quantization"):
            if not isinstance(getattr(self, name), str | None):
                raise ConfigError(f"speculative_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.method not in ("ngram", "draft_model"):
            raise ConfigError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model is needed by, and only by, method 'draft_model'")
        if self.quantization is not None and self.model is None:
            raise ConfigError("speculative_config.quantization applies only to a draft model")
        if self.num_speculative_tokens < 1:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.max_batch_size is None:
            object.__setattr__(self, "max_batch_size", SPEC_MAX_BATCH_SIZE[self.method])
        if self.max_batch_size < 1:
            raise ConfigError(f"speculative_config.max_batch_size must be >= 1, got {self.max_batch_size}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    attention_backend: str  # the name the selector chose (pagoda/attention/selector.py)
    attention_cuda_graphs: bool  # whether that backend's forward can be captured (BackendSupport.cuda_graphs)
    seed: int = 0
    threads: ThreadConfig = ThreadConfig()
    enforce_eager: bool = False  # never replay CUDA graphs
    grammar_compile_timeout: float = 10.0  # seconds a structured-output constraint may take to compile
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # batch-invariant kernels: a request's logits are bitwise the same whatever else shares its steps,
    # however its prompt was chunked and whatever of it came from the prefix cache (docs/determinism.md)
    deterministic: bool = False
    enable_lora: bool = False  # requests may run LoRA adapters (pagoda/lora.py)
    max_lora_rank: int = 16  # the largest rank an adapter may have
    # adapters held read at once, the least recently used dropped past it (read again at its next
    # use); None: every adapter read stays
    max_cpu_loras: int | None = None
    # the pooling runner (vLLM's --runner pooling): requests are embeddings, made this way; None:
    # the generate runner (requests sample tokens)
    pooler: PoolerConfig | None = None

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on a GPU, with a backend that can be captured, unless
        eager execution is enforced, LoRA is on (a graph would replay one step's adapter rows) or
        the model is a mixture of experts (its step reads on the host how many rows each expert takes)."""
        eager = self.enforce_eager or self.enable_lora or bool(self.model.expert_layers)
        return self.device.type == "cuda" and self.attention_cuda_graphs and not eager
