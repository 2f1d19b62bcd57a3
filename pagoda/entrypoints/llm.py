"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from pagoda.engine.args import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import SequenceOutput
from pagoda.model_files import apply_chat_template
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput]  # n sequences, by index
    num_cached_tokens: int


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        """`engine_args`: the other fields of EngineArgs; one it lacks is a TypeError that names it."""
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        prompt_ids = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, params_list)]
        done: dict[str, dict[int, SequenceOutput]] = {i: {} for i in ids}
        with tqdm(total=sum(sp.n for sp in params_list), disable=not use_tqdm, desc="Generating") as bar:
            while self.engine.has_unfinished:
                for update in self.engine.step():
                    if update.finished:
                        done[update.request_id][update.index] = update
                        bar.update(1)
        return [
            RequestOutput(i, p, [done[i][k] for k in sorted(done[i])], done[i][0].metrics.num_cached_tokens)
            for i, p in zip(ids, prompt_ids)
        ]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, c, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
