"""The engine core: scheduler + model runner, one step at a time. It sees token ids only."""

from __future__ import annotations

import logging

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.engine.outputs import CoreOutput
from pagoda.errors import ConfigError
from pagoda.model_executor.model_runner import ModelRunner
from pagoda.request import Request

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.num_kv_blocks()
        capacity = (num_blocks - 1) * config.cache.block_size
        max_len = config.model.max_model_len
        if capacity < max_len:
            knob = "--gpu-memory-utilization" if config.device.type == "cuda" else "--kv-cache-memory"
            raise ConfigError(
                f"The KV cache ({num_blocks * self.runner.block_bytes() / 2**30:.2f} GiB: {capacity} tokens) cannot "
                f"hold one sequence of max_model_len={max_len}; raise {knob} or lower --max-model-len."
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        logger.info(
            "KV cache: %d blocks of %d tokens, %d tokens: %.1f sequences of max_model_len=%d at once",
            num_blocks - 1,
            config.cache.block_size,
            capacity,
            capacity / max_len,
            max_len,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.scheduler.abort(request)

    def finish(self, request_id: str, stop_reason: str) -> None:
        """End a request whose text hit a stop string."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, "stop", stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[CoreOutput]:
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        result = self.runner.execute(step)
        changed = set(map(id, self.scheduler.update(step, result.token_ids)))
        outputs = []
        for (request, _), token, logprob, prompt_lp in zip(
            step.scheduled, result.token_ids, result.logprobs, result.prompt_logprobs
        ):
            if id(request) not in changed and prompt_lp is None:
                continue
            if request.is_finished:
                self.requests.pop(request.request_id, None)
            if prompt_lp:
                request.num_prompt_logprobs += len(prompt_lp)
            outputs.append(
                CoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token] if id(request) in changed else [],
                    new_logprobs=[logprob] if logprob is not None and id(request) in changed else [],
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=prompt_lp,
                    arrival_time=request.arrival_time,
                    first_scheduled_time=request.first_scheduled_time,
                    first_token_time=request.first_token_time,
                )
            )
        return outputs

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.running)
