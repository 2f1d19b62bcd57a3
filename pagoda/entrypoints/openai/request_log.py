"""`--request-log PATH`: one JSON line per finished request, appended by a background thread.

The event loop only enqueues a dict; encoding and writing happen on the writer thread, so a slow
or full disk never delays a response. A write error is logged once and later records are
dropped; serving goes on. The file holds users' prompts (the request body and its token ids).
Format (read by `pagoda analyze` and `pagoda bench --workload replay`):
  {"timestamp", "endpoint", "request_id", "body", "prompt_token_ids", "prompt_tokens",
   "cached_tokens", "output_tokens", "output_token_ids", "finish_reason", "ttft_s", "latency_s"}
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_STOP = None


class RequestLogWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="pagoda-request-log", daemon=True)
        self._thread.start()

    def write(self, record: dict) -> None:
        """Never blocks; `record` must not be changed afterwards."""
        self._queue.put(record)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to `timeout_s`) and stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        handle = self._open()
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():  # drain what piled up: one write and flush per batch
                batch.append(self._queue.get())
            records = [r for r in batch if r is not _STOP]
            if records and handle is not None:
                handle = self._write(handle, records)
            if len(records) != len(batch):
                break
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()

    def _open(self):
        try:
            return self.path.open("a", encoding="utf-8")
        except OSError as exc:
            self._fail(exc)
            return None

    def _write(self, handle, records: list[dict]):
        try:
            handle.write("".join(_line(r) for r in records))
            handle.flush()
            return handle
        except OSError as exc:
            self._fail(exc)
            with contextlib.suppress(OSError):
                handle.close()
            return None

    def _fail(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            logger.error("request log %s: %s; no more requests are logged there (serving goes on)", self.path, exc)


def _line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
