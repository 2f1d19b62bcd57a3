"""The GPU's fused layer kernels (gpu_layers) against the torch ops they replace, on CPU tensors
under Triton's interpreter. In float16 every rounding is checked: the interpreter converts float32
to float16 as the GPU does, to nearest even (to bfloat16 it truncates, and to float8 it does not
carry a rounding into the next power of two, so those dtypes' roundings are checked on a GPU, by
benchmarks/gpu_engine.py's correctness part)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.model_executor import gpu_layers
from pagoda.model_executor.layers import apply_rotary, rms_norm
from pagoda.model_executor.quantization import FP8_MAX, quantize_per_token

HALF = torch.float16


@pytest.mark.parametrize("rows,width", [(5, 96), (3, 200), (0, 64)])
def test_add_rms_norm_equals_torch(rows, width):
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, width, dtype=HALF), torch.randn(rows, width, dtype=HALF) * 4
    weight = torch.randn(width, dtype=HALF)
    normed, stream = gpu_layers.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(stream, residual + x)
    # the sum of squares is the one reduction whose order differs from torch's: the last bit at most
    want = rms_norm(residual + x, weight, 1e-6)
    torch.testing.assert_close(normed, want, rtol=2e-3, atol=0)
    alone, same = gpu_layers.add_rms_norm(x, None, weight, 1e-6)
    assert same is x  # no stream yet: x starts it
    torch.testing.assert_close(alone, rms_norm(x, weight, 1e-6), rtol=2e-3, atol=0)


def test_add_rms_norm_reads_a_strided_row():
    wide = torch.randn(4, 160, dtype=HALF)
    x, residual, weight = wide[:, :80], torch.randn(4, 80, dtype=HALF), torch.rand(80, dtype=HALF)
    normed, stream = gpu_layers.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(stream, residual + x) and stream.is_contiguous()
    torch.testing.assert_close(normed, rms_norm(residual + x, weight, 1e-5), rtol=2e-3, atol=0)


@pytest.mark.parametrize("rows,width", [(4, 80), (2, 2500), (0, 16)])
def test_silu_and_mul_equals_torch(rows, width):
    torch.manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, dtype=HALF) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gpu_layers.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("heads,head_dim", [(6, 16), (5, 24), (40, 16)])
def test_rotate_equals_apply_rotary(heads, head_dim):
    """Query and key heads as the decoder hands them over: a strided view of the qkv projection."""
    torch.manual_seed(heads)
    tokens, positions = 7, torch.tensor([0, 3, 7, 20, 63, 5, 5])
    qkv = torch.randn(tokens, (heads + 2) * head_dim, dtype=HALF)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, signed_sin = torch.randn(64, head_dim, dtype=HALF), torch.randn(64, head_dim, dtype=HALF)
    want = apply_rotary(x, cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1))
    assert torch.equal(gpu_layers.rotate(x, positions, cos, signed_sin), want)


def test_fp8_quantization_equals_torch():
    """Scales and codes exactly as quantize_per_token's, an all-zero row's too. The rows hold float8
    values times a power of two, each row's largest 448: the interpreter's float8 conversion does
    not carry a rounding into the next power of two, so rounding itself is checked on a GPU."""
    torch.manual_seed(0)
    codes = (torch.randn(4, 96) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    codes[:, 7] = FP8_MAX
    x = (codes * torch.tensor([[2.0**-6], [1.0], [2.0**3], [0.0]])).to(torch.bfloat16)
    got, scale = gpu_layers.quantize_per_token(x)
    want, want_scale = quantize_per_token(x)
    assert torch.equal(scale, want_scale) and scale[3, 0] > 0
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    rows = torch.randn(16, 300, dtype=torch.bfloat16) * torch.rand(16, 1, dtype=torch.bfloat16) * 50
    assert torch.equal(gpu_layers.quantize_per_token(rows)[1], quantize_per_token(rows)[1])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_converted_model_generates_the_same(arch, tokenizer, tmp_path):
    """A float16 model with its layers swapped for the kernels: the same greedy tokens, logprobs
    within the norm's last bit (the decoder's wiring of norms, activations and rotation, Qwen3's
    separately rotated q/k-normed heads included)."""
    from tests.tiny_models import write_tiny_model

    model_dir = write_tiny_model(arch, tmp_path / arch, tokenizer)
    llm = LLM(str(model_dir), dtype="float16", attention_backend="torch", kv_cache_memory=0.01, max_model_len=256)
    prompts = [[5, 17, 300, 42, 8, 99], list(range(200, 231))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    before = [o.outputs[0] for o in llm.generate(prompts, params)]
    model = llm.engine.core.runner.model
    gpu_layers.convert_model(model)
    assert isinstance(model.rotary, gpu_layers.GpuRotaryEmbedding)
    assert isinstance(model.layers[0].mlp.act, gpu_layers.GpuSiluAndMul)
    after = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(before, after):
        assert a.token_ids == b.token_ids
        worst = max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert worst < 0.03, worst


def test_convert_model_gives_fp8_linears_the_one_kernel_quantization():
    from pagoda.model_executor.layers import Linear
    from pagoda.model_executor.quantization import Fp8Linear

    linear = Linear(32, 16, False, torch.bfloat16, torch.device("cpu"))
    linear.weight.data.normal_()
    model = torch.nn.Sequential(Fp8Linear(linear))
    assert model[0].quantize_activations is quantize_per_token
    gpu_layers.convert_model(model)
    assert model[0].quantize_activations is gpu_layers.quantize_per_token


def test_the_loader_fuses_half_precision_on_a_gpu_only(monkeypatch, caplog):
    """load_model's choice: gpu_layers where it serves the dtype and device, torch's ops where not,
    and where Triton cannot be imported (a warning says so)."""
    from pagoda.model_executor import loader
    from pagoda.model_executor.layers import ResidualRMSNorm, SiluAndMul

    def model():
        return torch.nn.Sequential(ResidualRMSNorm(8, 1e-6, HALF, torch.device("cpu")), SiluAndMul())

    cuda = torch.device("cuda")
    for dtype, device, fused in ((HALF, cuda, True), (torch.float32, cuda, False), (HALF, torch.device("cpu"), False)):
        m = model()
        loader._fuse_gpu_layers(m, dtype, device)
        assert (
            isinstance(m[0], gpu_layers.GpuResidualRMSNorm) is fused
            and isinstance(m[1], gpu_layers.GpuSiluAndMul) is fused
        )
    import sys

    import pagoda.model_executor

    monkeypatch.setitem(sys.modules, "pagoda.model_executor.gpu_layers", None)  # its import now fails
    monkeypatch.delattr(pagoda.model_executor, "gpu_layers")
    m = model()
    loader._fuse_gpu_layers(m, HALF, cuda)
    assert isinstance(m[0], ResidualRMSNorm) and "Triton is not importable" in caplog.text
