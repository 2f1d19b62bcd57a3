"""The engine for the server: the EngineCore steps on a thread of its own; the asyncio side
tokenizes, detokenizes and streams, so none of that ever delays a model step.

Commands (add, abort, finish) cross to the engine thread through a locked inbox; step results
cross back with `loop.call_soon_threadsafe`. The thread owns all scheduler and KV state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagoda.engine.args import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, make_requests
from pagoda.engine.outputs import CoreOutput, SequenceOutput
from pagoda.model_files import load_tokenizer
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_blocks: int = 0
    num_steps: int = 0


class AsyncEngine:
    def __init__(self, args: EngineArgs, on_finished: Callable[[SequenceOutput], None] | None = None) -> None:
        self.config = args.create_config()
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.core = EngineCore(self.config)
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._on_finished = on_finished
        self._queues: dict[str, asyncio.Queue] = {}
        self._engine_ids: dict[str, list[str]] = {}
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SequenceOutput]:
        """Updates of all n sequences of one request until each has finished. Closing the
        iterator early (a client went away) aborts whatever is still running."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        m = self.config.model
        requests = make_requests(request_id, prompt_ids, params, m.eos_token_ids, m.max_model_len)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._engine_ids[request_id] = [r.request_id for r in requests]
        self.outputs.add(request_id, requests)
        self._send("add", (request_id, requests))
        remaining = params.n
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

    def reset_prefix_cache(self) -> bool:
        """Only while nothing runs (the engine thread is then idle waiting for work)."""
        with self._lock:
            if self.core.has_unfinished or self._inbox or not self.core.kv.reset_prefix_cache():
                return False
            self._publish_stats(self.stats.num_steps)
            return True

    # ---- engine thread -------------------------------------------------------------------
    def _send(self, kind: str, payload) -> None:
        with self._lock:
            self._inbox.append((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    self._wake.clear()
                    rejected = self._apply(inbox)
                if rejected:
                    self._loop.call_soon_threadsafe(self._reject, rejected)
                if inbox:  # an abort frees blocks without a step: the stats must say so at once
                    self._publish_stats(self.stats.num_steps)
                if not self.core.has_unfinished:
                    self._wake.wait(timeout=1.0)
                    continue
                outputs = self.core.step()
                self._publish_stats(self.stats.num_steps + 1)
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
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
                    self.core.abort([r.request_id for r in requests])
                    rejected.append((request_id, exc))
            elif kind == "abort":
                self.core.abort(payload)
            elif kind == "finish":
                self.core.finish(*payload)
        return rejected

    def _publish_stats(self, num_steps: int) -> None:
        kv, scheduler = self.core.kv, self.core.scheduler
        self.stats = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_usage=kv.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            prefix_cache_blocks=kv.cache.num_cached_blocks if kv.cache else 0,
            num_steps=num_steps,
        )

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

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"the engine stopped: {exc!r}"))
