"""vLLM's scoring routes for an embedding model (--runner pooling): POST /score (also /v1/score)
and POST /rerank (also /v1/rerank, /v2/rerank: Jina's and Cohere's shape). A pair's score is the
cosine similarity of the two texts' vectors, as vLLM scores pairs with an embedding model; each
distinct text is embedded once, by one engine request."""

from __future__ import annotations

import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.completions import prompts_of
from pagoda.entrypoints.openai.embeddings import check_pooling, checked, embedded
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import RerankRequest, ScoreRequest
from pagoda.entrypoints.openai.serving import ServerState, answer_id
from pagoda.pooling_params import PoolingParams

# a score request's two sides, by vLLM's names for them
SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


async def create_score(state: ServerState, body: ScoreRequest, http: Request) -> Response:
    state.check_model(body.model)
    check_pooling(state, "/score")
    given = [(a, b) for a, b in SIDES if getattr(body, a) is not None and getattr(body, b) is not None]
    names = {name for a, b in SIDES for name in (a, b) if getattr(body, name) is not None}
    if len(given) != 1 or names != set(given[0]):
        raise bad_request(
            "Give the two sides to score under one pair of names: text_1 and text_2 (or queries and documents, "
            "queries and items, data_1 and data_2)",
            "text_1",
        )
    first_name, second_name = given[0]
    request_id = answer_id(http, "score-", body.request_id)
    sides = ((getattr(body, first_name), first_name), (getattr(body, second_name), second_name))
    scores, tokens = await _similarities(state, http, "/score", request_id, body, sides)
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    answer = {"id": request_id, "object": "list", "created": int(time.time())}
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    return JSONResponse({**answer, "model": state.answering_model(body.model), "data": data, "usage": usage})


async def create_rerank(state: ServerState, body: RerankRequest, http: Request) -> Response:
    state.check_model(body.model)
    check_pooling(state, "/rerank")
    request_id = answer_id(http, "rerank-", body.request_id)
    sides = ((body.query, "query"), (body.documents, "documents"))
    scores, tokens = await _similarities(state, http, "/rerank", request_id, body, sides)
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)  # ties keep the documents' order
    top = ranked[: body.top_n] if body.top_n else ranked
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in top]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse(
        {"id": request_id, "model": state.answering_model(body.model), "usage": usage, "results": results}
    )


async def _similarities(
    state: ServerState,
    http: Request,
    endpoint: str,
    request_id: str,
    body: ScoreRequest | RerankRequest,
    sides: tuple[tuple[str | list[str], str], tuple[str | list[str], str]],
) -> tuple[list[float], int]:
    """For the two sides' texts (a text or a list, each with its field's name, which a 400 names),
    the cosine similarity of first[i] (first[0] where it holds one) and second[i] for each i, and
    the prompt tokens embedded: every distinct prompt embedded once (unit length or not: the cosine
    is the same)."""
    (first, first_name), (second, second_name) = sides
    keep, side = body.truncate_prompt_tokens, body.truncation_side
    first_ids = checked(state, [p.ids for p in await prompts_of(state, first, first_name)], first_name, keep, side)
    second_ids = checked(state, [p.ids for p in await prompts_of(state, second, second_name)], second_name, keep, side)
    if len(first_ids) not in (1, len(second_ids)):
        raise bad_request(
            f"{first_name} holds {len(first_ids)} texts and {second_name} {len(second_ids)}: give one, or as many "
            f"as {second_name}",
            first_name,
        )
    distinct = list(dict.fromkeys(tuple(ids) for ids in first_ids + second_ids))
    prompts = [list(ids) for ids in distinct]
    vectors = await embedded(state, http, endpoint, request_id, prompts, PoolingParams(), body)
    by_prompt = {ids: np.asarray(vector, dtype=np.float64) for ids, vector in zip(distinct, vectors)}
    firsts = first_ids * len(second_ids) if len(first_ids) == 1 else first_ids
    scores = [_cosine(by_prompt[tuple(a)], by_prompt[tuple(b)]) for a, b in zip(firsts, second_ids)]
    return scores, sum(map(len, distinct))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """torch's cosine_similarity, in double precision: a.b / max(|a| |b|, 1e-8)."""
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-8))
