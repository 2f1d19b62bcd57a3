"""POST /v1/embeddings, OpenAI's with vLLM's extensions: one engine request per input, each answered
with its prompt's vector, in input order. Served by the pooling runner only (--runner pooling)."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai import chat
from pagoda.entrypoints.openai.completions import prompts_of
from pagoda.entrypoints.openai.errors import UNSERVED, APIError, bad_request
from pagoda.entrypoints.openai.params import truncated
from pagoda.entrypoints.openai.protocol import EmbeddingRequest, RerankRequest, ScoreRequest, TruncationSide
from pagoda.entrypoints.openai.serving import ServerState, answer_id
from pagoda.pooling_params import PoolingParams, too_long

ENDPOINT = "/v1/embeddings"


async def create_embedding(state: ServerState, body: EmbeddingRequest, http: Request) -> Response:
    state.check_model(body.model)
    if body.normalize is not None:
        raise bad_request(
            "normalize is not a field of this API: use use_activation (vLLM's name since 0.11)", "normalize"
        )
    if body.padding not in (None, "do_not_pad"):
        raise bad_request("padding: prompts are embedded as they are; only do_not_pad is taken", "padding")
    check_pooling(state, ENDPOINT)
    field = "input" if body.messages is None else "messages"
    prompts = checked(state, await _prompts(state, body), field, body.truncate_prompt_tokens, body.truncation_side)
    params = PoolingParams(body.dimensions, body.use_activation)  # the engine refuses what cannot apply, by name
    request_id = answer_id(http, "embd-", body.request_id)
    vectors = await embedded(state, http, ENDPOINT, request_id, prompts, params, body)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body)} for i, v in enumerate(vectors)]
    tokens = sum(map(len, prompts))
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": state.answering_model(body.model),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


def check_pooling(state: ServerState, endpoint: str) -> None:
    """A generating server's 404 for an embedding model's route, as vLLM routes only its model's tasks."""
    if state.engine.config.pooler is None:
        raise APIError(404, UNSERVED[endpoint], code="unsupported_endpoint")


def checked(
    state: ServerState, prompts: list[list[int]], field: str, keep: int | None, side: TruncationSide | None
) -> list[list[int]]:
    """The prompts cut to vLLM's truncate_prompt_tokens `keep` (-1: the whole context, as an
    embedding has no output; the pooling runner keeps a prompt's first tokens unless `side` is
    "left"), each refused, naming `field`, where empty or longer than the context."""
    max_model_len = state.limits.max_model_len
    if keep is not None:
        keep = max_model_len if keep == -1 else keep
        prompts = [truncated(ids, keep, side or "right", max_model_len) for ids in prompts]
    for ids in prompts:
        if not ids:
            raise bad_request(f"{field} holds an empty prompt: at least one token is needed to embed", field)
        if len(ids) > max_model_len:
            raise bad_request(f"{too_long(len(ids), max_model_len)} (or set truncate_prompt_tokens)", field)
    return prompts


async def embedded(
    state: ServerState,
    http: Request,
    endpoint: str,
    request_id: str,
    prompts: list[list[int]],
    params: PoolingParams,
    body: EmbeddingRequest | ScoreRequest | RerankRequest,
) -> list[list[float]]:
    """Each prompt's vector, in order: one engine request each, logged and counted as any."""
    generation = await state.launch(
        http, endpoint, request_id, prompts, params, body.cache_salt, body.model, body.priority
    )
    return [outs[0].embedding for outs in await state.collect(http, generation)]


async def _prompts(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    """The request's prompts: its inputs, or its conversation rendered by the chat template."""
    if (body.input is None) == (body.messages is None):
        raise bad_request("Give exactly one of `input` and `messages`.", "input")
    if body.messages is not None:
        return [await chat.render_body_messages(state, body)]
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return [p.ids for p in await prompts_of(state, body.input, "input", add_special)]


_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


def _encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    """The vector as the request asks: a list of floats, or base64 of its values' bytes in
    `embed_dtype` (float32 by default, as OpenAI's clients decode it) and `endianness` (native:
    this machine's, as vLLM sends)."""
    if body.encoding_format == "float":
        return vector
    values = np.asarray(vector, dtype=np.float32)
    if body.embed_dtype == "bfloat16":  # the top half of each float32, rounded to nearest even
        bits = values.view(np.uint32).astype(np.uint64)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    else:
        values = values.astype(_DTYPES[body.embed_dtype])
    order = {"native": "=", "little": "<", "big": ">"}[body.endianness]
    values = values.astype(values.dtype.newbyteorder(order))
    return base64.b64encode(values.tobytes()).decode("ascii")
