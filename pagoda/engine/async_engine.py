"""The engine for the server: the EngineCore steps on a thread of its own; the asyncio side
tokenizes, detokenizes and streams, so none of that ever delays a model step.

The engine thread also builds the core (loads the model): every torch op and kernel then runs on
that one thread, so the process has one compute pool (model_executor/cpu_threads.py says why a
second pool, left by loading on the main thread, makes every step slower).

Commands (add, abort, finish, reset the prefix cache) cross to the engine thread through a locked
inbox; step results and counters cross back with `loop.call_soon_threadsafe`. The thread owns all
scheduler and KV state: the event loop reads only what the thread publishes (`stats`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagoda.core.outputs import CoreOutput
from pagoda.engine.args import EngineArgs
from pagoda.engine.base import EngineBase
from pagoda.engine.core import EngineCore
from pagoda.engine.outputs import SequenceOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter

logger = logging.getLogger(__name__)

# How long a thread holding the GIL runs before a waiting one may take it (Python's default: 5 ms).
# The engine thread gives the GIL up for every kernel and needs it back between them, often while
# the event loop runs Python (HTTP, detokenizing, streaming): at the default it could wait up to
# 5 ms each time. At 0.5 ms, a served decode at concurrency 1 took 32.5-34.3 ms a token instead of
# 38.9-40.6 (offline step: 26.9 ms), concurrency 32 gave 94.5 tok/s instead of 91.3 (vLLM's client,
# random 256 in / 64 out, 2-core Intel AMX machine); 0.1 ms was no better.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine(EngineBase):
    def __init__(self, args: EngineArgs, on_finished: Callable[[SequenceOutput], None] | None = None) -> None:
        self._started = threading.Event()  # set by start() (the loop is known) or shutdown()
        self._thread: threading.Thread | None = None
        super().__init__(args)
        self.stats = self.core.stats()  # the engine thread's latest counters, published after each change
        self._on_finished = on_finished
        self._queues: dict[str, asyncio.Queue] = {}
        self._engine_ids: dict[str, list[str]] = {}
        self._resets: deque[asyncio.Future[bool]] = deque()  # prefix-cache resets the engine thread has yet to answer
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def _make_core(self) -> EngineCore:
        """Starts the engine thread, which builds the core and then waits for start()."""
        built: Future[EngineCore] = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="pagoda-engine", daemon=True)
        self._thread.start()
        return built.result()  # a load failure is raised here, and the thread has ended

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # for the process: its event loop is this engine's
        self._started.set()

    def shutdown(self) -> None:
        self._stop = True
        self._started.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._compile_thread.shutdown(wait=False, cancel_futures=True)
        self.close()
        self._fail_resets(EngineDeadError("the engine was shut down"))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
        priority: int = 0,
    ) -> AsyncIterator[SequenceOutput]:
        """Updates of all n sequences of one request until each has finished (PoolingParams: an
        embedding, the pooling runner's: one update, its vector, without adapters). Closing the
        iterator early (a client went away) aborts whatever is still running. `cache_salt`: the
        request's prefix cache namespace (only requests with the same salt share cached KV);
        `lora`: the adapter it runs (`adapter()` reads one); `priority`: lower first under the
        priority policy."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        constraint = params.structured_outputs if isinstance(params, SamplingParams) else None
        grammar = None if constraint is None else await self.compile_grammar_async(constraint)
        if not self.is_alive:  # it may have died while the grammar compiled
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        if request_id in self._queues:  # checked and registered with no await between
            raise ValueError(f"request id {request_id!r} is already in flight")
        if isinstance(params, PoolingParams):
            if lora is not None:
                raise ValueError("LoRA adapters are not supported with the pooling runner")
            requests = self._embedding_requests(request_id, prompt_ids, params, cache_salt, priority)
        else:
            requests = self._new_requests(request_id, prompt_ids, params, grammar, cache_salt, lora, priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._engine_ids[request_id] = [r.request_id for r in requests]
        self.outputs.add(request_id, requests)
        self._send("add", (request_id, requests))
        remaining = len(requests)
        try:
            while remaining:
                update = await queue.get()
                if isinstance(update, BaseException):
                    raise update
                remaining -= update.finished
                yield update
        finally:
            if remaining:
                self._send("abort", self._engine_ids[request_id])
                for engine_id in self._engine_ids[request_id]:
                    self.outputs.drop(engine_id)
            self._queues.pop(request_id, None)
            self._engine_ids.pop(request_id, None)

    async def compile_grammar_async(self, constraint: StructuredOutputsParams) -> Any:
        """`compile_grammar` without blocking the event loop: a cached grammar at once, else a
        compile on the engine's own compile thread (compiles queue there one at a time, holding
        none of the threads that other requests' work runs on)."""
        if self._grammars is not None:  # the first call makes the compiler (xgrammar's import): not on the loop
            cached = self._grammars.cached(constraint)
            if cached is not None:
                return cached
        return await asyncio.get_running_loop().run_in_executor(self._compile_thread, self.compile_grammar, constraint)

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache, on the engine thread after the commands sent before; refused
        (False) while any request is unfinished."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        answer = asyncio.get_running_loop().create_future()
        self._resets.append(answer)
        self._send("reset", None)
        return await answer

    def _keep_in_core(self, adapter_uids: frozenset[str]) -> None:
        self._send("keep_adapters", adapter_uids)  # on the engine thread, between steps

    # ---- engine thread -------------------------------------------------------------------
    def _send(self, kind: str, payload) -> None:
        with self._lock:
            self._inbox.append((kind, payload))
        self._wake.set()

    def _run(self, built: Future[EngineCore]) -> None:
        try:
            core = EngineCore(self.config)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            built.set_exception(exc)
            return
        built.set_result(core)
        self._started.wait()
        try:
            while not self._stop:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    self._wake.clear()
                    rejected = self._apply(inbox)
                if rejected:
                    self._loop.call_soon_threadsafe(self._reject, rejected)
                if inbox:  # an abort frees blocks without a step: the stats must say so at once
                    self.stats = self.core.stats()
                if not self.core.has_unfinished:
                    self._wake.wait(timeout=1.0)
                    continue
                step = self.core.step()
                self.stats = step.stats
                self._loop.call_soon_threadsafe(self._dispatch, step.outputs)
        except BaseException as exc:  # noqa: BLE001 - a bug must not leave clients hanging
            logger.exception("engine loop died")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _apply(self, inbox: list[tuple[str, object]]) -> list[tuple[str, Exception]]:
        rejected = []
        for kind, payload in inbox:
            if kind == "add":
                request_id, requests = payload
                try:
                    for request in requests:
                        self.core.add_request(request)
                except Exception as exc:  # noqa: BLE001 - queue full or too long: the caller is told
                    self.core.finish_requests([r.request_id for r in requests], "abort")
                    rejected.append((request_id, exc))
            elif kind == "abort":
                self.core.finish_requests(payload, "abort")
            elif kind == "finish":
                engine_id, stop_string = payload
                self.core.finish_requests([engine_id], "stop", stop_string)
            elif kind == "keep_adapters":
                self.core.keep_adapters(payload)
            elif kind == "reset":
                done = self.core.reset_prefix_cache()
                self.stats = self.core.stats()  # before the answer: a client may read /metrics next
                self._loop.call_soon_threadsafe(self._answer_reset, done)
        return rejected

    # ---- event loop side -----------------------------------------------------------------
    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        updates, stopped = self.outputs.process(outputs)
        for engine_id, stop_string in stopped:
            self._send("finish", (engine_id, stop_string))
        for update in updates:
            queue = self._queues.get(update.request_id)
            if queue is not None:
                queue.put_nowait(update)
            if update.finished and self._on_finished is not None:
                self._on_finished(update)

    def _reject(self, rejected: list[tuple[str, Exception]]) -> None:
        for request_id, exc in rejected:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)

    def _answer_reset(self, done: bool) -> None:
        answer = self._resets.popleft()
        if not answer.done():  # its caller may have gone away
            answer.set_result(done)

    def fail_in_flight(self, reason: str) -> int:
        """Ends every request in flight with EngineDeadError(reason): its iterator raises it (and
        aborts its sequences, freeing their blocks), so its caller answers with the error. On the
        event loop; how many requests."""
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        return len(self._queues)

    def _fail_all(self, exc: BaseException) -> None:
        self.fail_in_flight(f"the engine stopped: {exc!r}")
        self._fail_resets(EngineDeadError(f"the engine stopped: {exc!r}"))

    def _fail_resets(self, error: EngineDeadError) -> None:
        while self._resets:
            answer = self._resets.popleft()
            if not answer.done():
                answer.set_exception(error)
