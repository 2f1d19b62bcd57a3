"""Deterministic serving's linear layers (EngineConfig.deterministic): every output of every linear,
the LM head's included, summed over its inputs in one order fixed by the layer's shape, whatever
number of rows the step has (csrc/gemm.c). oneDNN and the GEMV kernel each fix an order too, but
different ones, and oneDNN's changes with the number of rows: a request's logprobs moved by up to
1.2e-5 with what else shared its steps.

The mode's other parts hold by construction: norms, rotary and SiLU*up are computed row by row in
C (cpu_layers), attention by the cpu backend's batch-invariant kernels, log-softmax and sampling
per row (sampler.py). docs/determinism.md says what is invariant and what is refused.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagoda.kernels import cpu
from pagoda.model_executor.layers import replace_linears


def unsupported_reason(
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    backend_invariant: bool,
    cpu_backend_reason: str | None = None,
) -> str | None:
    """Why deterministic serving cannot hold for this configuration, or None when it can;
    `cpu_backend_reason`: why the cpu attention backend (batch-invariant) cannot serve the model."""
    if device.type != "cpu":
        return f"its batch-invariant kernels run on the CPU only, not on {device.type}"
    if dtype != torch.float32:
        return f"its batch-invariant kernels compute in float32 only (got {str(dtype).removeprefix('torch.')})"
    if quantization is not None:
        return f"quantized ({quantization}) linears have no batch-invariant kernel"
    if not backend_invariant:
        if cpu_backend_reason is not None:
            return f"the attention backend is not batch-invariant, and the cpu one cannot serve: {cpu_backend_reason}"
        return "the attention backend is not batch-invariant (choose --attention-backend cpu)"
    return cpu.unavailable_reason()


class InvariantLinear(nn.Module):
    """y = x @ weight.T + bias from the weight packed for the batch-invariant GEMM (the plain
    weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib, self.out_features = lib, weight.shape[0]
        self.packed = cpu.pack_panels(lib, weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu.gemm_invariant(self.lib, x, self.packed, self.bias, self.out_features)


class InvariantExperts:
    """A mixture's experts, each an MLP of InvariantLinears, run over the rows grouped by expert in
    three C calls a layer (every expert's gate_up, SiLU * up, every expert's down) instead of three
    module calls per expert chosen: the same kernels on the same rows, so the same bits."""

    def __init__(self, experts: nn.ModuleList, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # the packed weights' addresses: the experts' modules, which the model holds, keep them
        self.gate_up = torch.tensor([e.gate_up_proj.packed.data_ptr() for e in experts], dtype=torch.int64)
        self.down = torch.tensor([e.down_proj.packed.data_ptr() for e in experts], dtype=torch.int64)
        self.width, self.hidden = experts[0].gate_up_proj.out_features, experts[0].down_proj.out_features

    def __call__(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """rows [M, hidden], expert by expert (`sizes[e]` rows each, in the experts' order)."""
        counts = torch.tensor(sizes, dtype=torch.int64)
        row0 = torch.cumsum(counts, 0) - counts  # the groups' first rows, for both projections
        gate_up = cpu.gemm_invariant_groups(self.lib, rows, self.gate_up, row0, counts, self.width)
        up = cpu.silu_mul(self.lib, gate_up)
        return cpu.gemm_invariant_groups(self.lib, up, self.down, row0, counts, self.hidden)


def convert_model(model) -> None:
    """Every Linear of a DecoderModel replaced by its InvariantLinear, and an InvariantLinear LM
    head for compute_logits (over the embeddings when they are tied; they stay plain for lookups);
    a mixture's experts run as InvariantExperts."""
    from pagoda.model_executor.models.decoder import SparseMoE

    lib = cpu.load()
    replace_linears(model, lambda linear: InvariantLinear(linear.weight, linear.bias, lib))
    if model.computes_logits:
        model.cpu_lm_head = InvariantLinear(model.embed_tokens if model.lm_head is None else model.lm_head, None, lib)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.grouped = InvariantExperts(module.experts, lib)
