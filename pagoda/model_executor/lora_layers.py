"""LoRA in the model: each projection an adapter may target wrapped once, at load, and each step's
rows routed to their requests' adapters.

The runner owns a `LoRAModel`: it registers an adapter the first time a request brings it (its
weights packed as the base projections' are) and, around each forward, tells the wrapped
projections which rows run which adapter (`LoRARows`). A projection adds, to those rows of its
output only, each targeted part's x @ A.T @ B.T (pagoda/lora.py: `Update`); rows of requests
without an adapter are the base model's, bit for bit. With the batch-invariant GEMM
(deterministic serving) A and B run on it too, so a row's update, like its base output, is the
same whatever else shares its step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.lora import PROJECTIONS, LoRAAdapter, Update

Linear = Callable[[torch.Tensor], torch.Tensor]
# a part's B as a linear map, the first output row it adds to, and its values of x @ A.T
Up = tuple[Linear, int, slice]


class LoRARows:
    """The rows of the current forward that run each adapter: (adapter uid, row indices, or None
    for every row) pairs, empty between forwards. Written by LoRAModel.rows, read by every
    LoRALinear."""

    def __init__(self) -> None:
        self.groups: list[tuple[str, torch.Tensor | None]] = []


class LoRALinear(nn.Module):
    """A projection and the low-rank updates of the adapters that target it."""

    def __init__(self, base: nn.Module, rows: LoRARows) -> None:
        super().__init__()
        self.base, self.rows = base, rows
        self.updates: dict[str, tuple[Linear, list[Up]]] = {}  # adapter uid -> A, and its parts' B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter_uid, rows in self.rows.groups:
            update = self.updates.get(adapter_uid)
            if update is None:
                continue
            down, ups = update
            values = down(x if rows is None else x.index_select(0, rows))
            for up, first, columns in ups:
                delta = up(values[:, columns].contiguous())
                outputs = y[:, first : first + delta.shape[1]]
                if rows is None:
                    outputs.add_(delta)
                else:
                    outputs.index_add_(0, rows, delta)
        return y


class LoRAModel:
    """The LoRA side of a loaded DecoderModel (its module path: the C decoder stack runs no
    adapters, so the loader builds none when LoRA is on)."""

    def __init__(self, model: nn.Module, make_linear: Callable[[torch.Tensor], Linear]) -> None:
        """`make_linear`: a weight [out, in] as the linear map x @ weight.T, as the model's own run."""
        self._rows = LoRARows()
        self._make_linear = make_linear
        self._projections: dict[str, LoRALinear] = {}
        self._registered: dict[str, LoRAAdapter] = {}  # by uid: each read of an adapter
        for i, layer in enumerate(model.layers):
            for name in dict.fromkeys(ours for ours, _ in PROJECTIONS.values()):
                parent_name, _, attr = name.rpartition(".")
                parent = layer.get_submodule(parent_name)
                if not hasattr(parent, attr):
                    continue  # a mixture of experts' MLP: load_adapter refuses adapters of it
                wrapped = LoRALinear(getattr(parent, attr), self._rows)
                setattr(parent, attr, wrapped)
                self._projections[f"layers.{i}.{name}"] = wrapped

    def register(self, adapter: LoRAAdapter, device: torch.device) -> None:
        """Make the adapter's updates part of the model (once per read of it)."""
        if adapter.uid in self._registered:
            return
        for name, update in adapter.weights.items():
            self._projections[name].updates[adapter.uid] = self._linears(update, device)
        self._registered[adapter.uid] = adapter

    @property
    def registered(self) -> set[str]:
        """The uids of the adapter reads that are part of the model."""
        return set(self._registered)

    def unregister(self, adapter_uid: str) -> None:
        """Drop the adapter's updates (a request still running it registers them again)."""
        for projection in self._projections.values():
            projection.updates.pop(adapter_uid, None)
        self._registered.pop(adapter_uid, None)

    def _linears(self, update: Update, device: torch.device) -> tuple[Linear, list[Up]]:
        ups = [
            (self._make_linear(part.b.to(device)), part.first, slice(part.start, part.start + part.b.shape[1]))
            for part in update.parts
        ]
        return self._make_linear(update.a.to(device)), ups

    @contextmanager
    def rows(self, groups: list[tuple[str, torch.Tensor | None]]) -> Iterator[None]:
        """During the block, the forward's rows `groups` run their adapters."""
        self._rows.groups = groups
        try:
            yield
        finally:
            self._rows.groups = []


def plain_linear(weight: torch.Tensor) -> Linear:
    """x @ weight.T by torch."""
    return lambda x: F.linear(x, weight)
