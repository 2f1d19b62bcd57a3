"""Everything a user can set, and turning it into a validated EngineConfig.

Each field's metadata carries its help, and its choices where there are few: `add_cli_args`
makes every field a flag of `pagoda serve` and `pagoda generate` from them, so an option added
here is at once a keyword of `LLM(...)` and a flag of both commands. This module imports no torch
(`pagoda serve --help` stays instant); `create_config` imports it when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, ThreadConfig, parse_cores
from pagoda.errors import ConfigError
from pagoda.model_files import display_name, gguf_path, resolve_model
from pagoda.sampling_params import INT64_MAX, INT64_MIN

logger = logging.getLogger(__name__)

if typing.TYPE_CHECKING:
    import torch

# The CPU default of --max-prefill-with-decodes: measured in benchmarks/results/cpu_runtime/prefill_bound.
# No default cap on a GPU: its step time barely grows with a few thousand more prompt tokens, and
# capping them there starved prefill (the H200 check's concurrency 256 fell to half its throughput).
CPU_PREFILL_WITH_DECODES = 256
# The CPU default of --prefill-alone-threshold: a prefix-cache hit's remainder or a short chat turn
# (benchmarks/results/zen4_avx512/prefill_alone/ measures it); longer prompts share the decodes' steps.
# Off by default on a GPU, where a step with a few more decode rows takes hardly longer.
CPU_PREFILL_ALONE_THRESHOLD = 64

DEFAULT_KV_CACHE_GIB = 2.0  # the CPU KV pool without --kv-cache-memory or VLLM_CPU_KVCACHE_SPACE

# Whether a model that can be served deterministically is, unless told otherwise (--deterministic /
# --no-deterministic): on where the mode costs at most 10% of throughput at concurrency 1, 8 and 32
# (benchmarks/determinism.sh measures it).
DETERMINISTIC_BY_DEFAULT = True


def option(
    default: object,
    help: str,
    *,
    choices: list[str] | None = None,
    default_text: str | None = None,
    several: bool = False,
    parse: Callable[[str], object] | None = None,
):
    """A field of EngineArgs with what its flag's --help shows: `help`, then `(default: ...)`,
    where `default_text` says what a None default means (the value itself is shown otherwise);
    `several`: the flag takes one value or more (the field then holds the first); `parse`: how
    the flag's text becomes the value (default: by the field's type)."""
    metadata = {"help": help, "choices": choices, "default_text": default_text, "several": several, "parse": parse}
    return field(default=default, metadata=metadata)


def on_cpu_by_default(value: int | None, cpu_default: int, device: torch.device) -> int | None:
    """A scheduler bound as SchedulerConfig takes it: the flag's value, or where unset `cpu_default`
    on a CPU and none elsewhere; 0 (none) becomes None."""
    if value is None:
        value = cpu_default if device.type == "cpu" else 0
    return value or None


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM takes these too
_UNITS = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2, "g": 1000**3, "G": 1024**3}


def token_count(text: str) -> int:
    """A count as vLLM's flags take one: 2048, or with a unit, 4k (4,000) or 4K (4,096), 1.5k."""
    unit = _UNITS.get(text[-1:], 1)
    number = text[:-1] if unit != 1 else text
    try:
        value = float(number) * unit if unit != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count of tokens: {text!r} (e.g. 2048, 4k, 4K)") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count of tokens: {text!r}")
    return int(value)


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = option(
        None, "a Hugging Face directory or a .gguf file", default_text="the embedded SmolLM2-135M-Instruct"
    )
    served_model_name: str | None = option(
        None,
        "the model id clients send and /v1/models lists; the server takes further names given after it too",
        default_text="from the path",
        several=True,
    )
    tokenizer: str | None = option(
        None,
        "an HF directory or a .gguf file whose tokenizer to use instead of the model's",
        default_text="the model's",
    )
    dtype: str = option(
        "auto",
        "auto: float32 on CPU; on GPU the model's own half type, else bfloat16. On a CPU with AVX512-BF16 and "
        "AMX, bfloat16 is about twice float32's throughput at 32 requests and faster at 1, its outputs rounded "
        "to bfloat16 (docs/engine.md); without them, keep float32",
        choices=["auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES],
    )
    max_model_len: int | None = option(
        None,
        "longest prompt + output; a longer prompt is rejected (vLLM's units too: 4k is 4,000, 4K 4,096)",
        default_text="the model's",
        parse=token_count,
    )
    max_num_seqs: int = option(256, "requests running at once")
    max_num_batched_tokens: int = option(1024, "tokens per step: decodes plus prefill chunks")
    kv_cache_memory: float | None = option(
        None,
        "KV pool size in GiB on CPU; must hold at least one max_model_len sequence; a GPU ignores it",
        default_text="2, or vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) where it is set",
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto: the model's dtype, except bfloat16 for a --quantization gguf or int8 model (whose outputs "
        "already carry int8 activations' rounding; llama.cpp keeps a quantized model's cache in 16 bits too); "
        "bfloat16: a float32 model's keys and values stored rounded to bfloat16 (CPU, cpu attention backend): "
        "half the bytes a decode reads and twice the tokens per GiB, computed in float32 as before; outputs "
        "change by that rounding (docs/engine.md); float32: a float32 model's cache in float32 whatever its "
        "quantization",
        choices=["auto", "bfloat16", "float32"],
    )
    max_prefill_with_decodes: int | None = option(
        None,
        "while any request decodes, a step takes at most this many prompt tokens (bounds the stall a long "
        "prompt's chunk puts on running decodes); 0: no bound beyond --max-num-batched-tokens",
        default_text=f"{CPU_PREFILL_WITH_DECODES} on CPU, no bound on a GPU",
    )
    prefill_alone_threshold: int | None = option(
        None,
        "while any request decodes, a prompt with at most this many tokens left to compute (a short prompt, "
        "or what a prefix-cache hit leaves) gets a step of its own before the decodes, one prompt a step, at most two "
        "in a row, then one beside the decodes: its first token then costs only its own rows; 0: prompts always share "
        "the decodes' steps",
        default_text=f"{CPU_PREFILL_ALONE_THRESHOLD} on CPU, 0 on a GPU",
    )
    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(True, "the radix prefix cache")
    scheduling_policy: str = option(
        "fcfs",
        "lpm: longest cached prefix first, no request passed over more than 16 times; priority: vLLM's, the "
        "lowest request priority first (then the earliest), and a request short of KV blocks preempts the "
        "running request of the highest priority value (then the latest)",
        choices=["fcfs", "lpm", "priority"],
    )
    max_queue: int | None = option(
        None, "waiting requests beyond this are refused; the server answers 503", default_text="unbounded"
    )
    device: str = option("auto", "auto: cuda when present, else cpu")
    attention_backend: str = option(
        "auto",
        "auto: on CPU cpu (a C decode kernel built with gcc on first use), else torch; on CUDA triton, "
        "else torch; a named backend that cannot serve the model is refused with the reason",
        choices=["auto", "cpu", "torch", "triton"],
    )
    seed: int = option(0, "the engine's seed; a request's own seed overrides it for that request")
    threads: int | None = option(
        None,
        "CPU compute threads (also $PAGODA_NUM_THREADS, then $OMP_NUM_THREADS); auto: every CPU this process "
        "may use, fewer while other processes keep some busy",
        default_text="auto",
    )
    bind_cores: str | None = option(
        None, "pin compute thread i to the i-th CPU of a list like 0-3,6 (fixes the thread count)", default_text="no"
    )
    gpu_memory_utilization: float = option(
        0.9, "GPU: the share of its memory for weights, activations, CUDA graphs and the KV pool"
    )
    enforce_eager: bool = option(False, "GPU: no CUDA graphs for decode steps")
    quantization: str | None = option(
        None,
        "fp8: float8 linear weights with per-channel scales (GPU, compute capability >= 8.9); gguf: a .gguf "
        "model's Q4_0/Q4_1/Q8_0 tensors kept in their format (CPU); int8: per-channel int8 linear weights and "
        "LM head (CPU); see docs/quantization.md",
        choices=["fp8", "gguf", "int8"],
        default_text="none",
    )
    load_format: str = option(
        "auto",
        "dummy: random weights of the model's config, to time a model without its weights",
        choices=["auto", "dummy"],
    )
    deterministic: bool | None = option(
        None,
        "batch-invariant kernels: a request's tokens and logprobs are bitwise the same whatever else runs, "
        "however its prompt is chunked and whatever of it the prefix cache serves (CPU, float32); refused "
        "with the reason where it cannot hold",
        default_text="on where it can hold",
    )
    grammar_compile_timeout: float = option(
        10.0,
        "seconds a structured-output constraint (JSON schema, regex, choice, grammar) may take to compile; "
        "past it the compile is abandoned and the request refused",
    )
    enable_lora: bool = option(
        False,
        "requests may run LoRA adapters (PEFT's format): --lora-modules NAME=PATH serves one as a model name, "
        "LLM.generate(..., lora_request=LoRARequest(...)) offline; see docs/lora.md",
    )
    max_lora_rank: int = option(16, "the largest rank a LoRA adapter may have")
    max_cpu_loras: int | None = option(
        None,
        "LoRA adapters held in memory at once: past it the least recently used is dropped, and read again from "
        "its folder at its next use",
        default_text="every adapter read stays",
    )
    runner: str = option(
        "auto",
        "generate: requests sample tokens; pooling: requests are embeddings (/v1/embeddings, LLM.embed), each a "
        "prompt's final hidden states pooled as --pooler-config says; auto: pooling for a bare decoder's checkpoint "
        "(an XModel architecture, as e5-mistral's MistralModel), else generate (docs/embeddings.md)",
        choices=["auto", "generate", "pooling"],
    )
    pooler_config: str | None = option(
        None,
        'the pooling runner\'s pooling, as JSON (a dict in LLM(...)): {"pooling_type": "LAST"} (or MEAN, CLS), '
        '"use_activation": false (no unit length), "dimensions": N (a Matryoshka model\'s default length)',
        default_text="the model folder's sentence-transformers settings, else LAST with unit length",
    )
    speculative_config: str | None = option(
        None,
        'speculative decoding, as JSON (a dict in LLM(...)): {"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}; "max_batch_size": speculate only while at most this '
        'many requests run (default 8 for ngram, 2 for a draft model); {"model": PATH, "num_speculative_tokens": 3, '
        '"quantization": "gguf"}: a draft model of the same vocabulary, its weights optionally quantized',
        default_text="off",
    )

    def __post_init__(self) -> None:
        # vLLM's other spellings of a dtype ("half", "float", a torch.dtype), as the names above
        named = str(self.dtype).removeprefix("torch.")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(named, named))
        if isinstance(self.served_model_name, (list, tuple)):  # --served-model-name a b: the first is the id
            object.__setattr__(self, "served_model_name", self.served_model_name[0])

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, positional_model: bool) -> None:
        """One flag per field in an "engine options" group of `parser` (`add_option_flags`);
        `positional_model`: the model is the command's first argument (`pagoda serve MODEL`),
        else `--model`."""
        group = parser.add_argument_group("engine options", "the same as the keywords of LLM(...)")
        add_option_flags(group, cls, positional=("model",) if positional_model else ())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine's fields out of a namespace that may hold a command's own flags too."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def create_config(self) -> EngineConfig:
        import torch

        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX:
            raise ConfigError(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or self.max_model_len < 1):
            raise ConfigError(
                f"max_model_len must be at least 1 token (or unset: the model's), got {self.max_model_len}"
            )

        from pagoda.attention.selector import select_backend
        from pagoda.model_executor.loader import load_model_config

        device = torch.device(
            "cuda"
            if self.device == "auto" and torch.cuda.is_available()
            else ("cpu" if self.device == "auto" else self.device)
        )
        if device.type == "cuda" and self.kv_cache_memory is not None:
            logger.warning(
                "--kv-cache-memory (or --kv-cache-memory-bytes) sizes the KV pool on a CPU; on a GPU it is "
                "--gpu-memory-utilization's share of the device's memory, so it is ignored here"
            )
        path = resolve_model(self.model, gguf_weights=self.quantization != "gguf")
        name = self.served_model_name or display_name(self.model)
        model = load_model_config(
            path,
            name,
            self.dtype,
            self.max_model_len,
            device,
            self.load_format,
            self.quantization,
            gguf_path(self.model),
        )
        if self.tokenizer is not None:
            given = Path(self.tokenizer)
            if not (given.is_dir() or (given.is_file() and given.suffix == ".gguf")):
                raise ConfigError(f"tokenizer {self.tokenizer!r}: no such folder or .gguf file")
            model = replace(model, tokenizer=self.tokenizer)
        backend = select_backend(self.attention_backend, device, model.dtype, model.head_dim)
        deterministic = self.resolve_deterministic(device, model, backend)
        if self.grammar_compile_timeout <= 0:
            raise ConfigError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be a positive integer, got {self.max_lora_rank!r}")
        bound = self.max_cpu_loras
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise ConfigError(f"max_cpu_loras must be a positive integer (or unset: no bound), got {bound!r}")
        config = EngineConfig(
            model=model,
            cache=CacheConfig(
                self.block_size,
                self.resolve_kv_cache_memory(),
                self.enable_prefix_caching,
                self.gpu_memory_utilization,
                kv_cache_dtype=self.resolve_kv_cache_dtype(model, backend),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model.max_model_len,
                policy=self.scheduling_policy,
                max_queue=self.max_queue,
                max_prefill_with_decodes=on_cpu_by_default(
                    self.max_prefill_with_decodes, CPU_PREFILL_WITH_DECODES, device
                ),
                prefill_alone_threshold=on_cpu_by_default(
                    self.prefill_alone_threshold, CPU_PREFILL_ALONE_THRESHOLD, device
                ),
            ),
            device=device,
            attention_backend=backend.name,
            attention_cuda_graphs=backend.support.cuda_graphs,
            seed=self.seed,
            threads=self.thread_config(),
            enforce_eager=self.enforce_eager,
            grammar_compile_timeout=self.grammar_compile_timeout,
            deterministic=deterministic,
            enable_lora=self.enable_lora,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )
        if self.resolve_runner(model) == "pooling":
            config = self.pooling_config(config)
        spec = self.speculative()
        return config if spec is None else replace(config, speculative=self.draft_config(spec, config))

    def resolve_runner(self, model) -> str:
        """ "generate" or "pooling": --runner, where auto pooling for a bare decoder's checkpoint."""
        if self.runner not in ("auto", "generate", "pooling"):
            raise ConfigError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.runner == "generate" and model.headless:
            raise ConfigError(
                f"{model.path} holds a decoder without its LM head ({model.hf_config.architectures[0]}): it makes "
                "embeddings, not text; serve it with --runner pooling"
            )
        runner = "pooling" if self.runner == "pooling" or model.headless else "generate"
        if self.pooler_config is not None and runner == "generate":
            raise ConfigError("pooler_config applies to the pooling runner only (--runner pooling)")
        return runner

    def pooling_config(self, config: EngineConfig) -> EngineConfig:
        """The engine as the pooling runner: its pooler, and a model without an LM head. ConfigError
        for the options it does not take."""
        from pagoda.pooling_params import PoolerConfig, PoolingParams, matryoshka
        from pagoda.sampling_params import SamplingParamsError

        refused = {
            "quantization": self.quantization is not None,
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
        }
        for name, given in refused.items():
            if given:
                raise ConfigError(f"{name} is not supported with the pooling runner (--runner pooling)")
        pooler = PoolerConfig.resolve(config.model.path, self.pooler_config)
        hf_config = config.model.hf_config
        try:  # its default length, checked against the model once, not at every request
            PoolingParams().resolved(pooler, hf_config.hidden_size, matryoshka(hf_config))
        except SamplingParamsError as exc:
            raise ConfigError(f"pooler_config.dimensions: {exc}") from None
        return replace(config, pooler=pooler, model=replace(config.model, lm_head=False))

    def resolve_kv_cache_memory(self) -> float:
        """kv_cache_memory, or where unset vLLM's VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads
        it), else 2 GiB."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if not space:
            return DEFAULT_KV_CACHE_GIB
        try:
            return float(int(space))
        except ValueError:
            raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got {space!r}") from None

    def speculative(self) -> SpeculativeConfig | None:
        """The speculative_config option (a JSON string or a dict) as a validated config."""
        spec = self.speculative_config
        if spec is None:
            return None
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {spec!r}")
        known = {f.name for f in fields(SpeculativeConfig)} - {"draft"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" in spec:  # vLLM's spelling: a model implies a draft model
            spec = {"method": "draft_model", **spec}
        return SpeculativeConfig(**spec)

    def draft_config(self, spec: SpeculativeConfig, target: EngineConfig) -> SpeculativeConfig:
        """A draft model's engine: these options with the draft's files, no speculation of its own."""
        if spec.model is None:
            return spec
        # the draft's outputs are only ever proposals, so it need not be deterministic (which a
        # quantized draft cannot be), and it runs no adapters; it keeps the target's other options
        draft = replace(
            self,
            model=spec.model,
            quantization=spec.quantization,
            deterministic=None,
            enable_lora=False,
            served_model_name=None,
            tokenizer=None,
            speculative_config=None,
        )
        config = draft.create_config()
        if config.model.vocab_size != target.model.vocab_size:
            raise ConfigError(
                f"speculative_config.model: the draft's vocabulary ({config.model.vocab_size} tokens) is not the "
                f"model's ({target.model.vocab_size}); a draft must share the model's tokenizer"
            )
        return replace(spec, draft=config)

    def resolve_kv_cache_dtype(self, model, backend) -> str:
        """CacheConfig.kv_cache_dtype: "bfloat16" where the cache is not the model's dtype, else "auto";
        ConfigError where the option cannot apply."""
        import torch

        kv, dtype = self.kv_cache_dtype, str(model.dtype).removeprefix("torch.")
        if kv not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"kv_cache_dtype must be 'auto', 'bfloat16' or 'float32', got {kv!r}")
        if kv == "float32" and model.dtype != torch.float32:
            raise ConfigError(f"kv_cache_dtype='float32' needs a float32 model; this model runs in {dtype}")
        bf16_applies = model.dtype == torch.float32 and backend.name == "cpu"
        if kv == "auto":
            # the CPU's quantized formats (float32 models with int8 activations) take the 16-bit cache
            return "bfloat16" if bf16_applies and model.quantization in ("gguf", "int8") else "auto"
        if kv == "float32" or model.dtype == torch.bfloat16:
            return "auto"
        if not bf16_applies:
            raise ConfigError(
                f"kv_cache_dtype='bfloat16' needs a float32 model on the cpu attention backend; this model runs in "
                f"{dtype} on the {backend.name} backend"
            )
        return "bfloat16"

    def resolve_deterministic(self, device, model, backend) -> bool:
        """--deterministic where asked for (ConfigError with the reason where it cannot hold), else
        DETERMINISTIC_BY_DEFAULT where it can."""
        from pagoda.attention import selector
        from pagoda.model_executor.cpu_invariant import unsupported_reason

        cpu_reason = selector.unsupported_reason("cpu", device, model.dtype, model.head_dim)
        reason = unsupported_reason(
            device, model.dtype, model.quantization, backend.support.batch_invariant, cpu_reason
        )
        if self.deterministic and reason is not None:
            raise ConfigError(f"--deterministic cannot hold here: {reason}.")
        return reason is None and (self.deterministic if self.deterministic is not None else DETERMINISTIC_BY_DEFAULT)

    def thread_config(self) -> ThreadConfig:
        threads, source = self.threads, "--threads"
        for var in ("PAGODA_NUM_THREADS", "OMP_NUM_THREADS"):
            if threads is None and os.environ.get(var):
                # OpenMP reads "4,2" as nested levels: the first is the one a step's threads use
                value = os.environ[var].split(",")[0] if var == "OMP_NUM_THREADS" else os.environ[var]
                try:
                    threads, source = int(value), f"${var}"
                except ValueError:
                    raise ConfigError(f"${var} must be a whole number of threads, got {os.environ[var]!r}") from None
        try:
            cores = parse_cores(self.bind_cores) if self.bind_cores else None
        except ValueError as exc:
            raise ConfigError(f"--bind-cores: {exc}") from None
        if cores is not None and not set(cores) <= os.sched_getaffinity(0):
            allowed = sorted(os.sched_getaffinity(0))
            raise ConfigError(f"--bind-cores {self.bind_cores}: this process may only run on CPUs {allowed}")
        if threads is not None and threads < 1:
            raise ConfigError(f"{source} must be at least 1 thread, got {threads}")
        if cores is not None and threads is not None and threads > len(cores):
            raise ConfigError(
                f"{source} {threads}: that many threads cannot be pinned to the {len(cores)} CPUs of "
                f"--bind-cores {self.bind_cores}"
            )
        return ThreadConfig(threads, cores)


def add_option_flags(group, cls: type, positional: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (fields made with `option`): `--kebab-case`,
    typed from the annotation, with the field's help and default; a boolean that defaults to True
    or None gets `--no-...` too. The fields named in `positional` are optional positional arguments."""
    annotations = typing.get_type_hints(cls)
    for f in fields(cls):
        help_text = f"{f.metadata['help']} (default: {f.metadata['default_text'] or '%(default)s'})"
        if f.name in positional:
            group.add_argument(f.name, nargs="?", default=f.default, help=help_text)
        elif value_type(annotations[f.name]) is bool:  # None: --x and --no-x both differ from the default
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            group.add_argument(cli_flag(f.name), action=action, default=f.default, help=help_text)
        else:
            several = {"nargs": "+"} if f.metadata.get("several") else {}
            group.add_argument(
                cli_flag(f.name),
                type=f.metadata.get("parse") or value_type(annotations[f.name]),
                default=f.default,
                choices=f.metadata["choices"],
                help=help_text,
                **several,
            )


def cli_flag(name: str) -> str:
    """The flag of an EngineArgs field: `max_model_len` is `--max-model-len`."""
    return "--" + name.replace("_", "-")


def value_type(annotation: object) -> type:
    """What a flag's value converts to: `int | None` is `int`."""
    (kind,) = [t for t in typing.get_args(annotation) if t is not type(None)] or [annotation]
    return kind
