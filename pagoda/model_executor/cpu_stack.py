"""A step's layers in one C call (csrc/decoder.c) instead of one Python module call per norm,
projection, rotation and attention: the same kernels in the same order, so bitwise the same
outputs, minus the Python between them (at batch 1 the default model's 30 layers spent longer in
module calls and argument conversions than in their norms, rotary and attention together).

It takes every step of a model it covers, on the cpu attention backend with its small ops (Qwen3's
q/k norms too) on the C kernels (cpu_layers): float32 with every linear on the batch-invariant GEMM
(cpu_invariant) or quantized (quant_linear), or bfloat16 with every linear on AMX tiles
(cpu_linear). Other models, and mixtures of experts, run the modules.
"""

from __future__ import annotations

import ctypes

import torch

from pagoda.attention.cpu_backend import CpuAttentionMetadata
from pagoda.kernels import cpu
from pagoda.model_executor.cpu_invariant import InvariantLinear
from pagoda.model_executor.cpu_layers import CpuResidualRMSNorm, CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from pagoda.model_executor.cpu_linear import CpuLinear
from pagoda.model_executor.quant_linear import FORMAT_IDS, QuantLinear, amx_tiles_from

# decoder.c's kinds of an InvariantLinear and of a bf16 CpuLinear on AMX tiles (a QuantLinear's is its
# format's id)
LINEAR_PANELS, LINEAR_BF16 = -1, -2


def _linear_row(lib: ctypes.CDLL, linear, dtype: torch.dtype) -> list[int] | None:
    """decoder.c's Linear fields of one layer of a `dtype` model: kind, weight, bias, out and in
    features, extra (qdot.c's tiles_from, or a bf16 linear's plain weight); None for a linear it
    cannot run."""
    if dtype == torch.bfloat16:
        if not isinstance(linear, CpuLinear) or linear.tiles is None:
            return None
        bias = 0 if linear.gemv_bias is None else linear.gemv_bias.data_ptr()
        n, k = linear.weight.shape
        return [LINEAR_BF16, linear.tiles.data_ptr(), bias, n, k, linear.weight.data_ptr()]
    bias = 0 if linear.bias is None else linear.bias.data_ptr()
    if isinstance(linear, InvariantLinear):
        return [LINEAR_PANELS, linear.packed.data_ptr(), bias, linear.out_features, linear.packed.shape[1], 0]
    if isinstance(linear, QuantLinear):
        w = linear.weight
        tiles_from = amx_tiles_from(lib, w.format)
        return [FORMAT_IDS[w.format], w.data.data_ptr(), bias, w.out_features, w.in_features, tiles_from]
    return None


class CpuDecoderStack:
    """The layers of a DecoderModel: `forward` returns (x, residual) as the module loop does, for
    the model's final norm."""

    def __init__(self, model, table: torch.Tensor, lib: ctypes.CDLL) -> None:
        d = model.dims
        # table [layers, fields]: decoder.c's Layer rows, addresses of the model's own tensors (the
        # model holds them and this stack alike, so they outlive it)
        self.lib, self.table, self.num_layers = lib, table, d.num_layers
        self.eps, self.scale, self.residual_multiplier = d.rms_eps, d.attention_scale, d.residual_multiplier
        self.cos, self.signed_sin = model.rotary.cos, model.rotary.signed_sin
        self.shape = [d.hidden, d.intermediate, d.num_heads, d.num_kv_heads, d.head_dim]  # decoder.c's Dims
        self.bf16 = int(model.embed_tokens.dtype == torch.bfloat16)
        self.kv_source: list[torch.Tensor] | None = None  # the caches kv_pointers and dims were made from
        self.kv_pointers = self.dims = torch.empty(0, dtype=torch.int64)

    @classmethod
    def build(cls, model) -> CpuDecoderStack | None:
        """The stack for `model`, or None where decoder.c does not cover it."""
        lib = cpu.load()
        backend = model.layers[0].self_attn.backend
        dtype = model.embed_tokens.dtype
        if lib is None or backend.name != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        if not isinstance(model.rotary, CpuRotaryEmbedding) or model.dims.experts is not None:
            return None  # decoder.c's layer has one dense MLP, no mixture of experts
        rows = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            head_norms = (attn.q_norm, attn.k_norm)  # both or neither
            if not all(isinstance(n, CpuResidualRMSNorm) for n in norms) or not isinstance(mlp.act, CpuSiluAndMul):
                return None
            per_head_in_c = attn.norm_per_head and all(isinstance(n, CpuRMSNorm) for n in head_norms)
            if attn.q_norm is not None and not per_head_in_c:
                return None  # decoder.c normalizes each head, by the C kernel
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            linears = [_linear_row(lib, m, dtype) for m in projections]
            if None in linears:
                return None
            weights = [0 if n is None else n.weight.data_ptr() for n in norms + head_norms]
            rows.append(weights + [f for row in linears for f in row] + [int(attn.rotated)])
        return cls(model, torch.tensor(rows, dtype=torch.int64), lib)

    def forward(
        self,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata,
        read_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) of the rows `read_rows` names (sorted), of all rows where it is None. Where
        those are every decode and some last rows of each prefill chunk (what the runner samples
        from), the last layer computes past its attention only them: the same bits for them."""
        if kv_caches is not self.kv_source:
            self.kv_pointers = torch.tensor([[c[0].data_ptr(), c[1].data_ptr()] for c in kv_caches], dtype=torch.int64)
            bf16 = int(kv_caches[0].dtype == torch.bfloat16)  # a bf16 model's, or --kv-cache-dtype bfloat16
            self.dims = torch.tensor([*self.shape, kv_caches[0].shape[2], bf16, self.bf16], dtype=torch.int64)
            self.kv_source = kv_caches
        residual = embeddings.contiguous()
        x = torch.empty_like(residual)
        positions = positions.to(torch.int64).contiguous()
        tails = None if read_rows is None else chunk_tails_read(metadata, read_rows.tolist())
        prefill_read = None if tails is None else torch.tensor(tails, dtype=torch.int32)
        step = torch.tensor(step_fields(metadata, positions, prefill_read), dtype=torch.int64)
        self.lib.pagoda_decoder_layers(
            self.table.data_ptr(),
            self.num_layers,
            self.kv_pointers.data_ptr(),
            self.dims.data_ptr(),
            step.data_ptr(),
            residual.data_ptr(),
            x.data_ptr(),
            self.cos.data_ptr(),
            self.signed_sin.data_ptr(),
            self.eps,
            self.scale,
            self.residual_multiplier,
            torch.get_num_threads(),
        )
        if tails is not None:  # decoder.c left the rows read first, in order
            n = len(read_rows)
            return x[:n], residual[:n]
        return (x, residual) if read_rows is None else (x[read_rows], residual[read_rows])


def chunk_tails_read(metadata: CpuAttentionMetadata, read_rows: list[int]) -> list[int] | None:
    """How many of each prefill chunk's last rows `read_rows` (sorted, distinct) names, where it
    names every decode row and, of each chunk, only a run of its last rows; None otherwise, and
    where the step has no chunk (its rows are then all read, or nothing is to be saved)."""
    prefills = metadata.paged_prefills
    if prefills is None:
        return None
    nd = metadata.num_decodes
    if read_rows[:nd] != list(range(nd)):
        return None
    tails, j = [], nd
    for end in prefills.query_start.tolist()[1:]:
        first = j
        while j < len(read_rows) and read_rows[j] < end:
            j += 1
        if j > first and read_rows[first] != end - (j - first):
            return None
        tails.append(j - first)
    return tails if j == len(read_rows) else None


def step_fields(
    metadata: CpuAttentionMetadata, positions: torch.Tensor, prefill_read: torch.Tensor | None
) -> list[int]:
    """decoder.c's Step: its rows, then where the backend's metadata lies, then prefill_read's
    address (0: every row is read)."""
    fields = [positions.shape[0], positions.data_ptr(), metadata.slot_mapping.data_ptr(), metadata.num_decodes]
    decodes, prefills = metadata.decodes, metadata.paged_prefills
    if decodes is None:
        fields += [0, 0, 0]
    else:
        fields += [decodes.block_tables.data_ptr(), decodes.block_tables.shape[1], decodes.seq_lens.data_ptr()]
    if prefills is None:
        return fields + [0] * 6
    tables = prefills.block_tables
    return fields + [
        tables.shape[0],
        tables.data_ptr(),
        tables.shape[1],
        prefills.query_start.data_ptr(),
        prefills.seq_lens.data_ptr(),
        0 if prefill_read is None else prefill_read.data_ptr(),
    ]
