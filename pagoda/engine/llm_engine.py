"""The synchronous engine: tokenize, add, step, detokenize. The offline LLM API drives it; the
server's AsyncEngine runs the same EngineCore on a thread of its own."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from pagoda.engine.args import EngineArgs
from pagoda.engine.base import EngineBase
from pagoda.engine.outputs import SequenceOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.lora import LoRARequest


class LLMEngine(EngineBase):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self._ids = itertools.count()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def get_tokenizer(self):
        """vLLM's LLMEngine.get_tokenizer, for scripts that reach it through `llm.llm_engine`."""
        return self.tokenizer

    @property
    def model_config(self):
        """vLLM's name for the model's config (its `max_model_len`, `dtype`, `hf_config`, ..)."""
        return self.config.model

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> str:
        """Queue one prompt; returns its request id. PoolingParams: an embedding (the pooling
        runner's). `cache_salt` (vLLM's): only requests with the same salt share prefix-cache
        blocks; `lora_request`: the adapter it runs; `priority`: lower first under the priority
        policy (vLLM's)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters are not supported with the pooling runner")
            requests = self._embedding_requests(request_id, prompt_ids, params, cache_salt, priority)
        else:
            adapter = None if lora_request is None else self.adapter(lora_request)
            constraint = params.structured_outputs
            grammar = self.compile_grammar(constraint) if constraint is not None else None
            requests = self._new_requests(request_id, prompt_ids, params, grammar, cache_salt, adapter, priority)
        for request in requests:
            self.core.add_request(request)
        self.outputs.add(request_id, requests)
        return request_id

    def step(self) -> list[SequenceOutput]:
        updates, stopped = self.outputs.process(self.core.step().outputs)
        for engine_id, stop_string in stopped:
            self.core.finish_requests([engine_id], "stop", stop_string)
        return updates

    def abort(self, request_ids: list[str]) -> None:
        """End these requests (as add_request named them) wherever they are, their outputs forgotten,
        so that a caller interrupted half way leaves nothing behind for the next one."""
        wanted = set(request_ids)
        engine_ids = [eid for eid, seq in self.outputs.sequences.items() if seq.out.request_id in wanted]
        self.core.finish_requests(engine_ids, "abort")
        for engine_id in engine_ids:
            self.outputs.drop(engine_id)

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished
