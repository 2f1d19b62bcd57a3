"""Embeddings: how a pooling model turns a prompt's final hidden states into one vector (the
engine's `PoolerConfig`), and what a request may change of it (`PoolingParams`), with vLLM's
names. Pure Python: no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from pagoda.errors import ConfigError
from pagoda.sampling_params import SamplingParams, SamplingParamsError

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """LAST: the last prompt token's final hidden state (a decoder's embedding, vLLM's default for
    one); MEAN: the mean over every prompt token's; CLS: the first token's. `use_activation`: the
    vector scaled to unit length (vLLM's name; sentence-transformers' Normalize module).
    `dimensions`: the default length of a Matryoshka model's vectors, None: the hidden size."""

    pooling_type: PoolingType = "LAST"
    use_activation: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if not isinstance(self.use_activation, bool):
            raise ConfigError(f"pooler_config.use_activation must be true or false, got {self.use_activation!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise ConfigError(f"pooler_config.dimensions must be an integer, got {self.dimensions!r}")

    @classmethod
    def resolve(cls, model_path: str, given: str | dict | None) -> PoolerConfig:
        """The model folder's sentence-transformers pooling (its modules.json and Pooling module's
        config, as vLLM reads them), else LAST with unit length; then `given` (--pooler-config, JSON
        or a dict) over it, key by key. vLLM's spelling `seq_pooling_type` is taken for pooling_type."""
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"pooler_config is not valid JSON: {exc}") from None
        if not isinstance(given, dict | None):
            raise ConfigError(f"pooler_config must be a JSON object, got {given!r:.80}")
        given = dict(given or {})
        if "seq_pooling_type" in given:
            given["pooling_type"] = given.pop("seq_pooling_type")
        if isinstance(given.get("pooling_type"), str):
            given["pooling_type"] = given["pooling_type"].upper()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"pooler_config: unknown or unsupported key(s) {unknown}; known: {sorted(known)}")
        found = sentence_transformers_pooling(Path(model_path), chosen="pooling_type" in given)
        return cls(**{**found, **given})


def _sentence_transformers_module(kind: object, name: str) -> bool:
    """Whether a modules.json type names sentence-transformers' module `name` (by any of the paths
    its versions give it: sentence_transformers.models.Pooling, ...sentence_transformer.modules.pooling.Pooling)."""
    return isinstance(kind, str) and kind.startswith("sentence_transformers.") and kind.endswith(f".{name}")


def _pooling_name(flag: str) -> str:
    """vLLM's reading of a Pooling module's mode: pooling_mode_mean_tokens is MEAN, _cls_token CLS,
    _lasttoken LAST (and max_tokens MAX, weightedmean_tokens WEIGHTEDMEAN: none Pagoda makes)."""
    name = flag.removeprefix("pooling_mode_").split("_", 1)[0]
    return "LAST" if "lasttoken" in name else name.upper()


def sentence_transformers_pooling(folder: Path, chosen: bool = False) -> dict:
    """PoolerConfig fields from a sentence-transformers model's modules.json, as vLLM reads them:
    where it has a Pooling module, use_activation (whether it has a Normalize module too) and
    pooling_type from that module's config; {} otherwise. A pooling Pagoda does not make (max,
    weighted mean, several at once) is refused unless the pooling type is `chosen` elsewhere
    (--pooler-config); vLLM would fall back to LAST there, giving vectors the model was not
    trained to make."""
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return {}
    modules = [m for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if _sentence_transformers_module(m.get("type"), "Pooling")), None)
    if pooling is None:
        return {}
    found: dict = {"use_activation": any(_sentence_transformers_module(m.get("type"), "Normalize") for m in modules)}
    settings = _json(folder / str(pooling.get("path", "")) / "config.json")
    settings = settings if isinstance(settings, dict) else {}
    mode = settings.get("pooling_mode")  # newer sentence-transformers: one name
    flags = (
        [mode]
        if isinstance(mode, str)
        else [k for k, v in settings.items() if k.startswith("pooling_mode_") and v is True]
    )
    names = [_pooling_name(flag) for flag in flags]
    if chosen or not names:
        return found
    if len(names) > 1 or names[0] not in POOLING_TYPES:
        raise ConfigError(
            f"{folder}: the sentence-transformers pooling {', '.join(flags)} is not one Pagoda makes (last token, "
            "mean or CLS); choose one with --pooler-config '{\"pooling_type\": ...}' if the model takes it"
        )
    return {**found, "pooling_type": names[0]}


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Pooling:
    """What the engine makes of one embedding request's prompt: its pooling, the length of its
    vector (None: the hidden size) and whether it is scaled to unit length."""

    pooling_type: PoolingType
    dimensions: int | None
    normalize: bool

    @property
    def every_row(self) -> bool:
        """Whether the vector reads more than the last prompt row: then every prompt token must be
        computed (no prefix-cache hit may skip one)."""
        return self.pooling_type != "LAST"


# the pooling runner's startup steps (kernel compiles, the GPU's memory profile): their requests
# sample nothing, as the runner has no LM head, and their vectors are thrown away
WARMUP_POOLING = Pooling("LAST", None, False)


@dataclass
class PoolingParams:
    """One embedding request's options (vLLM's): `dimensions`, the length of a Matryoshka model's
    vector (its first values, then scaled to unit length if use_activation); `use_activation`,
    None: the pooler's."""

    dimensions: int | None = None
    use_activation: bool | None = None

    def resolved(self, pooler: PoolerConfig, hidden_size: int, matryoshka: bool | tuple[int, ...]) -> Pooling:
        """What the engine does for a request with these options on this model: SamplingParamsError
        naming the field where they cannot apply. `matryoshka`: whether the model's vectors may be
        cut short (True), or the lengths it was trained for."""
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise SamplingParamsError(
                "use_activation", f"use_activation must be true or false, got {self.use_activation!r}"
            )
        dims = self.dimensions if self.dimensions is not None else pooler.dimensions
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int):
                raise SamplingParamsError("dimensions", f"dimensions must be an integer, got {dims!r}")
            if not matryoshka:
                raise SamplingParamsError(
                    "dimensions",
                    "this model does not support Matryoshka embeddings (its config sets neither is_matryoshka nor "
                    "matryoshka_dimensions): dimensions must be unset",
                )
            if not 1 <= dims <= hidden_size:
                raise SamplingParamsError("dimensions", f"dimensions must be between 1 and {hidden_size}, got {dims}")
            if isinstance(matryoshka, tuple) and dims not in matryoshka:
                raise SamplingParamsError(
                    "dimensions", f"this model's Matryoshka dimensions are {list(matryoshka)}, got {dims}"
                )
        normalize = pooler.use_activation if self.use_activation is None else self.use_activation
        return Pooling(pooler.pooling_type, dims, normalize)


def sequences_of(params: SamplingParams | PoolingParams) -> int:
    """The sequences a request makes: its n samples, or one embedding."""
    return params.n if isinstance(params, SamplingParams) else 1


def matryoshka(hf_config) -> bool | tuple[int, ...]:
    """Whether a model's embeddings may be cut short (its config's is_matryoshka, as vLLM reads
    it), or the lengths it was trained for (matryoshka_dimensions)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(dims)
    return bool(getattr(hf_config, "is_matryoshka", False))


def too_long(num_tokens: int, max_model_len: int) -> str:
    """Why an embedding's prompt is refused (vLLM's words): it needs no room for output, only the context."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {num_tokens} "
        "tokens in the input for embedding generation. Please reduce the length of the input"
    )
