"""One HTTP request's engine requests (one per prompt) merged into one stream of
(prompt index, update), with cancellation that always reaches the engine.

Each prompt's `engine.generate` is driven by a pump task of its own. Closing the Generation
cancels the pumps; a cancelled pump closes its engine iterator, which aborts the request, so its
KV blocks are freed at the engine's next step. `close` is synchronous on purpose: it runs in
`finally` blocks of cancelled tasks, where an await would itself be cancelled.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from pagoda.core.scheduler import QueueFullError
from pagoda.engine.async_engine import AsyncEngine, EngineDeadError
from pagoda.engine.outputs import SequenceOutput
from pagoda.entrypoints.openai.errors import APIError, bad_request, queue_full

if TYPE_CHECKING:
    from pagoda.lora import LoRAAdapter
from pagoda.pooling_params import PoolingParams, sequences_of
from pagoda.sampling_params import SamplingParams


class Observer(Protocol):
    def on_update(self, prompt: int, update: SequenceOutput) -> None: ...

    def on_prompt_done(self, prompt: int, latest: dict[int, SequenceOutput], aborted: bool) -> None: ...


def engine_error(exc: Exception) -> APIError:
    """What a refused or failed engine request means to the client."""
    if isinstance(exc, QueueFullError):
        return queue_full(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), getattr(exc, "param", None))  # a SamplingParamsError names its field
    return APIError(500, f"Internal server error: {type(exc).__name__}")


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        engine_ids: list[str],
        prompts: list[list[int]],
        params: SamplingParams | PoolingParams,
        cache_salt: str | None,
        lora: LoRAAdapter | None,
        observer: Observer,
        priority: int = 0,
    ) -> None:
        self.engine = engine
        self.engine_ids = engine_ids
        self.prompts = prompts
        self.params = params
        self.cache_salt = cache_salt
        self.lora = lora
        self.priority = priority
        self.observer = observer
        self._queue: asyncio.Queue[tuple[int, SequenceOutput | Exception]] = asyncio.Queue()
        self._buffer: deque[tuple[int, SequenceOutput]] = deque()
        self._remaining = len(prompts) * sequences_of(params)  # sequences not yet finished
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def prompt_request_ids(request_id: str, num_prompts: int) -> list[str]:
        """Each prompt's request id, as logs and the request log name it: the HTTP request's id when
        there is one prompt."""
        return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]

    @staticmethod
    def engine_id(prompt_request_id: str) -> str:
        """The engine's name for a prompt's request: its id and 8 random hex digits, unique in the
        engine whatever id a client gave its request (vLLM's rule)."""
        return f"{prompt_request_id}-{secrets.token_hex(4)}"

    async def start(self) -> None:
        """Submit every prompt and wait until each has its first update: a refusal (queue full,
        too long, engine dead) then raises APIError here, before any response has begun."""
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.prompts))]
        started: set[int] = set()
        try:
            while len(started) < len(self.prompts):
                i, item = await self._queue.get()
                if isinstance(item, Exception):
                    raise engine_error(item)
                started.add(i)
                self._buffer.append((i, item))
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        """Every update after `start`, in arrival order, until all sequences finished."""
        while self._remaining:
            i, item = self._buffer.popleft() if self._buffer else await self._queue.get()
            if isinstance(item, Exception):
                raise engine_error(item)
            self._remaining -= item.finished
            yield i, item

    async def collect(self) -> list[list[SequenceOutput]]:
        """The final output of each sequence, by prompt, then by index."""
        final: list[dict[int, SequenceOutput]] = [{} for _ in self.prompts]
        async for i, update in self.updates():
            final[i][update.index] = update
        return [[outs[k] for k in sorted(outs)] for outs in final]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _pump(self, i: int) -> None:
        latest: dict[int, SequenceOutput] = {}
        try:
            updates = self.engine.generate(
                self.engine_ids[i], self.prompts[i], self.params, self.cache_salt, self.lora, self.priority
            )
            async for update in updates:
                latest[update.index] = update
                self.observer.on_update(i, update)
                self._queue.put_nowait((i, update))
        except asyncio.CancelledError:
            self.observer.on_prompt_done(i, latest, aborted=True)
            raise
        except Exception as exc:  # noqa: BLE001 - refused or failed: the consumer raises it
            if latest:  # it had begun (a refusal is answered and logged as one): it ends aborted
                self.observer.on_prompt_done(i, latest, aborted=True)
            self._queue.put_nowait((i, exc))
            return
        self.observer.on_prompt_done(i, latest, aborted=False)
