"""What the offline engine (LLMEngine) and the server's engine (AsyncEngine) share: the validated
config, the tokenizer, the engine core, and the output processor that turns the core's token
updates into text updates."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pagoda.engine.args import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, make_requests
from pagoda.model_executor.device import check_device
from pagoda.model_files import cache_root, load_tokenizer
from pagoda.pooling_params import PoolingParams, matryoshka
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams, check_token_ids

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter, LoRARequest
    from pagoda.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineBase:
    def __init__(self, args: EngineArgs) -> None:
        check_device(args.device)  # before the config: it would pass over an unusable GPU's backend
        logger.info("Reading the model config")
        self.config = args.create_config()
        logger.info("Loading the tokenizer")
        self.tokenizer = load_tokenizer(self.config.model.tokenizer or self.config.model.path)
        self.core = self._make_core()
        self.outputs = OutputProcessor(self.tokenizer)
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._grammars_lock = threading.Lock()  # first constrained requests may race to make it
        # read once per lora_int_id, least recently used first: at most max_cpu_loras of them
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # every read a request (or the model) still refers to, dropped or not
        self._in_use: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        self._adapters_lock = threading.Lock()

    def _make_core(self) -> EngineCore:
        """The engine core, built on the thread that will step it (its compute pool is that thread's)."""
        return EngineCore(self.config)

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (made on first use: it imports xgrammar)."""
        with self._grammars_lock:
            if self._grammars is None:
                from pagoda.structured.compiler import GrammarCompiler

                m = self.config.model
                self._grammars = GrammarCompiler(
                    self.tokenizer, m.vocab_size, m.eos_token_ids, self.config.grammar_compile_timeout, cache_root()
                )
            return self._grammars

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a LoRARequest names, read on its id's first use (LoRAError where it cannot
        be served). Blocks while it is read (not holding the adapters' lock)."""
        from pagoda.lora import LoRAError, ProjectionShapes, load_adapter

        if not self.config.enable_lora:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: this engine runs none (start it with enable_lora)")
        held = self.held_adapter(request)
        if held is not None:
            return held
        m = self.config.model
        shapes = ProjectionShapes.of(m.hf_config, m.expert_layers)
        read = load_adapter(request, shapes, self.config.max_lora_rank, m.dtype)
        with self._adapters_lock:
            adapter = self._adapters.get(request.lora_int_id)  # read meanwhile by another caller: that one
            if adapter is None:
                adapter = self._adapters[request.lora_int_id] = read
                self._in_use[request.lora_int_id] = read
                logger.info("LoRA adapter %r (id %d, rank %d) read", read.name, read.id, read.rank)
                self._bound_held()
            return adapter

    def held_adapter(self, request: LoRARequest) -> LoRAAdapter | None:
        """The read of the request's adapter the engine holds, or None (adapter() reads it): the
        most recently used, or one a request still runs (taken back rather than read again, so
        that past max_cpu_loras an adapter in use keeps one read and one copy in the model)."""
        with self._adapters_lock:
            adapter = self._adapters.get(request.lora_int_id) or self._in_use.get(request.lora_int_id)
            if adapter is None:
                return None
            if (adapter.name, adapter.path) != (request.lora_name, str(request.lora_path)):
                logger.warning(
                    "LoRA adapter id %d is %r from %s: it serves %r (%s) too (forget_adapter reads an id again)",
                    adapter.id, adapter.name, adapter.path, request.lora_name, request.lora_path,
                )  # fmt: skip
            if request.lora_int_id not in self._adapters:
                self._adapters[request.lora_int_id] = adapter
                self._bound_held()
            self._adapters.move_to_end(request.lora_int_id)
            return adapter

    def _bound_held(self) -> None:
        """Past max_cpu_loras, the least recently used leave; the core hears what is held (under the
        adapters' lock: in the order of the changes)."""
        bound = self.config.max_cpu_loras
        while bound is not None and len(self._adapters) > bound:
            _, dropped = self._adapters.popitem(last=False)
            logger.info(
                "LoRA adapter %r (id %d) dropped: the least recently used of more than max_cpu_loras=%d",
                dropped.name, dropped.id, bound,
            )  # fmt: skip
        self._keep_in_core(frozenset(a.uid for a in self._adapters.values()))

    def forget_adapter(self, adapter_id: int) -> None:
        """Drop an adapter read under this id: its weights leave the model (a request still running
        it keeps them until it ends), and the id's next use reads its folder again."""
        with self._adapters_lock:
            self._in_use.pop(adapter_id, None)
            if self._adapters.pop(adapter_id, None) is not None:
                self._keep_in_core(frozenset(a.uid for a in self._adapters.values()))

    def _keep_in_core(self, adapter_uids: frozenset[str]) -> None:
        """Tell the core which adapter reads the engine holds now."""
        self.core.keep_adapters(adapter_uids)

    def compile_grammar(self, constraint: StructuredOutputsParams) -> Any:
        """The compiled grammar of a structured-output constraint (cached); GrammarError if none.
        Blocks up to the compile time limit when it is not cached."""
        return self.grammars.compile(constraint)

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

    def _token_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def _new_requests(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        grammar: Any = None,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """The engine requests of one caller request, one per sequence of n; `grammar`: the
        compiled grammar of its constraint, if it has one (a thinking budget is kept by the same
        state); `cache_salt`: its prefix cache namespace; `lora`: the adapter it runs; `priority`:
        vLLM's (lower first, under the priority policy)."""
        if self.config.pooler is not None:
            raise SamplingParamsError(
                "model",
                "this engine runs the pooling runner: it makes embeddings (LLM.embed, /v1/embeddings), not text",
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise SamplingParamsError("priority", f"priority must be an integer, got {priority!r}")
        # the requests' own copy, checked again: the caller may have changed fields since it made them
        # (as vLLM's, they are mutable), and may change them later without reaching running requests
        params = dataclasses.replace(params)
        m = self.config.model
        check_token_ids(prompt_ids, m.vocab_size, "prompt")
        check_token_ids(params.stop_token_ids, m.vocab_size, "stop_token_ids")
        check_token_ids(params.logit_bias, m.vocab_size, "logit_bias")
        check_token_ids(params.allowed_token_ids or (), m.vocab_size, "allowed_token_ids")
        stoppers = params.stopping_token_ids(m.eos_token_ids)
        if params.allowed_token_ids and params.min_tokens and set(params.allowed_token_ids) <= stoppers:
            raise SamplingParamsError(  # min_tokens would ban every token the request allows
                "allowed_token_ids", "allowed_token_ids holds only stop tokens, which min_tokens bans at first"
            )
        new_grammar = None
        if grammar is not None or params.thinking_budget is not None:
            from pagoda.structured.grammar import RequestGrammar

            span = params.reasoning
            think_start = self._token_ids(span.start) if span is not None and span.start else ()
            think_end = self._token_ids(span.end) if span is not None else ()
            budget = params.thinking_budget
            new_grammar = functools.partial(RequestGrammar, grammar, think_start, think_end, budget)
        bad_words_ids = tuple(ids for word in params.bad_words for ids in self._word_token_ids(word))
        banned_always = {ids[0] for ids in bad_words_ids if len(ids) == 1}  # single-token words: banned at every step
        if params.allowed_token_ids and set(params.allowed_token_ids) <= banned_always:
            raise SamplingParamsError(  # no token left to sample from the first step on
                "allowed_token_ids", "every token allowed_token_ids holds is one of bad_words, which bans it"
            )
        return make_requests(
            request_id,
            prompt_ids,
            params,
            m.eos_token_ids,
            m.max_model_len,
            new_grammar,
            bad_words_ids,
            cache_salt,
            lora,
            priority,
        )

    def _embedding_requests(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: PoolingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """The engine request of one embedding (a list of one, as _new_requests' for n = 1)."""
        if self.config.pooler is None:
            raise SamplingParamsError(
                "model",
                "this engine runs the generate runner: it makes text, not embeddings; start it with --runner pooling "
                "(LLM(..., runner='pooling'))",
            )
        if not isinstance(params, PoolingParams):
            raise TypeError(f"an embedding's parameters are a PoolingParams, got {params!r:.80}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise SamplingParamsError("priority", f"priority must be an integer, got {priority!r}")
        m = self.config.model
        check_token_ids(prompt_ids, m.vocab_size, "prompt")
        pooling = params.resolved(self.config.pooler, m.hf_config.hidden_size, matryoshka(m.hf_config))
        request = Request(
            f"{request_id}#0",
            prompt_ids,
            SamplingParams(),  # unused: it samples nothing, and ends when its prompt is computed
            frozenset(),
            m.max_model_len,
            cache_salt=cache_salt,
            priority=priority,
            pooling=pooling,
        )
        return [request]

    def _word_token_ids(self, word: str) -> list[tuple[int, ...]]:
        """A bad word's token sequences, as vLLM makes them: the word alone (as at the start of the
        text), and with a leading space (as within it) where that is another token of the same count."""
        alone = self._token_ids(word.lstrip())
        spaced = self._token_ids(" " + word.lstrip())
        if not alone:  # a tokenizer that writes nothing for it: nothing to ban
            return []
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            return [alone, spaced]
        return [alone]
