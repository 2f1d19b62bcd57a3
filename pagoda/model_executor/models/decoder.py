"""One decoder-only transformer covering Llama (incl. llama3 rope scaling), Mistral, Qwen2 (qkv
bias), Qwen3 (q/k norm), SmolLM3 (layers without rotary embedding), Granite (multipliers of the
embeddings, the attention scores, each sublayer's output and the logits), Phi-3, and the mixtures
of experts Mixtral, Qwen2-MoE (with a shared expert), Qwen3-MoE, Granite-MoE and OLMoE (q/k norms
over the whole projection), with grouped-query attention and optionally tied embeddings.

The model sees a packed batch: all query tokens of all requests back to back, with positions and
attention metadata; attention reads and writes the paged KV cache through the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.model_executor.layers import (
    Linear,
    ResidualRMSNorm,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    SiluAndMul,
    empty_param,
)

# Where queries and keys are RMS-normalized before the rotary embedding: each head over its own
# values (Qwen3), or the whole projection at once (OLMoE)
QkNorm = Literal["per_head", "whole"]


@dataclass(frozen=True)
class Mixture:
    """An architecture's mixture of experts: the config keys its transformers class reads (and no
    other: a key another family's class reads changes nothing there), and how it weighs experts."""

    count_key: str  # the number of experts
    width_key: str  # each expert's intermediate size
    top_k_then_softmax: bool = False  # the largest logits, then their softmax (Granite-MoE); else the reverse
    renormalize: bool | None = None  # the chosen weights rescaled to sum to 1; None: as norm_topk_prob says
    weights_in_float32: bool = False  # they scale an expert's output in float32 (Mixtral's), not in its dtype
    shared_expert: bool = False  # Qwen2-MoE's shared expert, gated by a sigmoid
    sparse_layers: bool = False  # Qwen-MoE's decoder_sparse_step and mlp_only_layers pick the sparse layers


MIXTRAL = Mixture("num_local_experts", "intermediate_size", renormalize=True, weights_in_float32=True)
QWEN_MOE = Mixture("num_experts", "moe_intermediate_size", sparse_layers=True)


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool
    qk_norm: QkNorm | None = None
    no_rope_layers: bool = False  # SmolLM3's config key: layers without rotary embedding
    multipliers: bool = False  # Granite's config keys: embedding, attention, residual and logits multipliers
    experts: Mixture | None = None  # the MLPs of (some) layers are mixtures of experts


ARCHITECTURES = {
    "LlamaForCausalLM": ArchSpec(qkv_bias=False),
    "MistralForCausalLM": ArchSpec(qkv_bias=False),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec(qkv_bias=False, qk_norm="per_head"),
    "SmolLM3ForCausalLM": ArchSpec(qkv_bias=False, no_rope_layers=True),
    "GraniteForCausalLM": ArchSpec(qkv_bias=False, multipliers=True),
    "Phi3ForCausalLM": ArchSpec(qkv_bias=False),  # its checkpoints hold qkv and gate_up fused
    "MixtralForCausalLM": ArchSpec(qkv_bias=False, experts=MIXTRAL),
    "Qwen2MoeForCausalLM": ArchSpec(qkv_bias=True, experts=replace(QWEN_MOE, shared_expert=True)),
    "Qwen3MoeForCausalLM": ArchSpec(qkv_bias=False, qk_norm="per_head", experts=QWEN_MOE),
    "GraniteMoeForCausalLM": ArchSpec(
        qkv_bias=False,
        multipliers=True,
        experts=Mixture("num_local_experts", "intermediate_size", top_k_then_softmax=True, renormalize=False),
    ),
    "OlmoeForCausalLM": ArchSpec(qkv_bias=False, qk_norm="whole", experts=Mixture("num_experts", "intermediate_size")),
}


@dataclass(frozen=True)
class ExpertDims:
    """A mixture of experts: each token's MLP output is the sum of `per_token` of `count` expert
    MLPs, chosen and weighted by the router, plus Qwen2-MoE's shared expert."""

    mixture: Mixture
    count: int
    per_token: int
    intermediate: int  # of each expert's MLP
    renormalize: bool
    shared_intermediate: int  # 0: no shared expert
    sparse: tuple[bool, ...]  # per layer: its MLP is the mixture (Qwen-MoE's other layers have a dense one)

    @classmethod
    def from_hf(cls, c, m: Mixture) -> ExpertDims:
        """The config's keys that `m` names (load_model_config has checked their values)."""
        count = getattr(c, m.count_key)
        step, dense = (c.decoder_sparse_step, set(c.mlp_only_layers or ())) if m.sparse_layers else (1, set())
        return cls(
            mixture=m,
            count=count,
            per_token=c.num_experts_per_tok,
            intermediate=getattr(c, m.width_key),
            renormalize=bool(c.norm_topk_prob) if m.renormalize is None else m.renormalize,
            shared_intermediate=c.shared_expert_intermediate_size if m.shared_expert else 0,
            sparse=tuple(i not in dense and count > 0 and (i + 1) % step == 0 for i in range(c.num_hidden_layers)),
        )


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    rms_eps: float
    rotated: tuple[bool, ...]  # per layer: its queries and keys take the rotary embedding (SmolLM3's NoPE: not all)
    # Granite's multipliers, 1 (and the attention's head_dim^-0.5) for the others
    embedding_multiplier: float
    attention_scale: float
    residual_multiplier: float  # of each sublayer's output before it joins the residual stream
    logits_scaling: float  # the logits are divided by it
    experts: ExpertDims | None  # a mixture of experts' shapes; None for a dense model

    @classmethod
    def from_hf(cls, c, spec: ArchSpec) -> Dims:
        """The config's shapes, and the keys of its architecture only (transformers' other classes
        ignore a no_rope_layers or a multiplier that a config may carry)."""
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # SmolLM3's: 1 where a layer rotates, 0 where it does not (the loader checks it has each layer's)
        no_rope = c.no_rope_layers if spec.no_rope_layers else None
        scaled = spec.multipliers
        return cls(
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim,
            num_layers=c.num_hidden_layers,
            vocab_size=c.vocab_size,
            rms_eps=c.rms_norm_eps,
            rotated=tuple(bool(r) for r in no_rope) if no_rope else (True,) * c.num_hidden_layers,
            embedding_multiplier=float(c.embedding_multiplier) if scaled else 1.0,
            attention_scale=float(c.attention_multiplier) if scaled else head_dim**-0.5,
            residual_multiplier=float(c.residual_multiplier) if scaled else 1.0,
            logits_scaling=float(c.logits_scaling) if scaled else 1.0,
            experts=ExpertDims.from_hf(c, spec.experts) if spec.experts else None,
        )


class Attention(nn.Module):
    def __init__(self, d: Dims, spec: ArchSpec, backend: AttentionBackend, rotated: bool, dtype, device) -> None:
        super().__init__()
        self.d, self.backend, self.rotated = d, backend, rotated
        self.q_size, self.kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.qkv_proj = Linear(d.hidden, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, d.hidden, False, dtype, device)
        self.norm_per_head = spec.qk_norm == "per_head"
        q_width, k_width = (d.head_dim, d.head_dim) if self.norm_per_head else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_width, d.rms_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, d.rms_eps, dtype, device) if spec.qk_norm else None
        self.scale = d.attention_scale

    def forward(self, x, rope: Rotation, kv_cache, attn_metadata):
        d = self.d
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, d.num_kv_heads, d.head_dim)
        if self.q_norm is None:  # queries and keys rotated in one go: they share each token's angles
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, d.num_heads + d.num_kv_heads, d.head_dim)
            qk = rope.apply(qk) if self.rotated else qk
            q, k = qk[:, : d.num_heads], qk[:, d.num_heads :]
        else:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            if self.norm_per_head:
                q, k = q.view(-1, d.num_heads, d.head_dim), k.view(-1, d.num_kv_heads, d.head_dim)
            q = self.q_norm(q).view(-1, d.num_heads, d.head_dim)
            k = self.k_norm(k).view(-1, d.num_kv_heads, d.head_dim)
            q, k = (rope.apply(q), rope.apply(k)) if self.rotated else (q, k)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """A mixture of experts as transformers' Mixtral, Qwen-MoE, Granite-MoE and OLMoE blocks compute
    it by default (its grouped_mm experts): the router's weights in float32 (Mixture), each chosen
    expert's SiLU MLP over the rows that chose it, weighted, and each row's sum over its experts in
    the router's order (largest weight first), in float32, rounded once, then the gated shared
    expert's."""

    def __init__(self, d: Dims, e: ExpertDims, dtype, device) -> None:
        super().__init__()
        self.e = e
        self.gate = Linear(d.hidden, e.count, False, dtype, device)  # the router
        self.experts = nn.ModuleList(MLP(d.hidden, e.intermediate, dtype, device) for _ in range(e.count))
        shared = e.shared_intermediate
        self.shared_expert = MLP(d.hidden, shared, dtype, device) if shared else None
        self.shared_expert_gate = Linear(d.hidden, 1, False, dtype, device) if shared else None
        # set by cpu_invariant.convert_model: the experts in a few C calls, given the rows grouped by
        # expert and the groups' sizes; None: a module call per expert
        self.grouped: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None

    def forward(self, x):
        k = self.e.per_token
        weights, chosen = self._route(self.gate(x).float())
        weights = weights if self.e.mixture.weights_in_float32 else weights.to(x.dtype)
        # the (row, slot) pairs grouped by expert; one host read of the group sizes a step
        flat = chosen.flatten()
        pairs = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=self.e.count).tolist()
        rows = x[pairs // k]
        if self.grouped is not None:
            y = self.grouped(rows, sizes)
        else:
            groups = torch.split(rows, sizes)
            y = torch.cat([expert(part) for expert, part, size in zip(self.experts, groups, sizes) if size])
        weighted = y * weights.flatten()[pairs, None]
        by_row = torch.empty_like(weighted)
        by_row[pairs] = weighted  # back in (row, slot) order: a permutation, no place written twice
        by_row = by_row.view(-1, k, x.shape[-1]).float()
        out = torch.zeros_like(by_row[:, 0])
        # each row alone, slot after slot: the order torch's sum over the slots takes (transformers')
        # below 18 experts a row, and below 5 where the hidden size is not a multiple of 32
        for slot in range(k):
            out.add_(by_row[:, slot])
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            # sigmoid(g) as the softmax of (g, 0): a row op, so a row's gate is the same whatever
            # rows share its step (torch's elementwise sigmoid takes its vector or its scalar path
            # by an element's place in the batch), as deterministic serving needs
            gate = torch.softmax(F.pad(self.shared_expert_gate(x), (0, 1)), dim=-1)[:, :1]
            out = out + gate * self.shared_expert(x)
        return out

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts and their weights, from its router logits (float32)."""
        if self.e.mixture.top_k_then_softmax:
            top, chosen = torch.topk(logits, self.e.per_token, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.e.per_token, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True) if self.e.renormalize else weights), chosen


class DecoderLayer(nn.Module):
    def __init__(self, d: Dims, spec: ArchSpec, backend, index: int, dtype, device) -> None:
        super().__init__()
        self.input_layernorm = ResidualRMSNorm(d.hidden, d.rms_eps, dtype, device)
        self.self_attn = Attention(d, spec, backend, d.rotated[index], dtype, device)
        self.post_attention_layernorm = ResidualRMSNorm(d.hidden, d.rms_eps, dtype, device)
        e = d.experts
        sparse = e is not None and e.sparse[index]
        self.mlp = SparseMoE(d, e, dtype, device) if sparse else MLP(d.hidden, d.intermediate, dtype, device)
        self.residual_multiplier = d.residual_multiplier

    def forward(self, x, residual, rope: Rotation, kv_cache, attn_metadata):
        """Returns (the MLP's output, the residual stream without it): the next norm adds it in, so
        each sublayer's output joins the stream once, as in HF's x = x + sublayer(norm(x)) (Granite's
        x = x + sublayer(norm(x)) * multiplier), and in the same order (stream + output)."""
        x, residual = self.input_layernorm(x, residual)
        x = self._scaled(self.self_attn(x, rope, kv_cache, attn_metadata))
        x, residual = self.post_attention_layernorm(x, residual)
        return self._scaled(self.mlp(x)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class DecoderModel(nn.Module):
    def __init__(
        self,
        hf_config,
        spec: ArchSpec,
        backend: AttentionBackend,
        max_positions: int,
        dtype,
        device,
        computes_logits: bool = True,
    ):
        """`computes_logits` False: a pooling model's, without an LM head (its final hidden states are its output)."""
        super().__init__()
        d = self.dims = Dims.from_hf(hf_config, spec)
        self.embed_tokens = empty_param(d.vocab_size, d.hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(d, spec, backend, i, dtype, device) for i in range(d.num_layers))
        self.norm = ResidualRMSNorm(d.hidden, d.rms_eps, dtype, device)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.computes_logits = computes_logits
        untied = computes_logits and not self.tie_word_embeddings
        self.lm_head = empty_param(d.vocab_size, d.hidden, dtype=dtype, device=device) if untied else None
        self.rotary = RotaryEmbedding(hf_config, d.head_dim, max_positions, dtype, device)
        self.cpu_lm_head: nn.Module | None = None  # set by cpu_linear.convert_model or quant_loader
        self.quant_embedding: nn.Module | None = None  # set by quant_loader: embed_tokens is then empty
        self.cpu_stack = None  # set by load_model where cpu_stack.CpuDecoderStack covers the model

    def forward(
        self, input_ids, positions, kv_caches: list[torch.Tensor], attn_metadata, read_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states of the rows `read_rows` names (sorted), of every row where it is
        None. Every row's keys and values are stored either way; the CPU stack then computes the
        last layer past its attention for the rows read only."""
        lookup = self.quant_embedding
        x, residual = F.embedding(input_ids, self.embed_tokens) if lookup is None else lookup(input_ids), None
        if self.dims.embedding_multiplier != 1.0:
            x = x * self.dims.embedding_multiplier
        if self.cpu_stack is not None:
            x, residual = self.cpu_stack.forward(x, positions, kv_caches, attn_metadata, read_rows)
            return self.norm(x, residual)[0]
        rope = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata)
        hidden = self.norm(x, residual)[0]
        return hidden if read_rows is None else hidden[read_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.computes_logits, "a pooling model has no LM head"
        if self.cpu_lm_head is not None:
            logits = self.cpu_lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)
        return logits if self.dims.logits_scaling == 1.0 else logits / self.dims.logits_scaling
