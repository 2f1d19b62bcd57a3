"""The engine core: scheduler + model runner, one step at a time. It sees token ids only."""

from __future__ import annotations

import logging

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import SchedulerStats, StepOutputs
from pagoda.core.scheduler import Scheduler
from pagoda.core.spec_decode import NgramProposer, Proposer
from pagoda.errors import ConfigError
from pagoda.model_executor.model_runner import ModelRunner
from pagoda.request import Request

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        num_blocks = self.runner.num_kv_blocks()
        capacity = max(0, num_blocks - 1) * config.cache.block_size  # one block is the pool's null block
        max_len = config.model.max_model_len
        if capacity < max_len:
            knob = "--gpu-memory-utilization" if config.device.type == "cuda" else "--kv-cache-memory"
            raise ConfigError(
                f"The KV cache ({num_blocks} blocks of {config.cache.block_size} tokens: {capacity} tokens for "
                f"requests) cannot hold one sequence of max_model_len={max_len}; raise {knob} or lower "
                "--max-model-len (or --block-size)."
            )
        logger.info(
            "Allocating the KV cache: %.2f GiB of %s",
            num_blocks * self.runner.block_bytes() / 2**30,
            str(self.runner.kv_dtype).removeprefix("torch."),
        )
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        self.runner.compile_kernels()
        kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        proposer = make_proposer(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, kv, proposer)
        self._kept_adapters: frozenset[str] = frozenset()  # the LoRA adapter reads the engine holds
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

    def finish_requests(self, request_ids: list[str], reason: str, stop_reason: int | str | None = None) -> None:
        """End requests from outside a step: "abort", or "stop" with the stop string that matched."""
        self.scheduler.finish_requests(request_ids, reason, stop_reason)
        self._release_adapters()  # one may have run the last use of a dropped adapter

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> StepOutputs:
        step = self.scheduler.schedule()
        if step.is_empty:
            return StepOutputs([], self.scheduler.stats())
        outputs = self.scheduler.update(step, self.runner.execute(step))
        self._release_adapters()  # a finished request may have run the last use of a dropped adapter
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def keep_adapters(self, adapter_uids: frozenset[str]) -> None:
        """The LoRA adapter reads the engine holds: the model keeps those it has met; any other
        leaves it once no unfinished request runs it."""
        self._kept_adapters = adapter_uids
        self._release_adapters()

    def _release_adapters(self) -> None:
        lora = self.runner.lora
        if lora is None:
            return
        stale = lora.registered - self._kept_adapters
        if stale:
            stale -= {r.lora.uid for r in self.scheduler.requests.values() if r.lora is not None}
            for uid in stale:
                lora.unregister(uid)

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity(self.scheduler.running)
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.check_integrity()


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    from pagoda.model_executor.draft_proposer import DraftModelProposer

    logger.info("Loading the draft model %s", config.model)
    return DraftModelProposer(config)
