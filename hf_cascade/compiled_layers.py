"""The model's decoder layers compiled once for all layers, hf_cascade's cache write and attention one opaque op
inside the graph: the model's own small kernels (norms, rotary, activations, residual adds) fused, in a few seconds of
compilation instead of a minute.

Why. A recorded decode step (:mod:`hf_cascade.captured_step`) replays the eager step's kernels from a CUDA graph:
no launch cost, but each of the model's ~40 small kernels per layer still runs on its own. The compiled step fuses
them (about 2 ms of a 10 ms step, Llama-3-8B shape, B=32, H100) but compiles the whole model (about a minute).
Compiling each decoder layer on its own costs as much where every layer compiles anew, and they do: transformers
passes ``self.layer_idx``, a Python int, to the cache, and dynamo specialises graphs on module ints.

How. While :func:`compiled_layers` traces a layer, ``CascadeCache.update`` hands the step's K and V on unchanged and
the ``"cascade"`` attention calls one custom op, ``hf_cascade::layer_step_attention`` (:mod:`hf_cascade.attention`),
which at run time writes them into the cache given to :func:`compiled_layers` and attends, eagerly (both read
per-layer state by the layer's index, an argument of the op). Dynamo treats the index as a symbol
(``allow_unspec_int_on_nn_module``, and ``torch.compiler.config.dynamic_sources`` where torch has it), so a layer is
one graph without breaks and that graph serves every layer. Used only while
:class:`~hf_cascade.captured_step.CapturedDecodeStep` runs a step once and records it (the compiled code is then
part of the CUDA graph); the model's own calls never see it. Measured (H100, Llama-3-8B shape, B=32,
``benchmarks/results/generate.jsonl``): 7.84–8.14 ms per step against 9.4–10.3 ms recorded eager; one graph for the
32 layers, torch.compile 0.6–0.8 s in a new process with its caches warm (e01ef32; 1.3–1.6 s and 4–5 graphs with
the update and attention left out of the graphs by ``torch.compiler.disable`` before).
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
    """True while dynamo traces a decoder layer for :func:`compiled_layers`: hf_cascade's cache update then hands K
    and V on, and the attention calls ``hf_cascade::layer_step_attention`` (one op in the graph)."""
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
    trace, not only after a layer's guards failed. Elsewhere nothing (automatic dynamic makes it symbolic at the
    second layer: one more compilation)."""
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
