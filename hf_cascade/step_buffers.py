"""Device buffers that a compiled decode step reads in place, kept per model between ``generate()`` calls.

A CUDA graph replays with the addresses it recorded. The fixed suffix buffers and the prefix KV of a
:class:`~hf_cascade.CascadeCache` are marked as static addresses (read in place, never copied per replay), so a
cache with new tensors makes generate()'s compiled step record its graphs again, once per call. transformers keeps
its own static cache on the model across calls for the same reason. ``hf_cascade.generate`` takes a call's buffers
from the model's :class:`StepBuffers` and gives them back when the call ends; the next call with the same shapes
(a batch of the same size, prefix lengths and capacity bucket) gets the same addresses and replays the recorded
graphs. Only the latest call's set is kept (memory does not grow with the number of layouts seen), and a buffer is
out of the pool while a call holds it, so two concurrent calls never share one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from hf_cascade.engine import engine_of

__all__ = ["StepBuffers", "step_buffers", "take_or_new"]

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


class StepBuffers:
    """A set of reusable device tensors, keyed by (shape, dtype, device)."""

    def __init__(self):
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: Iterable[int], dtype: torch.dtype, device: torch.device | str,
             zeroed: bool = False) -> torch.Tensor:
        """A tensor of this spec: one kept from an earlier call (its old contents left in place, or cleared when
        ``zeroed``) or new zeros."""
        key = (tuple(int(s) for s in shape), dtype, torch.device(device))
        with self._lock:
            free = self._free.get(key)
            kept = free.pop(0) if free else None  # in the order kept: the same role gets the same tensor
        if kept is None:
            return torch.zeros(key[0], dtype=dtype, device=key[2])
        return kept.zero_() if zeroed else kept

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep these tensors (a finished call's) for the next call, in place of what was kept before. List them
        in the order the call took them: a call that takes tensors of one spec in the same order gets each at the
        address it had (and replays the graphs that read it)."""
        free: dict[_Key, list[torch.Tensor]] = {}
        seen = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                free.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
        with self._lock:
            self._free = free

    @property
    def nbytes(self) -> int:
        """Bytes held between calls."""
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def step_buffers(model: torch.nn.Module) -> StepBuffers:
    """The :class:`StepBuffers` of ``model`` (its :class:`~hf_cascade.engine.Engine`'s ``step_buffers``)."""
    return engine_of(model).part("step_buffers", StepBuffers)


def take_or_new(buffers: StepBuffers | None, shape: Iterable[int], dtype: torch.dtype,
                device: torch.device | str, zeroed: bool = False) -> torch.Tensor:
    """A tensor of this spec from ``buffers`` (see :meth:`StepBuffers.take`) or, when ``buffers`` is None, new
    zeros."""
    if buffers is None:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return buffers.take(shape, dtype, device, zeroed)
