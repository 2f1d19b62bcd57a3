"""`pagoda serve --enable-lora --lora-modules NAME=PATH`: a PEFT adapter of a tiny model served as a
model name, through the `openai` client: listed with its parent, its answers PEFT's greedy tokens
and named after it, the base model's unchanged beside it."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM

from tests.engine.test_lora import ADAPTERS, PROMPTS, reference, write_adapter
from tests.server.conftest import _launch
from tests.tiny_models import write_tiny_model

pytest.importorskip("peft")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    folder = tmp_path_factory.mktemp("lora_server")
    model_dir = write_tiny_model("llama", folder / "tiny", load_tokenizer(None))
    adapter = write_adapter(AutoModelForCausalLM.from_pretrained(model_dir), folder / "ft", 0, **ADAPTERS["some"])
    server = _launch(
        folder,
        "lora",
        str(model_dir),
        *("--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"ft={adapter}"),
        *("--max-loras", "2", "--kv-cache-memory", "0.05", "--max-model-len", "256"),
    )
    yield server.wait_healthy(), model_dir, adapter
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)


def test_an_adapter_is_a_model_name(lora_server):
    server, model_dir, adapter = lora_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", "ft"}
    assert cards["ft"].model_extra["parent"] == "tiny" and cards["ft"].model_extra["root"] == str(adapter)
    want = {"ft": reference(model_dir, adapter), "tiny": reference(model_dir, None)}
    for model in ("ft", "tiny", "ft"):
        for prompt, tokens in zip(PROMPTS, want[model]):
            out = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert out.model == model and out.choices[0].model_extra["token_ids"] == tokens, (model, prompt)
    chat = client.chat.completions.create(model="ft", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "ft" and chat.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    assert "serves `tiny` and the LoRA adapters `ft`" in missing.value.message
    assert httpx.get(f"{server.base_url}/v1/models/ft", timeout=10).json()["parent"] == "tiny"
