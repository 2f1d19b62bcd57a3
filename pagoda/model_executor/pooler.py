"""Embedding requests' vectors from the final hidden states of their prompts (the model runner's),
across however many steps a prompt is chunked over."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagoda.request import Request


class Pooler:
    """Owns the partial vectors of MEAN and CLS pooling between a prompt's chunks (on the host,
    float32), keyed by request id, until the request finishes (`drop`). A MEAN sum is taken row
    after row in the prompt's order (numpy's accumulate adds in sequence), so a vector is the same
    bits however its prompt was chunked."""

    def __init__(self) -> None:
        self._partial: dict[str, np.ndarray] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    def add(self, request: Request, rows: torch.Tensor, start: int, ends: bool) -> list[float] | None:
        """`rows`: the final hidden states of the request's prompt tokens start.. computed this step
        (LAST pooling: the last one only, and only in the step its prompt ends); `ends`: the prompt
        ends this step. Returns the request's vector then, else None."""
        pooling = request.pooling
        assert pooling is not None, "a request without pooling reached the pooler"
        if pooling.pooling_type == "LAST":
            return _finished(rows[-1], pooling.dimensions, pooling.normalize) if ends else None
        if start == 0:  # the prompt's first chunk (again, after a preemption)
            self._partial.pop(request.request_id, None)
        if pooling.pooling_type == "CLS":
            if start == 0:  # a copy: `rows` is a view of the step's hidden states
                self._partial[request.request_id] = rows[0].float().cpu().numpy().copy()
        else:  # MEAN
            rows = rows.float().cpu().numpy()
            total = self._partial.get(request.request_id)
            terms = rows if total is None else np.concatenate([total[None], rows])
            self._partial[request.request_id] = np.add.accumulate(terms, axis=0, dtype=np.float32)[-1]
        if not ends:
            return None
        vector = torch.from_numpy(self._partial.pop(request.request_id))
        if pooling.pooling_type == "MEAN":
            vector = vector / request.num_prompt_tokens
        return _finished(vector, pooling.dimensions, pooling.normalize)


def _finished(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (a Matryoshka model's shorter vector), then scaled to unit
    length where asked, as vLLM does (in float32; a zero vector stays zero)."""
    vector = vector.float()[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector.tolist()
