"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages, params)`,
returning vLLM-shaped `RequestOutput`s (pagoda.outputs)."""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from pagoda.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance, candidate_ranks, step_beams
from pagoda.engine.args import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints import LOG_FORMAT
from pagoda.generation_config import sampling_defaults
from pagoda.lora import LoRARequest
from pagoda.outputs import (
    DecodedTokens,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    context,
    request_output,
)
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams, truncated_prompt

logger = logging.getLogger(__name__)

# a text, its token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[int] | dict


class Progress:
    """A bar counting output tokens (with their rate) and finished sequences; at the end one line
    with the run's input and output token throughput."""

    def __init__(self, num_prompts: int, num_input_tokens: int, num_sequences: int, enabled: bool) -> None:
        self.num_prompts, self.num_input_tokens, self.num_sequences = num_prompts, num_input_tokens, num_sequences
        self.enabled = enabled
        self.output_tokens = self.finished = 0
        self.start = time.perf_counter()
        self.bar = tqdm(desc="Generating", unit="tok", disable=not enabled, dynamic_ncols=True)

    def update(self, seq: SequenceOutput) -> None:
        self.output_tokens += len(seq.token_ids_delta)
        self.bar.update(len(seq.token_ids_delta))
        if seq.finished:
            self.finished += 1
            self.bar.set_postfix_str(f"{self.finished}/{self.num_sequences} sequences done", refresh=False)

    def close(self) -> None:
        self.bar.close()
        if self.enabled:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            print(
                f"Processed {self.num_prompts} prompt{'' if self.num_prompts == 1 else 's'} in {elapsed:.1f} s: "
                f"{self.num_input_tokens / elapsed:.1f} input tok/s, {self.output_tokens / elapsed:.1f} output tok/s",
                file=sys.stderr,
            )


def show_load_progress() -> None:
    """Pagoda's INFO lines (each loading step among them) on stderr, as vLLM's LLM prints its own:
    only where the program has set up no logging (no handler on "pagoda" or the root logger), and
    not with PAGODA_CONFIGURE_LOGGING=0."""
    pagoda_logger = logging.getLogger("pagoda")
    if os.environ.get("PAGODA_CONFIGURE_LOGGING", "1") == "0" or pagoda_logger.handlers or logging.root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    pagoda_logger.addHandler(handler)
    pagoda_logger.setLevel(logging.INFO)


def _no_text(token_id: int, before: Sequence[int]) -> None:
    """A logprob's decoded token under detokenize=False: none, as vLLM gives."""
    return None


def _unwrapped(prompt: Prompt) -> str | list[int]:
    """A prompt's text or token ids, out of vLLM's prompt dicts where it comes in one."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise TypeError(f'a prompt dict holds "prompt" (a string) or "prompt_token_ids", got {prompt!r:.80}')


def _cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's): its prefix cache namespace; an empty one is none, as
    vLLM's offline API takes it."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"a prompt's cache_salt is a string, got {salt!r:.80}")
    return salt or None


# vLLM's LLM arguments that scripts pass as boilerplate and that change nothing here, with the
# values that mean nothing else in Pagoda (any other is refused, naming the argument)
VLLM_NO_OPS = {
    "trust_remote_code": (False, True),  # Pagoda runs no code from model folders either way
    "tensor_parallel_size": (1,),  # one device (as `pagoda serve --tensor-parallel-size`)
    "disable_log_stats": (False, True),  # the offline engine logs no stats
    "enable_chunked_prefill": (None, True),  # prompts are always chunked
    "tokenizer_mode": ("auto",),
    "revision": (None,),  # no hub: a model is a local folder or file
    "swap_space": None,  # any: Pagoda preempts by recomputing, it swaps nothing to CPU memory
    "max_loras": None,  # any: a step mixes any number of LoRA adapters
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),  # offline, one engine; the server scales out (--data-parallel-size)
    "distributed_executor_backend": (None, "mp", "uni"),  # one process drives the one device
    "disable_custom_all_reduce": None,  # any: no all-reduce on one device
    "download_dir": (None,),
    "tokenizer_revision": (None,),
    "hf_token": (None, False),
    "hf_overrides": (None, {}),
    "cpu_offload_gb": (0,),
    "skip_tokenizer_init": (False,),
    "limit_mm_per_prompt": (None, {}),
    "convert": ("auto", "none"),
    "model_impl": ("auto",),
    "logprobs_mode": ("raw_logprobs",),  # the model's own, before any sampling parameter
    "async_scheduling": (None, False),
    "enable_sleep_mode": (False,),
    "compilation_config": None,  # any: CUDA graphs are on unless enforce_eager, with no torch.compile
    "structured_outputs_config": None,  # any: structured outputs always use xgrammar
}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        chat_template: str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        kv_cache_memory_bytes: int | None = None,
        **engine_args,
    ) -> None:
        """`engine_args`: the other fields of EngineArgs; one it lacks is a TypeError that names it,
        but for vLLM's boilerplate arguments that change nothing here (VLLM_NO_OPS). vLLM's own:
        `chat_template` (a file or the template) renders `chat` where a call gives none;
        `generation_config` ("auto": the model's, "vllm": none, or a folder) and
        `override_generation_config` the sampling defaults, as the server's flags;
        `max_logprobs` a cap (at most 20) on a request's logprobs; `kv_cache_memory_bytes` the KV pool
        in bytes (kv_cache_memory's, in GiB)."""
        from pagoda.entrypoints.openai.serve import read_chat_template, read_generation_config

        for name in set(engine_args) & set(VLLM_NO_OPS):
            value, accepted = engine_args.pop(name), VLLM_NO_OPS[name]
            if accepted is not None and value not in accepted:
                raise ValueError(
                    f"{name}={value!r} is not supported by Pagoda (it takes {' or '.join(map(repr, accepted))})"
                )
        if not (isinstance(max_logprobs, int) and 0 <= max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {max_logprobs!r}")
        if kv_cache_memory_bytes is not None:
            engine_args["kv_cache_memory"] = kv_cache_memory_bytes / 2**30
        self.chat_template = read_chat_template(chat_template, "chat_template=")
        self._generation_defaults = read_generation_config(generation_config, "generation_config=")
        self._generation_overrides = sampling_defaults(override_generation_config or {})  # as the server's
        self.max_logprobs = max_logprobs
        show_load_progress()
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._decoded_tokens = DecodedTokens(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (none for an empty list, as vLLM); without
        `sampling_params`, the model's defaults (get_default_sampling_params). `use_tqdm`: a progress
        bar and a throughput line on stderr. `lora_request` (vLLM's, with enable_lora): the adapter
        every prompt runs, or one per prompt; `priority` (vLLM's): one for all or one per prompt,
        lower first under scheduling_policy="priority"; `tokenization_kwargs` (vLLM's): see
        `_prompt_ids`."""
        if not isinstance(prompts, (str, dict, Sequence)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {prompts!r:.80}")
        if not prompts and not isinstance(prompts, str):  # "": the engine refuses an empty prompt by name
            return []
        if sampling_params is not None and not isinstance(sampling_params, (SamplingParams, Sequence)):
            raise TypeError(f"sampling_params must be a SamplingParams or one per prompt, got {sampling_params!r:.80}")
        single = isinstance(prompts, (str, dict)) or isinstance(prompts[0], int)
        given = [prompts] if single else prompts
        prompt_list, salts = [_unwrapped(p) for p in given], [_cache_salt(p) for p in given]
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"give one SamplingParams, or one per prompt: {len(prompt_list)} prompt(s), {len(params_list)} given"
            )
        if not all(isinstance(sp, SamplingParams) for sp in params_list):
            raise TypeError(f"sampling_params must hold SamplingParams only, got {params_list!r:.120}")
        for sp in params_list:  # a value of the wrong type, set since, the engine refuses by name as it copies them
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(sp, name)
                if isinstance(asked, int) and asked > self.max_logprobs:
                    raise ValueError(f"{name}={asked} is above this LLM's max_logprobs ({self.max_logprobs})")
        loras = _per_prompt(lora_request, len(prompt_list))
        one = priority is None or isinstance(priority, int)  # else one per prompt (a list, an array)
        priorities = [priority or 0] * len(prompt_list) if one else [operator.index(p) for p in priority]
        if len(priorities) != len(prompt_list):
            raise ValueError(f"give one priority per prompt: {len(prompt_list)} prompt(s), {len(priorities)} given")
        prompt_ids = [self._prompt_ids(p, tokenization_kwargs or {}) for p in prompt_list]
        ids: list[str] = []
        try:
            for prompt, sp, salt, lora, rank in zip(prompt_ids, params_list, salts, loras, priorities):
                ids.append(self.engine.add_request(prompt, sp, cache_salt=salt, lora_request=lora, priority=rank))
            progress = Progress(len(ids), sum(map(len, prompt_ids)), sum(sp.n for sp in params_list), use_tqdm)
            done = self._run(ids, progress)
        except BaseException:  # a refused prompt or a Ctrl-C: this call's requests leave the engine
            self.engine.abort(ids)
            raise
        return [
            request_output(
                rid,
                prompt if isinstance(prompt, str) else None,
                ids_,
                [done[rid][k] for k in sorted(done[rid])],
                (sp.logprobs is not None, sp.prompt_logprobs is not None),
                self._decoded_tokens if sp.detokenize else _no_text,
                lora,
            )
            for rid, prompt, ids_, sp, lora in zip(ids, prompt_list, prompt_ids, params_list, loras)
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
        lora_request: None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: one vector per prompt, in order, from an engine of the pooling runner
        (runner="pooling", or a bare decoder's checkpoint); `pooling_params` one for all or one
        per prompt (`dimensions`, `use_activation`); the rest as `generate`'s, but that a prompt
        cut by `truncate_prompt_tokens` keeps its first tokens unless `truncation_side="left"`
        (vLLM's pooling runner's), and -1 keeps the whole context. No LoRA adapters."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported with the pooling runner")
        if not isinstance(prompts, (str, dict, Sequence)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {prompts!r:.80}")
        if not prompts and not isinstance(prompts, str):
            return []
        single = isinstance(prompts, (str, dict)) or isinstance(prompts[0], int)
        given = [prompts] if single else prompts
        prompt_list, salts = [_unwrapped(p) for p in given], [_cache_salt(p) for p in given]
        params = PoolingParams() if pooling_params is None else pooling_params
        params_list = [params] * len(prompt_list) if isinstance(params, PoolingParams) else list(params)
        if len(params_list) != len(prompt_list) or not all(isinstance(p, PoolingParams) for p in params_list):
            raise ValueError(f"give one PoolingParams, or one per prompt: {len(prompt_list)} prompt(s)")
        one = priority is None or isinstance(priority, int)
        priorities = [priority or 0] * len(prompt_list) if one else [operator.index(p) for p in priority]
        kwargs = {"truncation_side": "right", **(tokenization_kwargs or {})}
        if kwargs.get("truncate_prompt_tokens") == -1:  # an embedding needs no room for output
            kwargs["truncate_prompt_tokens"] = self.engine.config.model.max_model_len
        prompt_ids = [self._prompt_ids(p, kwargs) for p in prompt_list]
        ids: list[str] = []
        try:
            for prompt, pp, salt, rank in zip(prompt_ids, params_list, salts, priorities):
                ids.append(self.engine.add_request(prompt, pp, cache_salt=salt, priority=rank))
            progress = Progress(len(ids), sum(map(len, prompt_ids)), len(ids), use_tqdm)
            done = self._run(ids, progress)
        except BaseException:
            self.engine.abort(ids)
            raise
        return [
            EmbeddingRequestOutput(
                rid, EmbeddingOutput(done[rid][0].embedding), ids_, done[rid][0].metrics.num_cached_tokens
            )
            for rid, ids_ in zip(ids, prompt_ids)
        ]

    def beam_search(
        self,
        prompts: Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's best params.beam_width sequences by beam search (pagoda/beam_search.py),
        each holding the prompt's tokens and its own (a finished beam's end-of-sequence token too, as
        vLLM's offline beams keep it), `text` their text. `concurrency_limit`: the
        prompts searched at once (all where None); `use_tqdm` is accepted and shows nothing."""
        if isinstance(prompts, (str, dict)) or not prompts or isinstance(prompts[0], int):
            raise TypeError("prompts must be a non-empty list of prompts (strings, token id lists or prompt dicts)")
        if 2 * params.beam_width > self.max_logprobs:  # each step asks 2 x beam_width tokens' logprobs
            raise ValueError(
                f"beam_width {params.beam_width} needs the logprobs of {2 * params.beam_width} tokens a step, above "
                f"this LLM's max_logprobs ({self.max_logprobs}): raise max_logprobs or narrow the beam"
            )
        prompt_ids = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in map(_unwrapped, prompts)]
        loras = _per_prompt(lora_request, len(prompt_ids))
        eos = frozenset(self.engine.config.model.eos_token_ids)
        kept = dataclasses.replace(params, include_stop_str_in_output=True)  # vLLM's offline beams keep their end token
        searches = [BeamSearch(ids, kept, eos, self.engine.config.model.max_model_len) for ids in prompt_ids]
        step = params.step_params()
        limit = concurrency_limit or len(searches)
        lora_of = {id(search): lora for search, lora in zip(searches, loras)}
        for start in range(0, len(searches), limit):
            while beams := step_beams(searches[start : start + limit]):
                loras_now = [lora_of[id(search)] for search, _ in beams]
                outs = self.generate([beam.tokens for _, beam in beams], step, False, loras_now)
                advance(beams, [_candidates(out) for out in outs])
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
                new = search.new_tokens(beam)  # a step's candidates' context: the beam's tokens before it
                beam.logprobs = [self._ranked(c, context(new, j)) for j, c in enumerate(beam.logprobs)]
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _prompt_ids(self, prompt: str | list[int], tokenization_kwargs: dict) -> list[int]:
        """A prompt's tokens per vLLM's tokenization_kwargs: `add_special_tokens` (a text's), and
        truncation to `truncate_prompt_tokens` tokens (-1: the context less one), or to `max_length`
        with `truncation=True`, keeping the last unless `truncation_side="right"`, as the server's
        truncate_prompt_tokens; any other key is warned of and ignored, as vLLM's are."""
        kwargs = dict(tokenization_kwargs)
        add_special = kwargs.pop("add_special_tokens", True)
        keep = kwargs.pop("truncate_prompt_tokens", None)
        max_length = kwargs.pop("max_length", None)
        if kwargs.pop("truncation", False) in (True, "longest_first"):
            keep = self.engine.config.model.max_model_len if max_length is None else max_length
        side = kwargs.pop("truncation_side", None)
        if kwargs:
            logger.warning("tokenization_kwargs %s are not supported and are ignored", sorted(kwargs))
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special) if isinstance(prompt, str) else list(prompt)
        return truncated_prompt(ids, keep, side, self.engine.config.model.max_model_len)  # the server's rule

    def _ranked(self, candidates: dict[int, float], before: list[int]) -> dict[int, Logprob]:
        """A beam step's candidates as vLLM's answers hold them."""
        ranks = candidate_ranks(candidates)
        return {t: Logprob(value, ranks[t], self._decoded_tokens(t, before)) for t, value in candidates.items()}

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name for `tokenizer`)."""
        return self.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine, as older scripts reach the tokenizer and model config through
        it (`llm.llm_engine.get_tokenizer()`, `llm.llm_engine.model_config.max_model_len`)."""
        return self.engine

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: drop every cached prefix (between calls nothing holds one, so it succeeds). Its
        arguments change nothing here: no request runs between calls, and there is no KV connector."""
        return self.engine.core.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling values the model's generation_config.json sets (generation_config.
        SAMPLING_KEYS; or per `generation_config`), `override_generation_config`'s over them, over
        SamplingParams' own defaults; what `generate` and `chat` use when given none."""
        model_defaults = self.engine.config.model.generation_defaults
        chosen = model_defaults if self._generation_defaults is None else self._generation_defaults
        return SamplingParams(**{**chosen, **self._generation_overrides})

    def _run(self, request_ids: list[str], progress: Progress) -> dict[str, dict[int, SequenceOutput]]:
        """Steps the engine until every request has finished; their final updates by request and index."""
        done: dict[str, dict[int, SequenceOutput]] = {i: {} for i in request_ids}
        try:
            while self.engine.has_unfinished:
                for update in self.engine.step():
                    progress.update(update)
                    if update.finished:
                        done[update.request_id][update.index] = update
        finally:
            progress.close()
        return done

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, in OpenAI's message shapes (content parts, tool calls
        and results), rendered as the server renders a chat request, `tools` included; vLLM's
        arguments, in its order: `chat_template` over the LLM's own, `continue_final_message` with
        `add_generation_prompt=False` continues the last message; `chat_template_kwargs` are
        template variables, e.g. enable_thinking; `chat_template_content_format` as the server's
        flag; `tokenization_kwargs` as `generate`'s. A message or tool the server would refuse is a
        ValueError naming its place."""
        from pagoda.entrypoints.openai.chat import parse_messages, render_checked
        from pagoda.entrypoints.openai.errors import APIError
        from pagoda.entrypoints.openai.tool_calls import check_tools
        from pagoda.model_files import CONTENT_FORMATS

        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                f"got {chat_template_content_format!r}"
            )

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(messages, list) or not all(
            isinstance(c, list) and all(isinstance(m, dict) for m in c) for c in conversations
        ):
            raise TypeError(f"messages must be a list of message dicts or a list of such lists, got {messages!r:.100}")
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt=False to continue the last message)"
            )
        template_kwargs = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        try:
            checked = check_tools(tools) or None
            prompts = [
                render_checked(
                    self.tokenizer,
                    parse_messages(c),
                    chat_template or self.chat_template,
                    checked,
                    template_kwargs,
                    chat_template_content_format,
                )
                for c in conversations
            ]
        except APIError as exc:  # the server's 400: the same words, naming the same place
            raise ValueError(exc.message) from None
        results = self.generate(prompts, sampling_params, use_tqdm, lora_request, priority, tokenization_kwargs)
        # as vLLM's: .prompt is the rendered conversation
        return [replace(r, prompt=self.tokenizer.decode(r.prompt_token_ids)) for r in results]


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, prompts: int) -> list:
    """The adapter of each prompt: one for all, or one each."""
    loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * prompts
    if len(loras) != prompts:
        raise ValueError(f"give one lora_request, or one per prompt: {prompts} prompt(s), {len(loras)} given")
    return loras


def _candidates(out: RequestOutput) -> dict[int, float]:
    """A beam's next tokens and their logprobs, from its one-token request."""
    position = out.outputs[0].logprobs[0]  # type: ignore[index]: the step asks for logprobs
    return {token: logprob.logprob for token, logprob in position.items()}
