"""`pagoda serve --enable-lora --lora-modules NAME=PATH`: a PEFT adapter of a tiny model served as a
model name, through the `openai` client: listed with its parent, its answers PEFT's greedy tokens
and named after it, the base model's unchanged beside it; adapters loaded and unloaded while
serving (vLLM's routes, with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and read again from their folders
after --max-cpu-loras dropped them."""

from __future__ import annotations

import os
import shutil
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
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # read by the server at launch
    try:
        server = _launch(
            folder,
            "lora",
            str(model_dir),
            *("--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"ft={adapter}"),
            *("--max-loras", "2", "--max-cpu-loras", "1", "--kv-cache-memory", "0.05", "--max-model-len", "256"),
        )
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    yield server.wait_healthy(), model_dir, adapter
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)


def test_an_adapter_is_a_model_name(lora_server):
    server, model_dir, adapter = lora_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", "ft"} and cards["tiny"].model_extra["parent"] is None
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
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("pagoda:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info  # --max-loras


def test_adapters_load_and_unload_while_serving(lora_server, tmp_path):
    server, model_dir, adapter = lora_server
    http = httpx.Client(base_url=server.base_url, timeout=60)

    def complete(model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        return http.post("/v1/completions", json={**body, "return_token_ids": True})

    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": str(adapter)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'again' added successfully."
    assert "again" in {card["id"] for card in http.get("/v1/models").json()["data"]}
    assert complete("again").json()["choices"][0]["token_ids"] == reference(model_dir, adapter)[0]
    for body, status, param in [
        ({"lora_name": "again", "lora_path": str(adapter)}, 400, "lora_name"),  # already loaded
        ({"lora_name": "tiny", "lora_path": str(adapter)}, 400, "lora_name"),  # the base model's name
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, 404, "lora_path"),  # no adapter there
    ]:
        refused = http.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text
    assert (
        http.post(
            "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": str(adapter), "load_inplace": True}
        ).status_code
        == 200
    )
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'again' removed successfully."
    assert complete("again").status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 404
    # --max-cpu-loras 1: "ft" was dropped when "again" was read; it is read again from its folder
    assert complete("ft").json()["choices"][0]["token_ids"] == reference(model_dir, adapter)[0]
    gone = tmp_path / "gone"
    shutil.copytree(adapter, gone)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(gone)}).status_code == 200
    assert complete("ft").status_code == 200  # "gone" dropped
    shutil.rmtree(gone)
    refused = complete("gone")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model", refused.text
    assert "Loading LoRA adapter 'gone' failed" in refused.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200


def test_without_runtime_updating_adapters_cannot_be_loaded(server):
    sent = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert sent.status_code == 404
