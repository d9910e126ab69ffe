"""The model's decoder layers compiled once for all layers, hf_cascade's cache write and attention one opaque op
inside the graph: the model's own small kernels (norms, rotary, activations, residual adds) fused, in a few seconds of
compilation instead of a minute.

Why. A recorded decode step (:mod:`hf_cascade.decode.captured_step`) replays the eager step's kernels from a CUDA graph:
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
:class:`~hf_cascade.decode.captured_step.CapturedDecodeStep` runs a step once and records it (the compiled code is then
part of the CUDA graph); the model's own calls never see it. Measured (H100, Llama-3-8B shape, B=32,
``benchmarks/results/generate.jsonl``): 7.84–8.14 ms per step against 9.4–10.3 ms recorded eager; one graph for the
32 layers, torch.compile 0.6–0.8 s in a new process with its caches warm (e01ef32; 1.3–1.6 s and 4–5 graphs with
the update and attention left out of the graphs by ``torch.compiler.disable`` before).

The prefill too (:func:`compiled_forward`): each shared segment's forward and the rows' first forward run the same
layers compiled with the batch and length dims marked dynamic (``compiled_layers(..., dynamic=True)``; the model's
other sizes stay constants), not recorded: one graph for the forwards of one row (a segment's one node, no mask)
and one for those of several rows (always given a mask: ``StepContext.prefill_batch_masks``), for every layout. Measured (H100,
same shape): 0.66 s per call against 0.70 s with the eager prefill; the stream of layouts traces 3 graphs in all
(decode step included) in its first batch, ~3 s with warm caches (759e149).

Shapes the compiled code was not made for (:class:`NewShapes`). The decode step's graph has the batch symbolic from
its first compilation (its other sizes are constants or marked dynamic), so a new batch size or tree runs it as it
is; a size it specialised (a batch of one row) or another kind of forward fails its guards, and dynamo would
compile the layer again: seconds in the call's own thread. Where ``hf_cascade.generate`` runs the compiled tier once
it is built (:func:`hf_cascade.tiers.shape_policy`), it sets a :class:`NewShapes` with ``compile=False``: the layers
then run under torch's ``"eager_on_recompile"`` stance (compiled code where its guards pass, the layer's own code
where none does, nothing compiled) and count the layer calls that ran uncompiled, so that a later call compiles them
once the time lost pays for it (a ski rental per shape).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from transformers.utils import logging

from hf_cascade.step_context import TRACE, current as _step, step_context
from hf_cascade.engine import engine_of

logger = logging.get_logger(__name__)

__all__ = ["NewShapes", "compiled_forward", "compiled_layers", "compiled_prefills", "decoder_layers",
           "layer_calls", "layer_compilations", "new_shapes",
           "skipping_new_shapes_supported"]


_ACTIVE_LOCK = threading.RLock()  # held while compiled_layers runs (TRACE.layers and the process-wide stance)


class NewShapes:
    """What the compiled layers of one call do with shapes their compiled code was not made for (see the module
    docstring): ``compile`` True compiles them in the call (torch's default); False runs those layer calls uncompiled
    and counts them in ``misses``."""

    __slots__ = ("compile", "misses")

    def __init__(self, compile: bool):
        self.compile = compile
        self.misses = 0

    def __repr__(self) -> str:
        return f"NewShapes(compile={self.compile}, misses={self.misses})"


def new_shapes(policy: NewShapes | None):
    """The compiled layers run inside follow ``policy`` (``StepContext.new_shapes``; None: leave the context's as it
    is)."""
    return contextlib.nullcontext() if policy is None else step_context(new_shapes=policy)


def skipping_new_shapes_supported() -> bool:
    """Whether this torch can run compiled code where it fits and nothing new (``torch.compiler.set_stance``)."""
    return hasattr(torch.compiler, "set_stance")


def _stance_for_new_shapes():
    """torch's ``"eager_on_recompile"`` stance where the context's :class:`NewShapes` says not to compile, else
    nothing. The stance is process-wide: set only under ``_ACTIVE_LOCK``, which every compiled-layer forward of
    hf_cascade holds."""
    policy = _step().new_shapes
    if policy is None or policy.compile or not skipping_new_shapes_supported():
        return contextlib.nullcontext()
    try:
        return torch.compiler.set_stance("eager_on_recompile")
    except RuntimeError:  # another thread is inside a compilation (torch's flag is process-wide): compile as before
        return contextlib.nullcontext()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder layers (``model.model.layers`` for transformers' causal LMs), or None."""
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers
    return None


class _LayerCalls:
    """A model's compiled layer calls (one ``torch.compile`` wrapper per layer; dynamo's code cache is shared):
    ``calls`` for the decode step (the batch symbolic), ``dynamic_calls`` for the prefill forwards (batch and length
    symbolic: every layout's prefix and first forward run one graph)."""

    def __init__(self):
        self.calls: list | None = None
        self.dynamic_calls: list | None = None
        self.lock = threading.Lock()
        self.entered = 0  # steps run or recorded with the compiled layers
        self.prefills = 0  # prefill forwards run with the compiled layers
        self.prefill_failed = False  # compiling the prefill's layers failed once: they run eagerly from then on


def layer_calls(model: torch.nn.Module) -> _LayerCalls:
    """``model``'s compiled layer calls (its :class:`~hf_cascade.engine.Engine`'s ``layer_calls`` part)."""
    return engine_of(model).part("layer_calls", _LayerCalls)


def layer_compilations(model: torch.nn.Module) -> int:
    """How many steps of ``model`` ran (or were recorded) with its decoder layers compiled, in this process."""
    return layer_calls(model).entered


def compiled_prefills(model: torch.nn.Module) -> int:
    """How many prefill forwards of ``model`` ran with its decoder layers compiled (:func:`compiled_forward`)."""
    return layer_calls(model).prefills


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


def _recompile_limit():
    """Room for the graphs one model's layers compile (the decode step per batch bucket, the prefill's few shape
    specialisations): dynamo counts them per code object, and every layer's call is ``Module._call_impl``."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name, 0) >= 64:
        return contextlib.nullcontext()
    return config.patch(**{name: 64})


# A decoder layer's tensor inputs in a prefill forward, by keyword, and their dims that change between forwards (the
# batch, the new tokens, the keys): every other size (hidden size, head dim, heads) stays a constant of the graph.
_VARYING_DIMS = {"hidden_states": (0, 1), "position_embeddings": (0, 1), "position_ids": (0, 1),
                 "attention_mask": (0, 2, 3), "cache_position": (0,)}
# ... in a decode step: the batch, symbolic from the first compilation, so that one graph serves every batch size and
# tree (the layout lives in the attention op's inputs, outside the graph). Compiled for one batch size and made
# symbolic by the first other one instead, a process that had moved up stalled 4-6 s on its first call of a new
# batch size (H100, Llama-3-8B shape, results/stall.jsonl). The mask's key length is marked where it is built
# (attention.cascade_mask).
_DECODE_VARYING_DIMS = {"hidden_states": (0,), "position_embeddings": (0,), "position_ids": (0,),
                        "attention_mask": (0,)}


def _mark_varying(value, dims) -> None:
    if isinstance(value, torch.Tensor):
        for dim in dims:
            if dim < value.dim():
                torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_varying(item, dims)


def _with_symbolic_dims(compiled, varying: dict[str, tuple[int, ...]]):
    """``compiled`` (a decoder layer's compiled call) with its inputs' ``varying`` dims (by keyword; the first
    positional argument is ``hidden_states``) marked dynamic before each call: for the prefill (:data:`_VARYING_DIMS`)
    one graph for every batch, length and prefix size; for the decode step (:data:`_DECODE_VARYING_DIMS`) one for
    every batch size. Not ``torch.compile(dynamic=True)``, which makes every size symbolic, the module's int
    attributes too (the head dim, with ``allow_unspec_int_on_nn_module``): its kernels then index with divisions by
    runtime values (the rotary kernel ran 4x slower, H100)."""

    def call(*args, **kwargs):
        if args:
            _mark_varying(args[0], varying["hidden_states"])
        for name, value in kwargs.items():
            dims = varying.get(name)
            if dims is not None:
                _mark_varying(value, dims)
        return compiled(*args, **kwargs)

    return call


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module, cache, dynamic: bool = False):
    """Run the forwards inside with ``model``'s decoder layers compiled (see the module docstring), for forwards on
    ``cache`` (the :class:`~hf_cascade.cache.CascadeCache` the attention op writes and reads). ``dynamic=False``:
    the decode step (the batch symbolic, other sizes specialised; recorded into a CUDA graph by the caller);
    ``dynamic=True``: the prefill
    forwards (batch and length symbolic, one graph for every layout's lengths). Does nothing for a model without a
    ``layers`` list. One thread at a time (a second thread waits): the layers' compiled calls are set on the model's
    modules."""
    layers = decoder_layers(model)
    if layers is None:
        yield False
        return
    state = layer_calls(model)
    with state.lock:
        if dynamic:
            if state.dynamic_calls is None:
                state.dynamic_calls = [_with_symbolic_dims(torch.compile(layer._call_impl), _VARYING_DIMS)
                                       for layer in layers]
            calls = state.dynamic_calls
        else:
            if state.calls is None:
                state.calls = [_with_symbolic_dims(torch.compile(layer._call_impl), _DECODE_VARYING_DIMS)
                               for layer in layers]
            calls = state.calls
            state.entered += 1
    with _ACTIVE_LOCK, torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), _layer_index_symbolic(), \
            _recompile_limit(), _stance_for_new_shapes():
        previous, previous_tracing = [layer._compiled_call_impl for layer in layers], TRACE.layers
        for index, layer in enumerate(layers):  # (entered again: all restored on the way out)
            if not isinstance(layer._compiled_call_impl, _ThreadCompiledCall):
                layer._compiled_call_impl = _ThreadCompiledCall(layer, index, layer._compiled_call_impl)
        TRACE.layers = True
        try:
            with step_context(layer_cache=cache, layer_written=[], layer_calls=calls):
                yield True
        finally:
            TRACE.layers = previous_tracing
            for layer, impl in zip(layers, previous):
                layer._compiled_call_impl = impl


class _ThreadCompiledCall:
    """A decoder layer's ``_compiled_call_impl`` while :func:`compiled_layers` runs: the compiled call in the context
    inside it, the layer's own call (or what was installed before) in every other context (other threads), so that
    other threads' calls on the model run it as it was; counts the calls that ran uncompiled under :class:`NewShapes`."""

    __slots__ = ("layer", "index", "previous")
    installed_by_hf_cascade = True  # (attention._compiled_by_user looks through it to what was there before)

    def __init__(self, layer: torch.nn.Module, index: int, previous):
        self.layer, self.index, self.previous = layer, index, previous

    def __call__(self, *args, **kwargs):
        step = _step()
        calls = step.layer_calls
        if calls is not None:
            policy = step.new_shapes
            if policy is None or policy.compile:
                return calls[self.index](*args, **kwargs)
            written = step.layer_written
            before = len(written)
            out = calls[self.index](*args, **kwargs)
            if len(written) == before:  # the layer's attention op did not run: dynamo ran its own code (no graph fit)
                policy.misses += 1
            return out
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self.layer._call_impl(*args, **kwargs)


def compiled_forward(model: torch.nn.Module, cache, forward):
    """``forward()`` (a prefill forward of ``model`` on ``cache``: one model call) with the
    decoder layers compiled with symbolic shapes: the model's own small kernels (norms, rotary, activations,
    residual adds) fused, as in the decode step; one compilation per model serves every layout's prefix and first
    forward. If compiling fails, the layers that already wrote this forward's KV take it back (``crop``), a
    warning says why, and the forward runs eagerly (and does from then on for this model: a compiler error stays
    one). Returns what ``forward()`` returns."""
    state = layer_calls(model)
    if state.prefill_failed or decoder_layers(model) is None:
        return forward()
    # A forward of several rows gets a mask tensor even where "causal, no padding" could go without (see
    # attention.cascade_mask), so that such forwards (a level of equal-length nodes) run the graph of the forwards
    # that have one (the rows' first forward), not a graph of their own.
    with step_context(prefill_batch_masks=True):
        written: list[tuple[int, int]] = []
        try:
            with compiled_layers(model, cache, dynamic=True):
                written = _step().layer_written
                out = forward()
            with state.lock:
                state.prefills += 1
            return out
        except Exception as err:  # noqa: BLE001 (a compiler error: the eager layers compute the same forward)
            for layer_idx, tokens in written:
                cache.layers[layer_idx].crop(tokens)
            if isinstance(err, torch._dynamo.exc.TorchDynamoException):
                with state.lock:
                    state.prefill_failed = True
                logger.warning_once(f"hf_cascade: compiling this model's decoder layers for the prefill failed "
                                    f"({type(err).__name__}: {str(err)[:300]}); the prefill runs them eagerly.")
            return forward()
