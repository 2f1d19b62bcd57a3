"""What a cache of N tokens costs in Pagoda's KV pool, so a recommendation can name the
`--kv-cache-memory` value (GiB) that holds it. Read from the model's config.json alone: no
transformers, no torch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pagoda.errors import ConfigError
from pagoda.model_files import display_name, resolve_model

FLOAT32_BYTES = 4  # the KV dtype of Pagoda's CPU engine (dtype auto), where --kv-cache-memory applies
GIB = 2**30


@dataclass(frozen=True)
class KVFootprint:
    model: str
    bytes_per_token: int  # keys and values over every layer
    max_model_len: int | None = None  # the model's context, which `pagoda serve`'s pool must hold at least

    def gib_for(self, tokens: int) -> float:
        """The --kv-cache-memory value that holds `tokens`, rounded up to 0.01 GiB."""
        return math.ceil(tokens * self.bytes_per_token / GIB * 100) / 100


def kv_footprint(model: str | None) -> KVFootprint | None:
    """The float32 KV footprint of `model` (None: Pagoda's default); None when its config cannot
    be read or lacks the sizes."""
    try:
        config = json.loads((Path(resolve_model(model)) / "config.json").read_text(encoding="utf-8"))
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        layers = config["num_hidden_layers"]
    except (ConfigError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    context = config.get("max_position_embeddings")
    return KVFootprint(
        display_name(model),
        2 * layers * kv_heads * head_dim * FLOAT32_BYTES,
        context if isinstance(context, int) and context > 0 else None,
    )
