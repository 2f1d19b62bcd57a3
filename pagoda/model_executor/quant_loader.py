"""Loading a model with quantized weights on the CPU (`quantization="gguf"` or `"int8"`).

gguf: the GGUF file's Q4_0, Q4_1 and Q8_0 tensors are read as stored and packed, into QuantLinear layers (the
fused q/k/v and gate/up projections are their parts' rows one after another), the embedding table
into a QuantEmbedding and, for a tied model, the same table serves the LM head. Tensors in other
formats are dequantized to float32 as the default load does. Reads are plain reads into memory
of their own (no memory map), one tensor at a time.
int8: each linear weight of the checkpoint and the LM head is quantized per output channel as soon
as it is read, and its float copy dropped; a tied model's embedding table stays float32 for the
lookup, with an int8 copy for the head.
"""

from __future__ import annotations

import ctypes
import logging
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.kernels import cpu
from pagoda.model_executor.cpu_linear import CpuLinear
from pagoda.model_executor.layers import replace_linears
from pagoda.model_executor.quant_linear import (
    BLOCK_BYTES,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    pack_gguf,
    quantize_int8,
)

logger = logging.getLogger(__name__)

CPU_QUANTIZATIONS = ("gguf", "int8")
# our module (per layer) -> its GGUF tensors, in the order of our fused rows
_GGUF_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_GGUF_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# the architectures whose GGUF files load_gguf reads (llama.cpp's "llama": Llama, and Mistral's,
# converted as Llama); others (Qwen2's biases and Qwen3's q/k norms, Phi-3's one fused attn_qkv)
# are dequantized on load instead
GGUF_ARCHITECTURES = ("LlamaForCausalLM",)


def unsupported_reason(
    quantization: str, device: torch.device, dtype: torch.dtype, gguf_file: str | None, architecture: str
) -> str | None:
    if device.type != "cpu":
        return f"quantization={quantization!r} runs on the CPU; the device is {device}."
    if dtype != torch.float32:
        return f"quantization={quantization!r} computes in float32; dtype is {str(dtype).removeprefix('torch.')}."
    if cpu.load() is None:
        return f"quantization={quantization!r} needs Pagoda's C kernels, which cannot be built on this machine."
    if quantization == "gguf" and gguf_file is None:
        return "quantization='gguf' needs a .gguf model file; for a Hugging Face directory use quantization='int8'."
    if quantization == "gguf" and architecture not in GGUF_ARCHITECTURES:
        return (
            f"quantization='gguf' keeps the tensors of {', '.join(GGUF_ARCHITECTURES)} GGUF files; this "
            f"{architecture} file is served dequantized without it."
        )
    return None


def load_int8(model: nn.Module, fill: Callable[[Callable[[str, nn.Parameter], None]], None]) -> None:
    """Quantizes the linear weights and the LM head as `fill(on_loaded)` loads them."""
    lib = cpu.load()
    quantized: dict[str, QuantWeight] = {}

    def on_loaded(name: str, param: nn.Parameter) -> None:
        if name.endswith("_proj.weight") or name == "lm_head":
            quantized[name.removesuffix(".weight")] = quantize_int8(param.data)
            param.data = torch.empty(0)  # the float copy goes now, not after the whole model
        elif name == "embed_tokens" and model.lm_head is None:
            quantized["lm_head"] = quantize_int8(param.data)  # the lookup keeps the float table

    fill(on_loaded)
    head = quantized.pop("lm_head")
    _install(model, quantized, QuantLinear(head, None, lib), lib)


def load_gguf(model: nn.Module, gguf_file: str) -> None:
    """Fills `model` from the GGUF file, keeping Q4_0 / Q4_1 / Q8_0 tensors in their format."""
    lib = cpu.load()
    with open(gguf_file, "rb") as f:
        arch, tensors = read_gguf_index(f)
        if arch != "llama":
            raise ConfigError(f"quantization='gguf' reads llama-architecture GGUF files; {gguf_file} is {arch!r}.")
        read = _TensorReader(f, tensors, model.dims, lib)
        quantized: dict[str, QuantWeight] = {}
        for i, layer in enumerate(model.layers):
            for ours, names in _GGUF_LINEARS.items():
                weight = read.linear([f"blk.{i}.{n}.weight" for n in names])
                linear = layer.get_submodule(ours)
                if isinstance(weight, QuantWeight):
                    quantized[f"layers.{i}.{ours}"] = weight
                    linear.weight.data = torch.empty(0)
                else:
                    linear.weight.data = weight
            for ours, theirs in _GGUF_NORMS.items():
                getattr(layer, ours).weight.data = read.float(f"blk.{i}.{theirs}.weight").reshape(-1)
        model.norm.weight.data = read.float("output_norm.weight").reshape(-1)
        table = read.linear(["token_embd.weight"])
        head = table if model.lm_head is None else read.linear(["output.weight"])
    if isinstance(table, QuantWeight):
        model.quant_embedding = QuantEmbedding(table, lib)
        model.embed_tokens.data = torch.empty(0, model.dims.hidden)
    else:
        model.embed_tokens.data = table
    if model.lm_head is not None:
        model.lm_head.data = torch.empty(0) if isinstance(head, QuantWeight) else head
    head_layer = QuantLinear(head, None, lib) if isinstance(head, QuantWeight) else CpuLinear(head, None, lib)
    _install(model, quantized, head_layer, lib)


@dataclass(frozen=True)
class GgufTensor:
    kind: str  # GGML type name: F32, Q4_1, ...
    shape: tuple[int, ...]  # GGUF's order: columns first
    offset: int  # from the file's start
    nbytes: int


# GGUF metadata value types: fixed sizes (8 = string, 9 = array are read apart)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_gguf_index(f) -> tuple[str, dict[str, GgufTensor]]:
    """The architecture and the tensor table of an open GGUF file (v2/v3), read from its header
    alone: metadata values are skipped, not built (the `gguf` package's reader makes Python
    objects of every tokenizer entry, over 100 MB for a 49k vocabulary)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    def unpack(fmt: str):
        return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

    def string() -> bytes:
        return f.read(unpack("Q"))

    def skip(kind: int) -> None:
        if kind == 8:
            f.seek(unpack("Q"), 1)
        elif kind == 9:
            item, count = unpack("I"), unpack("Q")
            if item in _VALUE_SIZES:
                f.seek(_VALUE_SIZES[item] * count, 1)
            else:
                for _ in range(count):
                    skip(item)
        else:
            f.seek(_VALUE_SIZES[kind], 1)

    if f.read(4) != b"GGUF" or unpack("I") < 2:
        raise ConfigError("Not a GGUF file of version 2 or later.")
    tensor_count, kv_count = unpack("Q"), unpack("Q")
    arch, alignment = "", 32
    for _ in range(kv_count):
        key, kind = string(), unpack("I")
        if key == b"general.architecture" and kind == 8:
            arch = string().decode()
        elif key == b"general.alignment" and kind == 4:
            alignment = unpack("I")
        else:
            skip(kind)
    infos = []
    for _ in range(tensor_count):
        name = string().decode()
        shape = tuple(unpack("Q") for _ in range(unpack("I")))
        infos.append((name, GGMLQuantizationType(unpack("I")), shape, unpack("Q")))
    start = -(-f.tell() // alignment) * alignment
    tensors = {}
    for name, kind, shape, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        tensors[name] = GgufTensor(kind.name, shape, start + offset, math.prod(shape) // block * block_bytes)
    return arch, tensors


class _TensorReader:
    """Reads GGUF tensors by name from the open file: quantized ones as QuantWeight rows, the rest
    as float32. Undoes llama.cpp's rotary row order of q and k (its converter permutes their rows
    per head; Pagoda, like transformers, uses the checkpoint's order)."""

    def __init__(self, f, tensors: dict[str, GgufTensor], dims, lib: ctypes.CDLL) -> None:
        self.f, self.tensors, self.d, self.lib = f, tensors, dims, lib

    def _raw(self, name: str) -> tuple[torch.Tensor, GgufTensor]:
        if name not in self.tensors:
            raise ConfigError(f"The GGUF file has no tensor {name!r}.")
        t = self.tensors[name]
        raw = torch.empty(t.nbytes, dtype=torch.uint8)
        self.f.seek(t.offset)
        if self.f.readinto(raw.numpy()) != raw.numel():
            raise ConfigError(f"The GGUF file is truncated at tensor {name!r}.")
        return raw.view(math.prod(t.shape[1:]), -1), t

    def float(self, name: str) -> torch.Tensor:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        raw, t = self._raw(name)
        values = dequantize(raw.numpy(), GGMLQuantizationType[t.kind])
        return self._order(name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))

    def linear(self, names: list[str]) -> QuantWeight | torch.Tensor:
        """The tensors' rows one after another: a QuantWeight where all are in one kept format."""
        kinds = {self.tensors[n].kind if n in self.tensors else None for n in names}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind not in BLOCK_BYTES:
            return torch.cat([self.float(n) for n in names])
        parts = [self._order(n, self._raw(n)[0]) for n in names]
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        return pack_gguf(self.lib, kind, rows, self.tensors[names[0]].shape[0])

    def _order(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        heads = {"attn_q": self.d.num_heads, "attn_k": self.d.num_kv_heads}.get(name.split(".")[-2])
        return rows if heads is None else rows[rotary_row_order(rows.shape[0], heads)]


def rotary_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """Where each checkpoint row of a q or k projection sits in llama.cpp's file: the converter
    stores each head's rows (pairs i, i + D/2) interleaved as (i, i + D/2) -> (2i, 2i + 1)."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _install(model: nn.Module, quantized: dict[str, QuantWeight], head: nn.Module, lib: ctypes.CDLL) -> None:
    """Quantized layers in place of their Linears, the float ones left onto oneDNN / the GEMV, and
    the head; logs the resident weight sizes."""
    for name, weight in quantized.items():
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        setattr(module, attr, QuantLinear(weight, getattr(module, attr).bias, lib))
    replace_linears(model, lambda linear: CpuLinear(linear.weight, linear.bias, lib))
    model.cpu_lm_head = head
    logger.info("Weights resident: %s", resident_summary(model))


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights held, by format ("float" for float32 tensors): each quantized tensor once
    (a tied head shares the embedding table), the packed copies (oneDNN's or AMX tiles) and the GEMV's
    plain ones."""
    sizes: dict[str, int] = {"float": sum(p.numel() * p.element_size() for p in model.parameters())}
    seen: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantWeight) and id(weight.data) not in seen:
            seen.add(id(weight.data))
            sizes[weight.format] = sizes.get(weight.format, 0) + weight.nbytes
        elif isinstance(module, CpuLinear):  # neither copy is a parameter
            for t in (module.packed, module.tiles, module.weight):
                sizes["float"] += 0 if t is None else t.numel() * t.element_size()
    return sizes


def resident_bytes(model: nn.Module) -> int:
    return sum(weight_bytes(model).values())


def resident_summary(model: nn.Module) -> str:
    sizes = weight_bytes(model)
    parts = ", ".join(f"{fmt} {size / 2**20:.1f} MiB" for fmt, size in sorted(sizes.items()))
    return f"{sum(sizes.values()) / 2**20:.1f} MiB ({parts})"
