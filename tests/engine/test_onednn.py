"""oneDNN-packed linear layers on CPU: same results as F.linear within float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model_executor import onednn
from pagoda.model_executor.layers import Linear

pytestmark = pytest.mark.skipif(not onednn.supported(torch.float32, torch.device("cpu")), reason="no oneDNN")


def loaded_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    linear = Linear(in_features, out_features, bias, torch.float32, torch.device("cpu"))
    torch.nn.init.normal_(linear.weight)
    if bias:
        torch.nn.init.normal_(linear.bias)
    return linear


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = loaded_linear(96, 160, bias)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(onednn.PackedLinear(linear)(x), expected, atol=1e-4, rtol=1e-5)


def test_strided_input():
    linear = loaded_linear(64, 32, False)
    x = torch.randn(5, 128)[:, 32:96]
    assert not x.is_contiguous()
    torch.testing.assert_close(onednn.PackedLinear(linear)(x), F.linear(x, linear.weight), atol=1e-4, rtol=1e-5)


def test_supported_only_for_float32_on_cpu():
    assert onednn.supported(torch.float32, torch.device("cpu"))
    assert not onednn.supported(torch.bfloat16, torch.device("cpu"))
    assert not onednn.supported(torch.float32, torch.device("cuda"))


def test_the_default_model_is_packed(default_llm):
    """Every projection and the tied LM head are packed; the embeddings stay plain for lookups."""
    model = default_llm.engine.core.runner.model
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, onednn.PackedLinear) for m in model.modules()) == 4 * model.dims.num_layers
    hidden = torch.randn(2, model.dims.hidden)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens), atol=1e-4, rtol=1e-5)
