"""What the offline engine (LLMEngine) and the server's engine (AsyncEngine) share: the validated
config, the tokenizer, the engine core, and the output processor that turns the core's token
updates into text updates."""

from __future__ import annotations

from pagoda.engine.args import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, make_requests
from pagoda.model_files import load_tokenizer
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


class EngineBase:
    def __init__(self, args: EngineArgs) -> None:
        self.config = args.create_config()
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.core = EngineCore(self.config)
        self.outputs = OutputProcessor(self.tokenizer)

    def _new_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[Request]:
        """The engine requests of one caller request, one per sequence of n."""
        m = self.config.model
        return make_requests(request_id, prompt_ids, params, m.eos_token_ids, m.max_model_len)
