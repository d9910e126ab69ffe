"""Arrival counters for launches whose last program merges the states (``_cascade_kernel._arrive_and_merge``).

A launch that merges its own states counts, per state entry, the programs that have written it; the last one
merges and sets the counter back to zero. So the counters are zero before every launch without a memset, as long
as no two launches use the same counters at the same time:

* eager launches take a buffer per (device, stream): launches on one stream run one after another;
* a CUDA graph recorded by hf_cascade (``captured_step``) owns its buffer (:func:`owned_arrival_counters` around
  the capture), so two graphs replayed on two streams never share counters;
* a launch captured into someone else's graph (no owned buffer) gets none, and the caller merges the states
  with a separate combine launch instead.

``HF_CASCADE_MERGE_IN_LAUNCH=0`` (read at each launch) gives none anywhere: the combine launch, for A/B timings.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading

import torch

_BY_STREAM: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()
_OWNED: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("hf_cascade_arrivals", default=None)
MIN_COUNTERS = 1 << 16  # int32 counters per buffer (256 KB): Hkv x B x Lq x G of a decode step, many times over


def arrival_counters(device: torch.device, size: int) -> torch.Tensor | None:
    """Zeroed int32 counters (at least ``size``) for a launch on ``device``'s current stream, or None where no
    buffer may be used (a graph capture that does not own one, or an owned one that is too small)."""
    if os.environ.get("HF_CASCADE_MERGE_IN_LAUNCH") == "0":
        return None
    owned = _OWNED.get()
    if owned is not None and owned.device == device:
        return owned if owned.numel() >= size else None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        key = (device.type, device.index, torch.cuda.current_stream(device).cuda_stream)
    else:
        key = (device.type, device.index, 0)
    with _LOCK:
        counters = _BY_STREAM.get(key)
        if counters is None or counters.numel() < size:
            counters = torch.zeros(max(size, MIN_COUNTERS), dtype=torch.int32, device=device)
            _BY_STREAM[key] = counters
    return counters


@contextlib.contextmanager
def owned_arrival_counters(counters: torch.Tensor):
    """Launches inside (a CUDA-graph capture) use ``counters`` (int32, zeroed, kept alive as long as the graph)."""
    token = _OWNED.set(counters)
    try:
        yield
    finally:
        _OWNED.reset(token)


def new_arrival_counters(device: torch.device) -> torch.Tensor:
    """A zeroed buffer for :func:`owned_arrival_counters` (allocate it before the capture starts)."""
    return torch.zeros(MIN_COUNTERS, dtype=torch.int32, device=device)
