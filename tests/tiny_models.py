"""Tiny random models of every supported architecture, written at test time as HF directories
(config, safetensors, the default model's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], pad_token_id=None)),  # layer 2: no rotary embedding
    "phi3": ("Phi3Config", dict(pad_token_id=None)),  # its projections fused in the checkpoint (qkv, gate_up)
    "granite": (  # multipliers as Granite 3's, the attention's its own (not head_dim^-0.5)
        "GraniteConfig",
        dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=8.0),
    ),
    # mixtures of experts of 4 experts, 2 or 3 a token (a sum of 3 has an order to keep)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=3, sliding_window=None)),
    "qwen2_moe": (  # a shared expert; layer 1 dense (mlp_only_layers); weights as chosen, not renormalized
        "Qwen2MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
        | dict(mlp_only_layers=[1], norm_topk_prob=False),
    ),
    "qwen3_moe": (  # decoder_sparse_step 2: layer 0 dense, layer 1 sparse
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32)
        | dict(decoder_sparse_step=2),
    ),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=3)),  # q/k norms over the projection
    "granitemoe": (  # its experts stacked in the checkpoint; Granite's multipliers
        "GraniteMoeConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, attention_multiplier=0.0625)
        | dict(residual_multiplier=0.22, logits_scaling=8.0),
    ),
}


def write_tiny_model(
    arch: str, out: Path, tokenizer, tie_word_embeddings: bool = False, vocab_size: int | None = None
) -> Path:
    """`vocab_size`: fewer embeddings than the tokenizer has tokens (a model that only ever sees
    and emits the first ids), where the full vocabulary would make a test slow."""
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, class_name)(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.5,  # wide logits: greedy choices are rarely near-ties
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ("qwen2", "qwen2_moe"):  # give the qkv biases real values
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch in ("qwen3", "qwen3_moe", "olmoe"):  # q and k norms with weights of their own (HF starts both at ones)
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
