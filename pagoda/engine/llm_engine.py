"""The synchronous engine: tokenize, add, step, detokenize. The offline LLM API drives it; the
server's AsyncEngine runs the same EngineCore on a thread of its own."""

from __future__ import annotations

import itertools

from pagoda.engine.args import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, make_requests
from pagoda.engine.outputs import SequenceOutput
from pagoda.model_files import load_tokenizer
from pagoda.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.config = args.create_config()
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.core = EngineCore(self.config)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        m = self.config.model
        requests = make_requests(request_id, prompt_ids, params, m.eos_token_ids, m.max_model_len)
        for request in requests:
            self.core.add_request(request)
        self.outputs.add(request_id, requests)
        return request_id

    def step(self) -> list[SequenceOutput]:
        updates, stopped = self.outputs.process(self.core.step())
        for engine_id, stop_string in stopped:
            self.core.finish(engine_id, stop_string)
        return updates

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished
