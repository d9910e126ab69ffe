"""The facts of the step that runs in this context, in one place: one :class:`StepContext` carried by one
``contextvars.ContextVar`` (so thread- and task-safe), read by the layers (the cache, the attention, the mask
builder, the compiled layers) instead of module flags. Set it with ``with step_context(field=value, ...):``, which
runs the code inside with a copy of the current context with those fields changed and restores it on the way out.

Reading it costs one ``ContextVar.get`` and an attribute read (nothing allocated): fine once per layer. dynamo cannot
trace ``ContextVar.get`` (it breaks the graph there); code that may run while dynamo traces reads it only after
``torch.compiler.is_compiling()`` said no, or reads :data:`TRACE`, the one plain object dynamo reads (and guards on)
while it traces.

Imports nothing from hf_cascade: every layer may import it (the cache and the attention read it; the decode
engine in :mod:`hf_cascade.decode` sets it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch

__all__ = ["StepContext", "TRACE", "current", "layer_step_cache", "memoized", "note_layer_written",
           "outside_layer_graphs", "static_step", "step_context"]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the forwards running in this context are part of (defaults: a plain forward of the user's)."""

    # hf_cascade.generate runs a decode (it planned the batch): the attention does not suggest using it.
    in_generate: bool = False
    # hf_cascade's decoding loop (decode.sampling.sample): decode-step masks are always built (attention.cascade_mask).
    decode_masks: bool = False
    # A prefill forward with compiled layers (compiled_layers.compiled_forward): a forward of several rows always gets
    # a mask tensor, so that it runs the graph of the forwards that have one.
    prefill_batch_masks: bool = False
    # A step that CapturedDecodeStep runs once or records: the cache touches device data only (captured_step).
    static_step: bool = False
    # The generate() call's compiled_layers.NewShapes (None: compile new shapes, as torch.compile does).
    new_shapes: object | None = None
    # While compiled_layers runs a step: the cache its attention op writes and reads, the layers' compiled calls,
    # and the (layer_idx, tokens) the op wrote so far (a list appended to, so a failed forward can take them back).
    layer_cache: object | None = None
    layer_calls: list | None = None
    layer_written: list | None = None


_CONTEXT: contextvars.ContextVar[StepContext] = contextvars.ContextVar("hf_cascade_step", default=StepContext())


def current() -> StepContext:
    """The step context of the running code."""
    return _CONTEXT.get()


@contextlib.contextmanager
def step_context(**changes):
    """Run the code inside with the current step context's ``changes`` fields changed; yields the new context."""
    context = dataclasses.replace(_CONTEXT.get(), **changes)
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


class _Trace:
    """What dynamo must see while it traces (it cannot trace a ContextVar): plain attributes it reads as constants.

    ``layers``: decoder layers compiled by ``compiled_layers`` may be traced now (dynamo guards on it; set only under
    that module's process-wide lock). ``binding``: the cache binding of the layer being traced (set by the cache's
    ``update()`` and read back by the attention within one traced frame, so the graph holds the resolved cache;
    None outside a trace)."""

    layers = False
    binding: tuple | None = None


TRACE = _Trace()


def static_step() -> bool:
    """Whether the running forward must touch device data only: inside a compiled step, or a step that
    :class:`~hf_cascade.decode.captured_step.CapturedDecodeStep` runs or records (``StepContext.static_step``)."""
    return torch.compiler.is_compiling() or _CONTEXT.get().static_step


def outside_layer_graphs() -> bool:
    """True while dynamo traces a decoder layer for :func:`~hf_cascade.compiled_layers.compiled_layers`:
    hf_cascade's cache update then hands K and V on, and the attention calls ``hf_cascade::layer_step_attention``
    (one op in the graph)."""
    return torch.compiler.is_compiling() and TRACE.layers


def layer_step_cache():
    """The cache of the step that runs with compiled layers in this context (read by the attention op that the
    layers' graph calls, when it runs), or None."""
    return _CONTEXT.get().layer_cache


def note_layer_written(layer_idx: int, tokens: int) -> None:
    """Called by the attention op of a compiled layer after it wrote ``tokens`` new columns of the layer's KV into the
    cache (so that a forward that fails part-way can take exactly those writes back, see
    :func:`~hf_cascade.compiled_layers.compiled_forward`)."""
    written = _CONTEXT.get().layer_written
    if written is not None:
        written.append((layer_idx, tokens))


def memoized(memo: dict | None, key: tuple, compute):
    """``memo[key]``, computed by ``compute()`` and stored on first use; ``compute()`` every time without a memo."""
    value = None if memo is None else memo.get(key)
    if value is None:
        value = compute()
        if memo is not None:
            memo[key] = value
    return value
