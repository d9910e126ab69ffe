"""The model's decoder layers compiled once for all layers, hf_cascade's cache update and attention left between
their graphs: the model's own small kernels (norms, rotary, activations, residual adds) fused, in a few seconds of
compilation instead of a minute.

Why. A recorded decode step (:mod:`hf_cascade.captured_step`) replays the eager step's kernels from a CUDA graph:
no launch cost, but each of the model's ~40 small kernels per layer still runs on its own. The compiled step fuses
them (about 2 ms of a 10 ms step, Llama-3-8B shape, B=32, H100) but compiles the whole model (about a minute).
Compiling each decoder layer on its own costs as much where every layer compiles anew, and they do: transformers
passes ``self.layer_idx``, a Python int, to the cache, and dynamo specialises graphs on module ints.

How. Inside :func:`compiled_layers`, ``CascadeCache.update`` and the ``"cascade"`` attention run eagerly, outside
the layer's graphs (they read per-layer state by the layer's index), and dynamo may treat a module's int as a
symbol (``allow_unspec_int_on_nn_module``; the index also named dynamic through
``torch.compiler.config.dynamic_sources`` where torch has it): the first layers compile with their index a
constant, then once with it symbolic, and that code serves every later layer. Used only while
:class:`~hf_cascade.captured_step.CapturedDecodeStep` runs a step once and records it (the compiled code is then
part of the CUDA graph); the model's own calls never see it. Measured (H100, Llama-3-8B shape, B=32,
``benchmarks/results/generate.jsonl``): 7.84–8.14 ms per step against 9.4–10.3 ms recorded eager, after 4.7 s of
torch.compile in the first process (1.3–1.6 s in later ones: its caches); 4 graphs for the 32 layers (5 without
``dynamic_sources``).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from hf_cascade.step_buffers import model_state

__all__ = ["compiled_layers", "decoder_layers", "layer_compilations", "layer_step_cache", "outside_layer_graphs"]


class _Tracing:
    """Whether decoder layers compiled by :func:`compiled_layers` may be traced now. A plain attribute: dynamo
    reads it while it traces (it cannot trace a ContextVar), and guards on it."""

    active = False


_TRACING = _Tracing()
_ACTIVE_LOCK = threading.RLock()
_STEP = threading.local()  # .cache: the cache of the step running with compiled layers on this thread


def layer_step_cache():
    """The cache of the step that runs with compiled layers on this thread (read by the attention op that the
    layers' graph calls, when it runs), or None."""
    return getattr(_STEP, "cache", None)


def outside_layer_graphs() -> bool:
    """True while dynamo traces a decoder layer for :func:`compiled_layers`: hf_cascade's cache update and
    attention then leave the graph (``torch.compiler.disable``) and run eagerly."""
    return torch.compiler.is_compiling() and _TRACING.active


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder layers (``model.model.layers`` for transformers' causal LMs), or None."""
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers
    return None


class _LayerCalls:
    """A model's compiled layer calls (one ``torch.compile`` wrapper per layer; dynamo's code cache is shared)."""

    def __init__(self):
        self.calls: list | None = None
        self.lock = threading.Lock()
        self.entered = 0  # steps run or recorded with the compiled layers


def layer_compilations(model: torch.nn.Module) -> int:
    """How many steps of ``model`` ran (or were recorded) with its decoder layers compiled, in this process."""
    return model_state(model, _LayerCalls).entered


# The layer index as dynamo names it (``L['self']._modules['self_attn'].layer_idx`` for Llama), a regex.
_LAYER_INDEX_SOURCES = r".*\.layer_idx$"


def _layer_index_symbolic():
    """Where this torch has ``torch.compiler.config.dynamic_sources``: the layer index symbolic from the first
    layer that can have it (0 and 1 stay constants), not only after a layer's guards failed: one compilation fewer
    (4 graphs for Llama instead of 5). Elsewhere nothing (automatic dynamic still makes it symbolic)."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "dynamic_sources"):
        return contextlib.nullcontext()
    return config.patch(dynamic_sources=_LAYER_INDEX_SOURCES)


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module, cache):
    """Run the forwards inside with ``model``'s decoder layers compiled (see the module docstring), for decode steps
    on ``cache`` (the :class:`~hf_cascade.cache.CascadeCache` the attention op writes and reads). Does nothing for a
    model without a ``layers`` list. One thread at a time (a second thread waits): the layers' compiled calls are
    set on the model's modules."""
    layers = decoder_layers(model)
    if layers is None:
        yield False
        return
    state = model_state(model, _LayerCalls)
    with state.lock:
        if state.calls is None:
            state.calls = [torch.compile(layer._call_impl) for layer in layers]
        calls = state.calls
        state.entered += 1
    with _ACTIVE_LOCK, torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), _layer_index_symbolic():
        previous = [layer._compiled_call_impl for layer in layers], _TRACING.active, layer_step_cache()
        for layer, call in zip(layers, calls):  # (entered again: all restored on the way out)
            layer._compiled_call_impl = call
        _TRACING.active, _STEP.cache = True, cache
        try:
            yield True
        finally:
            _TRACING.active, _STEP.cache = previous[1], previous[2]
            for layer, impl in zip(layers, previous[0]):
                layer._compiled_call_impl = impl
