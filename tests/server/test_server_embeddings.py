"""`pagoda serve --runner pooling`: POST /v1/embeddings through the official `openai` client (which
asks for base64 and decodes it), LangChain's OpenAIEmbeddings, and as raw JSON: each input's vector
equal to transformers' on the same weights, in input order, as text, token ids or a conversation;
Matryoshka lengths, vLLM's extensions, and the 400s that name the field. A generating server
refuses embeddings, and the embedding server refuses text generation, as vLLM does (404)."""

from __future__ import annotations

import base64
import json
import os
import signal

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel

from tests.server.conftest import _launch
from tests.server.helpers import API_KEY
from tests.tiny_models import write_tiny_model

TEXTS = ["The capital of France is Paris.", "hello", "Embeddings map texts of like meaning to nearby vectors."]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    from pagoda.model_files import load_tokenizer

    folder = tmp_path_factory.mktemp("embedding_server")
    tokenizer = load_tokenizer(None)
    model_dir = write_tiny_model("qwen3", folder / "tiny", tokenizer)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    server = _launch(
        folder,
        "embed",
        str(model_dir),
        *("--runner", "pooling", "--served-model-name", "tiny-embed"),
        *("--kv-cache-memory", "0.02", "--max-model-len", "64", "--max-num-batched-tokens", "16"),
    )
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reference(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0, -1]

    yield server.wait_healthy(), tokenizer, reference
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)


def unit(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=-1)


def test_the_openai_client_gets_each_inputs_vector(embedding_server):
    server, tokenizer, reference = embedding_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    answer = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64
    assert answer.model == "tiny-embed" and answer.object == "list" and [d.index for d in answer.data] == [0, 1, 2]
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for data, prompt in zip(answer.data, ids):
        assert len(data.embedding) == 64
        assert (torch.tensor(data.embedding) - unit(reference(prompt))).abs().max() < 1e-5
    # token ids, one prompt or several, and the float format: the same vectors
    floats = client.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float").data[0].embedding
    assert floats == answer.data[0].embedding  # base64's float32 bytes decode to the very values
    many = client.embeddings.create(model="tiny-embed", input=ids[1:], encoding_format="float")
    assert [d.embedding for d in many.data] == [d.embedding for d in answer.data[1:]]
    # Matryoshka (the config sets is_matryoshka): the first 16 values, then unit length
    short = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(short) == 16 and (torch.tensor(short) - unit(reference(ids[0])[:16])).abs().max() < 1e-5


def test_the_load_line_says_how_vectors_are_made(embedding_server):
    assert "deterministic on, embeddings: LAST pooling, unit length) in" in embedding_server[0].log()


def test_vllm_extensions(embedding_server):
    server, tokenizer, reference = embedding_server
    with httpx.Client(base_url=server.base_url, timeout=60) as http:

        def embed(**body) -> dict:
            response = http.post("/v1/embeddings", json={"model": "tiny-embed", **body})
            assert response.status_code == 200, response.text
            return response.json()

        ids = tokenizer.encode(TEXTS[2])
        raw = embed(input=TEXTS[2], use_activation=False)["data"][0]["embedding"]
        assert (torch.tensor(raw) - reference(ids)).abs().max() < 1e-5  # not scaled to unit length
        kept = embed(input=TEXTS[2], truncate_prompt_tokens=5)  # the first 5, as vLLM's pooling runner keeps
        assert kept["usage"]["prompt_tokens"] == 5
        assert (torch.tensor(kept["data"][0]["embedding"]) - unit(reference(ids[:5]))).abs().max() < 1e-5
        last = embed(input=TEXTS[2], truncate_prompt_tokens=5, truncation_side="left")["data"][0]["embedding"]
        assert (torch.tensor(last) - unit(reference(ids[-5:]))).abs().max() < 1e-5
        whole = embed(input=TEXTS[2], truncate_prompt_tokens=-1)  # -1: the whole context, here all of it
        assert whole["usage"]["prompt_tokens"] == len(ids)
        # a conversation, rendered by the chat template as /tokenize renders it (no generation prompt)
        messages = [{"role": "user", "content": "What is an embedding?"}]
        rendered = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
        chat = embed(messages=messages)
        assert chat["usage"]["prompt_tokens"] == len(rendered)
        assert (torch.tensor(chat["data"][0]["embedding"]) - unit(reference(rendered))).abs().max() < 1e-5
        special = {"messages": messages, "add_generation_prompt": False, "add_special_tokens": True}
        with_special = http.post("/tokenize", json=special).json()["tokens"]  # the tokenizer's on top of the template's
        assert embed(**special)["usage"]["prompt_tokens"] == len(with_special)
        # SageMaker's route, as vLLM's: an embedding server's body with `input` is an embedding request
        sagemaker = http.post("/invocations", json={"input": TEXTS[2], "use_activation": False}).json()
        assert sagemaker["data"][0]["embedding"] == raw
        # base64 in float16 or bfloat16, big-endian: the float32 vector's values rounded
        vector = np.asarray(embed(input=TEXTS[0])["data"][0]["embedding"], dtype=np.float32)
        half = embed(input=TEXTS[0], encoding_format="base64", embed_dtype="float16", endianness="big")
        decoded = np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), dtype=">f2")
        assert np.array_equal(decoded, vector.astype(np.float16))
        brain = embed(input=TEXTS[0], encoding_format="base64", embed_dtype="bfloat16", endianness="little")
        bits = np.frombuffer(base64.b64decode(brain["data"][0]["embedding"]), dtype="<u2").astype(np.uint32) << 16
        want = torch.tensor(vector).bfloat16().float().numpy()
        assert np.array_equal(bits.view(np.float32), want)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "hi", "dimensions": 100}, "dimensions", "between 1 and 64"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[1, 2], [10**9]]}, "input", "outside the vocabulary"),
        ({"input": list(range(1, 70))}, "input", "maximum context length is 64 tokens"),
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "input", "exactly one of"),
        ({"input": "hi", "encoding_format": "bytes"}, "encoding_format", ""),
        ({"input": "hi", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "cannot be greater"),
        ({"input": "hi", "normalize": True}, "normalize", "use_activation"),
        ({"input": "hi", "padding": "max_length"}, "padding", "do_not_pad"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ],
)
def test_bad_requests_name_the_field(embedding_server, body, param, words):
    server = embedding_server[0]
    response = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_each_server_refuses_the_others_api(embedding_server, server):
    embedder = embedding_server[0]
    text = httpx.post(f"{embedder.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    chat = httpx.post(
        f"{embedder.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60
    )
    responses = httpx.post(f"{embedder.base_url}/v1/responses", json={"input": "hi"}, timeout=60)
    anthropic = httpx.post(
        f"{embedder.base_url}/v1/messages",
        json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    for response in (text, chat, responses, anthropic):  # 404s, as vLLM routes only its model's tasks
        assert response.status_code == 404 and "--runner pooling" in response.json()["error"]["message"]
    assert text.json()["error"]["code"] == "unsupported_endpoint"
    generating = httpx.post(
        f"{server.base_url}/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert generating.status_code == 404 and generating.json()["error"]["code"] == "unsupported_endpoint"
    assert "--runner pooling" in generating.json()["error"]["message"]


def test_langchain_embeddings(embedding_server):
    """LangChain's OpenAIEmbeddings, as its docs set it up for an OpenAI-compatible server (no
    tiktoken pre-chunking: the server tokenizes)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    server, tokenizer, reference = embedding_server
    embeddings = langchain_openai.OpenAIEmbeddings(
        model="tiny-embed", base_url=f"{server.base_url}/v1", api_key="none", check_embedding_ctx_length=False
    )
    documents = embeddings.embed_documents(TEXTS)
    for vector, text in zip(documents, TEXTS):
        assert (torch.tensor(vector) - unit(reference(tokenizer.encode(text)))).abs().max() < 1e-5
    assert embeddings.embed_query(TEXTS[1]) == documents[1]  # alone or among others: the same bits


def test_scores_and_reranking_are_cosine_similarities(embedding_server):
    """vLLM's /score and /rerank for an embedding model: each pair's cosine similarity of the two
    texts' vectors (as /v1/embeddings makes them), 1:N or N:N; /rerank's documents best first."""
    server = embedding_server[0]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        answer = http.post("/v1/embeddings", json={"input": TEXTS}).json()
        vectors = [torch.tensor(d["embedding"], dtype=torch.float64) for d in answer["data"]]

        def cosine(i: int, j: int) -> float:
            return float(torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0))

        one_to_many = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
        assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2] and one_to_many["object"] == "list"
        got = [d["score"] for d in one_to_many["data"]]
        assert max(abs(g - cosine(0, j)) for j, g in enumerate(got)) < 1e-6 and abs(got[0] - 1) < 1e-6
        assert one_to_many["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]  # each text embedded once
        pairs = http.post("/v1/score", json={"queries": TEXTS[:2], "documents": TEXTS[1:]}).json()["data"]
        assert [round(d["score"], 6) for d in pairs] == [round(cosine(0, 1), 6), round(cosine(1, 2), 6)]
        order = sorted(range(3), key=lambda j: cosine(1, j), reverse=True)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            ranked = http.post(path, json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2}).json()
            assert [r["index"] for r in ranked["results"]] == order[:2]
            assert ranked["results"][0]["document"] == {"text": TEXTS[order[0]]}
            assert abs(ranked["results"][1]["relevance_score"] - cosine(1, order[1])) < 1e-6
        assert len(http.post("/rerank", json={"query": "a", "documents": TEXTS}).json()["results"]) == 3  # top_n 0
        for body, param in [
            ({"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),  # 2 against 3
            ({"text_1": "a", "documents": ["b"]}, "text_1"),  # sides under two pairs of names
            ({"text_1": [], "text_2": ["b"]}, "text_1"),
            ({"text_1": "a", "text_2": [""]}, "text_2"),  # an empty prompt
        ]:
            refused = http.post("/score", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        refused = http.post("/rerank", json={"query": "a", "documents": []})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"


def test_a_generating_server_scores_nothing(server):
    for path, body in [("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})]:
        response = httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "unsupported_endpoint"
        assert "--runner pooling" in response.json()["error"]["message"]


def test_embedding_requests_count_in_the_server_load():
    """vLLM's GET /load counts an embedding model's requests (embeddings, scores, rankings) as it
    counts generation, each while its handler runs (an embedding is answered too fast to catch
    over HTTP, so the middleware runs here around a handler that reads the count)."""
    import asyncio

    from pagoda.entrypoints.openai.api import ServerLoad
    from pagoda.entrypoints.openai.serving import InFlight

    load, seen = InFlight(), []

    async def handler(scope, receive, send) -> None:
        seen.append(load.count)

    for path in ("/v1/embeddings", "/score", "/v2/rerank", "/v1/completions", "/tokenize"):
        asyncio.run(ServerLoad(handler, load)({"type": "http", "method": "POST", "path": path}, None, None))
    assert seen == [1, 1, 1, 1, 0] and load.count == 0
