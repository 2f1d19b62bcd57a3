"""Reading an HF-format model directory: its config, and its safetensors weights into our model."""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm import tqdm

from pagoda.config import ModelConfig
from pagoda.errors import ConfigError
from pagoda.generation_config import sampling_defaults
from pagoda.model_executor import cpu_invariant, cpu_layers, cpu_linear, quant_loader
from pagoda.model_executor.cpu_stack import CpuDecoderStack
from pagoda.model_executor.layers import SEQUENCE_LENGTH_ROPES, partial_rotary_factor, rope_type_of
from pagoda.model_executor.models.decoder import ARCHITECTURES, DecoderModel, ExpertDims, Mixture
from pagoda.model_executor.quantization import check_fp8_support, quantize_linears

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED = ", ".join(sorted(ARCHITECTURES))
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = (None, "fp8", *quant_loader.CPU_QUANTIZATIONS)


def load_model_config(
    path: str,
    name: str,
    dtype: str,
    max_model_len: int | None,
    device: torch.device,
    load_format: str = "auto",
    quantization: str | None = None,
    gguf_file: str | None = None,
) -> ModelConfig:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"Unknown load_format {load_format!r}; choose auto or dummy.")
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"Unknown quantization {quantization!r}; choose fp8, gguf or int8 (or none).")

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise ConfigError(f"Cannot read the model config in {path}: {exc}") from exc
    architecture = (getattr(hf_config, "architectures", None) or [_BY_MODEL_TYPE.get(hf_config.model_type, "?")])[0]
    headless = architecture.endswith("Model") and bare_decoder(architecture) in ARCHITECTURES
    if headless:  # an embedding model's checkpoint: the decoder alone (e5-mistral's MistralModel)
        architecture = bare_decoder(architecture)
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"Unsupported architecture {architecture!r} in {path}. Supported: {SUPPORTED}.")
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ConfigError(f"{path}: hidden_act {activation!r} is not supported; Pagoda's MLP computes SiLU (silu).")
    rope = rope_type_of(hf_config)
    if rope in SEQUENCE_LENGTH_ROPES:
        raise ConfigError(
            f"{path}: rope type {rope!r} changes its frequencies with the sequence's length, which Pagoda does not "
            "do; this model is not supported."
        )
    if rope != "default" and rope not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"{path}: unknown rope type {rope!r}.")
    no_rope = getattr(hf_config, "no_rope_layers", None) if ARCHITECTURES[architecture].no_rope_layers else None
    if no_rope is not None and len(no_rope) != hf_config.num_hidden_layers:
        raise ConfigError(
            f"{path}: no_rope_layers names {len(no_rope)} layers; the model has {hf_config.num_hidden_layers}."
        )
    if architecture == "OlmoeForCausalLM" and hf_config.clip_qkv is not None:
        raise ConfigError(
            f"{path}: clip_qkv {hf_config.clip_qkv} clamps the queries, keys and values, which Pagoda does not do; "
            "this model is not supported."
        )
    rotated_share = partial_rotary_factor(hf_config)
    if rotated_share != 1.0:
        raise ConfigError(
            f"{path}: partial_rotary_factor {rotated_share} rotates part of each head, which Pagoda "
            "does not do; this model is not supported."
        )
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)  # transformers' own verdict per layer, where it keeps one
    slides = "sliding_attention" in layer_types if layer_types else getattr(hf_config, "use_sliding_window", True)
    if window and slides:
        limit = min(limit, window)  # full attention is exact only within the window
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} positions.")
    generation = _read_json(Path(path) / "generation_config.json")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    resolved_dtype = resolve_dtype(dtype, hf_config, device)
    if quantization == "fp8":
        check_fp8_support(device, resolved_dtype)
    elif quantization is not None:
        reason = quant_loader.unsupported_reason(quantization, device, resolved_dtype, gguf_file, architecture)
        if reason:
            raise ConfigError(reason)
    return ModelConfig(
        path=path,
        name=name,
        architecture=architecture,
        hf_config=hf_config,
        dtype=resolved_dtype,
        max_model_len=max_model_len or limit,
        vocab_size=hf_config.vocab_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        eos_token_ids=tuple(sorted(_as_set(hf_config.eos_token_id) | _as_set(generation.get("eos_token_id")))),
        generation_defaults=sampling_defaults(generation),
        load_format=load_format,
        quantization=quantization,
        gguf_file=gguf_file,
        expert_layers=_expert_layers(path, hf_config, ARCHITECTURES[architecture].experts),
        headless=headless,
    )


def bare_decoder(architecture: str) -> str:
    """The causal LM whose decoder an `XModel` architecture is: XForCausalLM."""
    return architecture.removesuffix("Model") + "ForCausalLM"


def _expert_layers(path: str, hf_config, mixture: Mixture | None) -> tuple[int, ...]:
    """The layers whose MLP is the mixture; ConfigError for a mixture transformers would not build."""
    if mixture is None:
        return ()
    count, per_token = getattr(hf_config, mixture.count_key), hf_config.num_experts_per_tok
    if count == 0:
        return ()  # a Qwen-MoE config without experts: every layer dense, as transformers builds it
    if not 1 <= per_token <= count:
        raise ConfigError(f"{path}: num_experts_per_tok {per_token} must be between 1 and the {count} experts.")
    if mixture.sparse_layers and hf_config.decoder_sparse_step < 1:
        raise ConfigError(f"{path}: decoder_sparse_step must be at least 1, got {hf_config.decoder_sparse_step}.")
    if mixture.shared_expert and hf_config.shared_expert_intermediate_size < 1:
        raise ConfigError(
            f"{path}: shared_expert_intermediate_size {hf_config.shared_expert_intermediate_size}: a shared expert "
            "without width, which Pagoda does not build; this model is not supported."
        )
    return tuple(i for i, sparse in enumerate(ExpertDims.from_hf(hf_config, mixture).sparse) if sparse)


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"Unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}.")
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    own = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    own = DTYPES.get(str(own).removeprefix("torch."), None) if own is not None else None
    return own if own in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_model(
    config: ModelConfig, backend, device: torch.device, batch_invariant: bool = False, modules_only: bool = False
) -> DecoderModel:
    """`batch_invariant`: linears by the batch-invariant GEMM (EngineConfig.deterministic);
    `modules_only`: every step runs the modules, never the C decoder stack (LoRA wraps them)."""
    model = DecoderModel(
        config.hf_config,
        ARCHITECTURES[config.architecture],
        backend,
        config.max_model_len,
        config.dtype,
        device,
        computes_logits=config.lm_head,
    )
    if config.quantization == "gguf":
        quant_loader.load_gguf(model, config.gguf_file)
    elif config.quantization == "int8":
        quant_loader.load_int8(model, lambda on_loaded: fill_weights(model, config, on_loaded))
    else:
        fill_weights(model, config)
    if config.quantization in quant_loader.CPU_QUANTIZATIONS:
        pass  # its layers are in place (deterministic serving refuses quantization)
    elif batch_invariant:
        logger.info("Packing linear weights for the batch-invariant GEMM")
        cpu_invariant.convert_model(model)
    elif config.quantization == "fp8":
        logger.info("Quantizing linear weights to fp8")
        quantize_linears(model)
    elif cpu_linear.supported(config.dtype, device):
        logger.info("Packing linear weights for %s", cpu_linear.packer(config.dtype))
        cpu_linear.convert_model(model)
    if cpu_layers.supported(config.dtype, device):
        cpu_layers.convert_model(model)
        model.cpu_stack = None if modules_only else CpuDecoderStack.build(model)
    elif device.type == "cuda":
        _fuse_gpu_layers(model, config.dtype, device)
    return model.eval()


def _fuse_gpu_layers(model: DecoderModel, dtype: torch.dtype, device: torch.device) -> None:
    """The small ops as gpu_layers' Triton kernels where they serve the dtype; torch's ops where
    Triton is not installed (the torch attention backend then serves too)."""
    try:
        from pagoda.model_executor import gpu_layers  # Triton: imported for a GPU model only
    except ImportError as exc:
        logger.warning("Triton is not importable (%s): the layers' small ops stay torch's", exc)
        return
    if gpu_layers.supported(dtype, device):
        gpu_layers.convert_model(model)


def fill_weights(model: DecoderModel, config: ModelConfig, on_loaded=None) -> None:
    """The weights from the checkpoint, or random ones for load_format="dummy"; `on_loaded` as
    load_weights calls it."""
    if config.load_format != "dummy":
        load_weights(model, config, on_loaded)
        return
    init_dummy_weights(model, config.hf_config)
    for name, param in list(model.named_parameters()) if on_loaded else ():
        on_loaded(name, param)


def init_dummy_weights(model: DecoderModel, hf_config) -> None:
    """Random weights of the config's shapes (load_format="dummy"), to time a model whose weights
    are not at hand: norm weights 1, the rest N(0, initializer_range) from the global seed."""
    std = getattr(hf_config, "initializer_range", None) or 0.02
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, std)


def load_weights(
    model: DecoderModel, config: ModelConfig, on_loaded: Callable[[str, torch.nn.Parameter], None] | None = None
) -> None:
    """Fill `model`'s parameters from the safetensors files of config.path; `on_loaded(name, param)`
    is called as each parameter is complete (int8 quantization replaces it there, so at most one
    float copy of a weight is resident at a time)."""
    params = dict(model.named_parameters())
    pending = {name: p.shape[0] for name, p in params.items()}  # rows still to load
    read: set[str] = set()  # the files' weight names read, to name what is missing as the files would
    names = _CHECKPOINT_NAMES.get(config.architecture, {})
    fused_there = _FUSED_IN_CHECKPOINT.get(config.architecture, ())
    files = weight_files(Path(config.path))
    total_gib = sum(f.stat().st_size for f in files) / 2**30
    for i, file in enumerate(tqdm(files, desc="Loading weights", disable=len(files) < 2)):
        logger.info("Reading weights: file %d of %d (%s; %.2f GiB in all)", i + 1, len(files), file.name, total_gib)
        try:
            for key, entry in read_safetensors(file):
                # the bare decoder's checkpoint (an embedding model's, as sentence-transformers saves one)
                # names its weights without the causal LM's "model."
                key = key if key.startswith("model.") or key == "lm_head.weight" else f"model.{key}"
                found = _target(key, names)
                if found is None:
                    continue
                name, slot = found
                read.add(key)
                if name == "lm_head" and model.lm_head is None:
                    continue  # tied to the embeddings, or a pooling model's: no head
                where = f"{file.name} has weight {key!r}"
                pieces = _unstacked(name, entry)
                first = params.get(pieces[0][0])
                if pieces[0][0] != name and first is not None:  # every expert's weight stacked: all of it
                    _check_shape(where, config.architecture, entry.shape, [model.dims.experts.count, *first.shape])
                for piece, source in pieces:
                    if piece not in params:
                        raise ConfigError(f"{where}, which this {config.architecture} does not use.")
                    rows = _slot_rows(slot, model.dims, params[piece].shape[0])
                    into = params[piece].data[rows]
                    _check_shape(where, config.architecture, source.shape, into.shape)
                    source.read_into(into)
                    pending[piece] -= rows.stop - rows.start
                    if pending[piece] == 0 and on_loaded is not None:
                        on_loaded(piece, params[piece])
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file
            raise ConfigError(f"Cannot read weights from {file}: {exc}") from exc
    unfilled = [name for name, rows in pending.items() if rows]
    file_names = [key for name in unfilled for key in _file_names(name, names, fused_there) if key not in read]
    missing = list(dict.fromkeys(file_names))  # once each: a stacked weight fills every expert's
    if missing:
        raise ConfigError(
            f"Weights missing from {config.path}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )


def _check_shape(where: str, architecture: str, got, want) -> None:
    if list(got) != list(want):
        raise ConfigError(f"{where} of shape {list(got)}, where this {architecture}'s config makes it {list(want)}.")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of an open safetensors file, not read yet."""

    file: BinaryIO
    offset: int  # from the file's start
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self._read(out)
        return out

    def read_into(self, out: torch.Tensor) -> None:
        """Fills `out` (of this shape, any dtype, any device): straight from the file when it is in
        host memory, contiguous and of this dtype, else through a temporary in host memory."""
        direct = out.device.type == "cpu" and out.dtype == self.dtype and out.is_contiguous()
        if direct and tuple(out.shape) == self.shape:
            self._read(out)
        else:
            out.copy_(self.read())

    def _read(self, out: torch.Tensor) -> None:
        self.file.seek(self.offset)
        if self.file.readinto(out.reshape(-1).view(torch.uint8).numpy()) != self.nbytes:
            raise ValueError(f"truncated at byte {self.offset}")


def read_safetensors(file: Path) -> Iterator[tuple[str, SafetensorsEntry]]:
    """Each tensor of a safetensors file in file order, to be read with plain reads, not a memory
    map: the file's pages stay out of the process's resident set, and a tensor is read straight
    into the parameter that holds it."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        start = 8 + header_len
        for key, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            dtype, shape = _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
            if math.prod(shape) * dtype.itemsize != end - begin:
                raise ValueError(f"tensor {key!r}: {end - begin} bytes for shape {list(shape)}")
            yield key, SafetensorsEntry(f, start + begin, end - begin, dtype, shape)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [path / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"Shards listed in {index.name} are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"No *.safetensors weights in {path} (other formats are not supported).")
    return files


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FUSED = {  # HF projection (a module path's last name) -> (our fused projection, which part)
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),  # of the MLP, an expert's or the shared expert's
    "up_proj": ("gate_up_proj", "up"),
}
# the module paths a checkpoint spells its own way (runs of whole names in a weight's) -> the ones
# _FUSED and our model use
_CHECKPOINT_NAMES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    "GraniteMoeForCausalLM": {
        "block_sparse_moe.router.layer": "mlp.gate",
        "block_sparse_moe.input_linear": "mlp.experts.gate_up_proj",  # every expert's, stacked
        "block_sparse_moe.output_linear": "mlp.experts.down_proj",
    },
}
# projections a checkpoint holds fused, as ours are (named so when missing)
_FUSED_IN_CHECKPOINT = {"Phi3ForCausalLM": ("qkv_proj", "gate_up_proj")}


def _respelled(path: str, names: dict[str, str]) -> str:
    """The dotted `path` with each run of whole names that `names` holds replaced, the longest run
    first, left to right."""
    parts, out, i = path.split("."), [], 0
    while i < len(parts):
        run = next((n for n in range(len(parts) - i, 0, -1) if ".".join(parts[i : i + n]) in names), 0)
        out.append(names[".".join(parts[i : i + run])] if run else parts[i])
        i += run or 1
    return ".".join(out)


def _target(key: str, names: dict[str, str]) -> tuple[str, str | None] | None:
    """Our parameter name for an HF weight name, and the part of a fused parameter it fills;
    `names`: the architecture's _CHECKPOINT_NAMES."""
    if key == "model.embed_tokens.weight":
        return "embed_tokens", None
    if key == "lm_head.weight":
        return "lm_head", None
    if key.startswith("model.norm."):
        return key.removeprefix("model."), None
    match = _LAYER.fullmatch(key)
    if match is None:
        return None  # e.g. rotary inv_freq buffers
    layer, rest = match.groups()
    if "." not in rest:
        return f"layers.{layer}.{rest}", None  # no module's: refused as a weight the model does not use
    *path, module, leaf = _respelled(rest, names).split(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return ".".join(["layers", layer, *path, fused, leaf]), part
    return ".".join(["layers", layer, *path, module, leaf]), None


def _file_names(name: str, names: dict[str, str], fused_there: tuple[str, ...]) -> list[str]:
    """The HF weight names that fill our parameter `name` (_target's inverse); `names`, `fused_there`:
    the architecture's _CHECKPOINT_NAMES and _FUSED_IN_CHECKPOINT."""
    if name == "lm_head":
        return ["lm_head.weight"]
    if name == "embed_tokens":
        return ["model.embed_tokens.weight"]
    parts = name.split(".")
    if parts[0] != "layers":
        return [f"model.{name}"]
    # layers.L.<path>.<module>.<leaf>, the module maybe one fused from several, or one expert's part
    # of a weight the checkpoint stacks
    spelled = {ours: theirs for theirs, ours in names.items()}
    *path, module, leaf = parts[2:]
    stacked = re.sub(r"\bexperts\.\d+\.", "experts.", ".".join([*path, module]))
    if stacked in spelled:
        return [f"model.layers.{parts[1]}.{spelled[stacked]}.{leaf}"]
    split = [hf for hf, (fused, _) in _FUSED.items() if fused == module]
    sources = [module] if module in fused_there or not split else split
    return [f"model.layers.{parts[1]}.{_respelled('.'.join([*path, source]), spelled)}.{leaf}" for source in sources]


_STACKED = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


@dataclass(frozen=True)
class _ReadTensor:
    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read_into(self, out: torch.Tensor) -> None:
        out.copy_(self.tensor)


def _unstacked(name: str, entry: SafetensorsEntry) -> list[tuple[str, SafetensorsEntry | _ReadTensor]]:
    """(our parameter, what fills it) of one weight: each expert's part of a mixture's weight that
    holds every expert's stacked ([experts, out, in]: Granite-MoE's checkpoints, transformers' own
    layout since version 5, its GGUF conversion's), else the weight itself."""
    stacked = _STACKED.fullmatch(name)
    if stacked is None or len(entry.shape) != 3:
        return [(name, entry)]
    experts, projection = stacked.groups()
    return [(f"{experts}.{i}.{projection}.weight", _ReadTensor(w)) for i, w in enumerate(entry.read())]


def _slot_rows(part: str | None, d, num_rows: int) -> slice:
    if part is None:
        return slice(0, num_rows)
    if part in ("gate", "up"):  # halves of an MLP's (of its own width: experts' differ from the dense one's)
        return slice(0, num_rows // 2) if part == "gate" else slice(num_rows // 2, num_rows)
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[part]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}
