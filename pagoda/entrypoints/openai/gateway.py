"""What a gateway in front of several replicas asks of each one, in SGLang's spellings, so that
SGLang Model Gateway (`smg`) balances Pagoda replicas as it balances SGLang workers
(docs/scaling.md):

- `GET /v1/loads`: the scheduler's load in SGLang's schema (one data-parallel rank); the gateway
  polls it for its load-aware choices and overload protection, preferring it to /metrics.
- `GET /get_model_info`, `GET /get_server_info`: what the model and the server are; and
  `GET /health_generate`: 200 once the engine has generated a token (503 if it cannot). The
  gateway forwards its own routes of those names to a worker.
- `POST /flush_cache`: SGLang's name for POST /reset_prefix_cache; the gateway's /flush_cache
  sends it to every worker.

All are open (no API key), as /health and /metrics are: they carry no prompt text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime

from fastapi import APIRouter
from fastapi.responses import Response

from pagoda import __version__
from pagoda.engine.async_engine import AsyncEngine, EngineDeadError
from pagoda.entrypoints.openai.serving import ServerState
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

HEALTH_GENERATE_S = 30.0  # past this, a one-token generation counts as a failed check


def gateway_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.get("/v1/loads")
    async def loads() -> dict:
        return {"timestamp": datetime.now(UTC).isoformat(), "dp_rank_count": 1, "loads": [load_snapshot(state)]}

    @router.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await generates_a_token(engine) else 503)

    @router.get("/get_model_info")
    async def model_info() -> dict:
        model = engine.config.model
        return {
            "model_path": model.path,
            "tokenizer_path": model.tokenizer or model.path,
            "served_model_name": state.model_name,
            "is_generation": engine.config.pooler is None,  # SGLang's: False for an embedding model
            "max_model_len": model.max_model_len,
            "architecture": model.architecture,
        }

    @router.get("/get_server_info")
    async def server_info() -> dict:
        config = engine.config
        return {
            "version": __version__,
            "served_model_name": state.model_name,
            "device": config.device.type,
            "attention_backend": config.attention_backend,
            "cache": asdict(config.cache),
            "scheduler": asdict(config.scheduler),
            "internal_states": [load_snapshot(state)],
        }

    return router


async def generates_a_token(engine: AsyncEngine) -> bool:
    """Whether the engine generates one greedy token for a one-token prompt within HEALTH_GENERATE_S
    (the pooling runner: that prompt's embedding)."""
    prompt = list(engine.config.model.eos_token_ids[:1]) or [0]  # any one token will do
    request_id = f"health-generate-{uuid.uuid4().hex}"
    pooling = engine.config.pooler is not None
    params = PoolingParams() if pooling else SamplingParams(max_tokens=1, temperature=0)

    async def one_token() -> bool:
        async for update in engine.generate(request_id, prompt, params):
            if update.finished:
                return True
        return False

    try:
        return await asyncio.wait_for(one_token(), HEALTH_GENERATE_S)
    except (TimeoutError, EngineDeadError):
        return False


def load_snapshot(state: ServerState) -> dict:
    """One rank of SGLang's /v1/loads: requests running and waiting, the share of KV blocks
    requests hold (idle cached blocks count as free), and the prefix cache's token hit rate."""
    stats = state.engine.stats
    return {
        "dp_rank": 0,
        "num_running_reqs": stats.num_running,
        "num_waiting_reqs": stats.num_waiting,
        "num_total_reqs": stats.num_running + stats.num_waiting,
        "token_usage": stats.kv_usage,
        "cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
        "max_running_requests": state.engine.config.scheduler.max_num_seqs,
        "time": time.time(),
    }
