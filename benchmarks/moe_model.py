"""A random mixture of experts to time: Qwen3-MoE's shape at 397M parameters (12 layers, 32 experts
of which 4 a token, 99M of them read per decoded token with the tied LM head), float32 weights
drawn by transformers from seed 0, the default model's tokenizer. No MoE checkpoint ships with
Pagoda and nothing can be downloaded here; the weights' values do not change the work a step does
beyond which experts the router picks.

    python benchmarks/moe_model.py DIR      # then MODEL_DIR=DIR benchmarks/serve_vs_vllm.sh
"""

from __future__ import annotations

import sys
from pathlib import Path


def write(out: Path) -> Path:
    import torch
    import transformers

    from pagoda.model_files import load_tokenizer

    tokenizer = load_tokenizer(None)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=2048,  # a dense layer's; every layer here is sparse
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write(Path(sys.argv[1])))
