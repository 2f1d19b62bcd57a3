"""LoRA adapters (PEFT's format) as vLLM serves them: a request names one (`LoRARequest`), and its
low-rank updates join the base model's projections for that request's rows only.

An adapter is read once, here, into the shape the model runs it in (`Update`): for each
projection it targets, per layer, one down-projection A [R, in], and per part of the projection it
targets, that part's B times its scaling. The fused projections (q, k, v in qkv_proj; gate and up
in gate_up_proj) take the A of every part the adapter targets stacked, so one GEMM gives every
part's R values; each part's B then maps its own of them onto its own outputs.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where an adapter is read: `pagoda serve --help` stays instant
    import torch

WEIGHTS_FILE = "adapter_model.safetensors"
# init_lora_weights' named ways that leave the base weights as they are (vLLM's list)
WEIGHT_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
CONFIG_FILE = "adapter_config.json"
# PEFT's names of the projections an adapter may target, and ours: the projection, and its part
# (Phi-3's own modules are fused as ours are: an adapter of them covers the whole projection)
PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", "qkv"),
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", "gate_up"),
    "mlp.down_proj": ("mlp.down_proj", None),
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])(?:\.default)?\.weight")
_SPARSE_MLP = re.compile(r"\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.")  # a layer's MLP, as its family names it


class LoRAError(ConfigError):
    """An adapter that cannot be served here: the message says why."""


class LoRANotFoundError(LoRAError):
    """No adapter where a request says one is."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter a request runs with. `lora_int_id` (at least 1) names it within the
    engine: the first adapter read under an id serves every later request with that id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    load_inplace: bool = False  # vLLM's: read the adapter again under its id; refused here
    is_3d_lora_weight: bool = False  # vLLM's, for adapters of a mixture's experts, which Pagoda does not apply

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")
        if self.load_inplace:
            raise ValueError("load_inplace: an adapter is read once per lora_int_id; give a new id for new weights")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclass(frozen=True, eq=False)
class UpPart:
    """One targeted part of a projection: B [rows, r] (scaled) adds to outputs first..first+rows
    from values start..start+r of x @ A.T."""

    first: int
    start: int
    b: torch.Tensor


@dataclass(frozen=True, eq=False)
class Update:
    """An adapter's update of one projection, in the model's dtype (module docstring)."""

    a: torch.Tensor  # [R, in]: the targeted parts' A, stacked
    parts: tuple[UpPart, ...]


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """An adapter read for one model: its update of each projection it changes, by our name for it
    ("layers.3.self_attn.qkv_proj")."""

    name: str
    id: int
    path: str
    rank: int  # the largest of its projections'
    weights: dict[str, Update]
    # these weights' own name, new at every read: the prefix cache's namespace for them, so KV
    # computed with an id's earlier weights never serves a later read under that id
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class ProjectionShapes:
    """What an adapter must fit: the base model's sizes."""

    hidden: int
    intermediate: int
    q_size: int  # query heads x head_dim
    kv_size: int
    num_layers: int
    expert_layers: tuple[int, ...]  # layers whose MLP is a mixture of experts: no adapter of it applies

    @classmethod
    def of(cls, hf_config, expert_layers: tuple[int, ...]) -> ProjectionShapes:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(
            hf_config.hidden_size, hf_config.intermediate_size, heads * head_dim, kv_heads * head_dim,
            hf_config.num_hidden_layers, expert_layers,
        )  # fmt: skip

    def parts(self, projection: str) -> dict[str | None, tuple[int, int]]:
        """Each part's (first output row, rows) of a projection of ours (None: it has one part)."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate
        return {
            "self_attn.qkv_proj": {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "qkv": (0, q + 2 * kv)},
            "self_attn.o_proj": {None: (0, self.hidden)},
            "mlp.gate_up_proj": {"gate": (0, inter), "up": (inter, inter), "gate_up": (0, 2 * inter)},
            "mlp.down_proj": {None: (0, self.hidden)},
        }[projection]

    def in_features(self, projection: str) -> int:
        return {"self_attn.o_proj": self.q_size, "mlp.down_proj": self.intermediate}.get(projection, self.hidden)


def load_adapter(request: LoRARequest, shapes: ProjectionShapes, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter in `request.lora_path` (PEFT's adapter_config.json and adapter_model.safetensors),
    checked against the model's shapes and `max_rank`; LoRAError naming what does not fit."""
    from safetensors.torch import load_file

    folder = Path(request.lora_path)
    config = read_adapter_config(request)
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds for a bad file
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: cannot read {folder / WEIGHTS_FILE}: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if "lm_head" in key or "embed_tokens" in key:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r} changes the LM head or the embeddings ({key}): not supported"
            )
        if match is not None and int(match[1]) >= shapes.num_layers:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r} has a weight of layer {match[1]} ({key}); "
                f"the model has {shapes.num_layers} layers: an adapter of another model?"
            )
        sparse = _SPARSE_MLP.search(key)  # experts, router or shared expert: any module in such an MLP
        if sparse is not None and int(sparse[1]) in shapes.expert_layers:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r} changes the MLP of layer {sparse[1]} ({key}), a mixture of "
                "experts, whose experts Pagoda applies no LoRA to (its attention and dense MLPs take adapters)"
            )
        if match is None or match[2] not in PROJECTIONS:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r} has a weight Pagoda cannot apply: {key} "
                f"(it applies LoRA to {', '.join(sorted(p.split('.')[1] for p in PROJECTIONS))} of the model's layers)"
            )
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    weights: dict[str, Update] = {}
    rank = 0
    for layer in sorted({layer for layer, _ in pairs}):
        for projection in dict.fromkeys(ours for ours, _ in PROJECTIONS.values()):
            targeted = [(hf, part) for hf, (ours, part) in PROJECTIONS.items() if ours == projection]
            updates = [(part, pairs[layer, hf], hf) for hf, part in targeted if (layer, hf) in pairs]
            if not updates:
                continue
            update = _fused(request.lora_name, layer, projection, updates, shapes, config, dtype)
            rank = max(rank, max(pair["A"].shape[0] for _, pair, _ in updates))
            weights[f"layers.{layer}.{projection}"] = update
    if not weights:
        raise LoRAError(f"LoRA adapter {request.lora_name!r} in {folder} holds no LoRA weights")
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r} has rank {rank}, above max_lora_rank {max_rank} "
            "(raise --max-lora-rank)"
        )
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(folder), rank, weights)


def read_adapter_config(request: LoRARequest) -> dict:
    """The adapter's adapter_config.json, checked for what no model could serve and for its weights
    file: what can be known of an adapter before the model loads (LoRAError naming it)."""
    folder = Path(request.lora_path)
    config = _read_config(folder)
    if not (folder / WEIGHTS_FILE).is_file():
        pickled = " (it has adapter_model.bin: save the adapter as safetensors, PEFT's default)"
        found = pickled if (folder / "adapter_model.bin").is_file() else ""
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: no {WEIGHTS_FILE} in {folder}{found}")
    return config


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRANotFoundError(f"no LoRA adapter at {folder}: it has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise LoRAError(f"{path} is not valid JSON: {exc}") from None
    except OSError as exc:  # gone or unreadable since the check above
        raise LoRAError(f"cannot read {path}: {exc}") from None
    init = config.get("init_lora_weights", True)
    refused = {  # vLLM refuses these too: each changes what the adapter computes beyond x A^T B^T
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "lora_bias": bool(config.get("lora_bias")),
        "modules_to_save": bool(config.get("modules_to_save")),
        # PiSSA, OLoRA, CorDA and LoftQ adapters saved unconverted also change the base weights
        "init_lora_weights": isinstance(init, str) and init.lower() not in WEIGHT_INITS,
        "layer_replication": bool(config.get("layer_replication")),
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
        "use_qalora": bool(config.get("use_qalora")),
        "use_bdlora": bool(config.get("use_bdlora")),
    }
    for name, bad in refused.items():
        if bad:
            raise LoRAError(f"{path}: {name} {config.get(name)!r} is not supported (plain LoRA only)")
    return config


def _fused(
    name: str,
    layer: int,
    projection: str,
    updates: list[tuple[str | None, dict[str, torch.Tensor], str]],
    shapes: ProjectionShapes,
    config: dict,
    dtype: torch.dtype,
) -> Update:
    """One projection's update from its targeted parts' (part, {A, B}, PEFT name)."""
    import torch

    parts, in_features = shapes.parts(projection), shapes.in_features(projection)
    columns = []
    for part, pair, hf in updates:
        a, b = pair.get("A"), pair.get("B")
        where = f"LoRA adapter {name!r}, layer {layer} {hf}"
        if a is None or b is None:
            raise LoRAError(f"{where}: lora_{'A' if a is None else 'B'} is missing")
        first, rows = parts[part]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != rows or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model "
                f"({in_features} inputs, {rows} outputs)"
            )
        columns.append((first, rows, a.float(), b.float() * _scaling(config, f"model.layers.{layer}.{hf}", a.shape[0])))
    starts = [sum(a.shape[0] for _, _, a, _ in columns[:i]) for i in range(len(columns))]
    ups = tuple(UpPart(first, start, b.to(dtype).contiguous()) for (first, _, _, b), start in zip(columns, starts))
    return Update(torch.cat([a for _, _, a, _ in columns]).to(dtype).contiguous(), ups)


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's: lora_alpha (or the alpha_pattern entry whose key ends the module's name) over the
    rank, or over its square root with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
