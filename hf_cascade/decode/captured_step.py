"""The decode step of a fixed-buffer cascade cache recorded into a CUDA graph, without ``torch.compile``.

Why. generate()'s compiled step (``torch.compile`` + CUDA graphs) is the fastest step, but its first compilation
of an 8B model takes about a minute (``benchmarks/results/profile_decode.jsonl``), longer than sdpa needs for a
stream of eight batches. The model's eager step launches ~1,460 kernels, and its cost is those launches, not the
GPU work: recorded once into a CUDA graph (as SGLang records its decode steps) the same kernels replay in one
launch. Recording costs one eager step, no compilation.

What makes it safe. While a step is recorded or run by :class:`CapturedDecodeStep` (:func:`static_step` is True),
a :class:`~hf_cascade.cache.CascadeCache` with fixed buffers takes the path it takes inside a compiled step: it
reads and writes device tensors only (suffix buffers written at a device-side length, the planned prefix slots,
the op's planned index tensors, the window mask built from device data) and never changes a Python value that
the next step would read. Everything a graph reads outside its own memory is named by its key: the cache's
tensors (:meth:`CascadeCache.static_step_tensors`, by address, shape, stride and dtype), the model's parameters,
and the step's inputs (copied into the graph's own input tensors before every replay). A step whose key differs
(another cache at other addresses, another shape, another argument) is recorded anew; the model's graphs are kept
between generate() calls (at most :data:`GRAPHS_PER_MODEL`, the least recently used dropped), and since
``hf_cascade.generate`` takes a call's buffers from the model's :class:`~hf_cascade.step_buffers.StepBuffers`, a
call with the shapes of an earlier one replays its graph from the first step.

A new key is first run eagerly in this mode on the recording stream (Triton kernels built, cuBLAS set up for that
stream), and recorded at the next step with that key.

With ``compile_layers`` (``decode_step="layers"``, the default) the model's decoder layers run compiled while a
step is run once and recorded (:mod:`hf_cascade.compiled_layers`): they compile at that first run, once per model,
and the recorded graph holds their fused kernels. Where the call says not to compile shapes that are new to them
(``compiled_layers.NewShapes``) and its first step found no compiled code for its shapes, the call's steps record
the eager layers instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import torch
from transformers.utils import logging

from hf_cascade.compiled_layers import compiled_layers
from hf_cascade.step_context import current as _step, step_context
from hf_cascade.engine import engine_of
from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)

__all__ = ["CapturedDecodeStep", "GRAPHS_PER_MODEL", "recorded_steps", "static_step_mode"]

GRAPHS_PER_MODEL = 4

def static_step_mode():
    """Run the forwards inside in the device-only path of a compiled step (what :class:`CapturedDecodeStep` does
    while it runs a new key once and while it records: ``StepContext.static_step``). Only for a fixed-buffer cache
    whose prefill has run."""
    return step_context(static_step=True)


class _Graph:
    """One recorded step: the graph, its input tensors (filled before each replay) and its output."""

    def __init__(self):
        self.graph = None
        self.inputs: dict[tuple, torch.Tensor] = {}
        self.output = None
        self.keepalive = None  # device tensors the graph reads that no step buffer holds (the cache says which)


class _ModelGraphs:
    """A model's recorded steps by key (least recently used first), and the keys run once but not recorded yet."""

    def __init__(self):
        self.graphs: OrderedDict = OrderedDict()
        self.warm: set = set()
        self.failed: set = set()  # keys whose recording raised: run eagerly
        self.layers_failed = False  # compiling the decoder layers raised: steps record the eager layers
        self.lock = threading.Lock()
        self.streams = threading.local()  # recording streams by device, per thread (a capture takes a whole stream)
        self.recorded = 0  # graphs recorded, all calls
        self.replayed = 0  # steps replayed, all calls


def _model_graphs(model: torch.nn.Module) -> _ModelGraphs:
    return engine_of(model).part("graphs", _ModelGraphs)


def recorded_steps(model: torch.nn.Module) -> dict[str, int]:
    """``{"recorded": graphs recorded, "replayed": steps replayed, "kept": graphs kept}`` for ``model``'s decode
    steps in this process (:class:`CapturedDecodeStep`)."""
    store = _model_graphs(model)
    with store.lock:
        return {"recorded": store.recorded, "replayed": store.replayed, "kept": len(store.graphs)}


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class CapturedDecodeStep:
    """``model.__call__`` for the decode steps of one generate() call on a fixed-buffer :class:`CascadeCache`,
    replayed from a CUDA graph (see the module docstring).

    Call it as the model: ``step(**model_inputs, return_dict=True)`` with ``model_inputs`` from
    ``prepare_inputs_for_generation`` (``input_ids`` ``[B, 1]``, ``position_ids`` ``[B, 1]``, the 4-D mask, the
    cache, ...). The returned output's tensors are the graph's own: read (copy) them before the next step.
    """

    def __init__(self, model: torch.nn.Module, cache, compile_layers: bool = False):
        self.model = model
        self.cache = cache
        self._store = _model_graphs(model)
        # The decoder layers compiled inside the recorded step (hf_cascade.compiled_layers), unless that failed
        # for this model before.
        self.compile_layers = compile_layers and not self._store.layers_failed
        self._cache_key: tuple | None = None  # the cache's and the model's tensors: fixed for one call

    def __call__(self, **inputs):
        if inputs.get(CACHE_KWARG) is not self.cache:
            raise ValueError("CapturedDecodeStep serves the cache it was built for; got another cache.")
        key, tensors = self._key(inputs)
        if key is None:  # an argument that cannot be compared between steps: not recorded
            return self.model(**inputs)
        store = self._store
        with store.lock:
            entry = store.graphs.get(key)
            if entry is not None:
                store.graphs.move_to_end(key)
                store.replayed += 1
            failed = key in store.failed
        if failed:
            return self.model(**inputs)
        self.cache.begin_static_step()
        if entry is None:
            stream = self._recording_stream(tensors)
            # A key's first step runs once, before it is recorded (per stream: its cuBLAS set up before a capture).
            if (key, stream.cuda_stream) not in store.warm:
                return self._run_once(key, inputs, stream)
            entry = self._record(key, inputs, tensors, stream)
            if entry is None:
                return self.model(**inputs)
        else:
            for path, value in tensors.items():
                entry.inputs[path].copy_(value, non_blocking=True)
        entry.graph.replay()
        return self._output(entry)

    def _key(self, inputs: dict) -> tuple[tuple | None, dict[tuple, torch.Tensor]]:
        """The step's graph key and its tensor arguments by path ((name,), or (name, key) for a dict of masks)."""
        if self._cache_key is None:  # fixed for one call
            self._cache_key = (
                tuple(_tensor_key(t) for t in self.cache.static_step_tensors()),
                tuple(p.data_ptr() for p in self.model.parameters()),
                tuple(b.data_ptr() for b in self.model.buffers()),
                # Python state the eager step reads (a compiled step guards on it)
                torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"),
                getattr(self.model.config, "_attn_implementation", None),
                self.compile_layers,
                # the rows' layout, where the step's attention reads it on the host (the built-in kernels)
                getattr(self.cache, "static_layout_key", lambda: None)(),
            )
        tensors, others = {}, []
        for name, value in sorted(inputs.items()):
            items = sorted(value.items()) if isinstance(value, dict) else [(None, value)]
            for sub, leaf in items:
                path = (name,) if sub is None else (name, sub)
                if isinstance(leaf, torch.Tensor):
                    tensors[path] = leaf
                    others.append((path, tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
                elif name != CACHE_KWARG:
                    others.append((path, leaf))
        key = (self._cache_key, tuple(others))
        try:
            hash(key)
        except TypeError:
            return None, tensors
        return key, tensors

    def _recording_stream(self, tensors: dict[tuple, torch.Tensor]) -> torch.cuda.Stream:
        device = next((t.device for t in tensors.values() if t.device.type == "cuda"),
                      torch.device("cuda", torch.cuda.current_device()))
        streams = self._store.streams
        if not hasattr(streams, "by_device"):
            streams.by_device = {}
        if device not in streams.by_device:
            streams.by_device[device] = torch.cuda.Stream(device=device)
        return streams.by_device[device]

    def _run_once(self, key: tuple, inputs: dict, stream: torch.cuda.Stream):
        """A new key's first step: run in the recorded path on the recording stream (its Triton kernels built,
        cuBLAS set up for that stream); it is recorded at its next step."""
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with static_step_mode(), torch.cuda.stream(stream):
                out = self._run_with_compiled_layers(inputs) if self.compile_layers else self.model(**inputs)
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        with self._store.lock:
            if len(self._store.warm) >= 8 * GRAPHS_PER_MODEL:  # keys of calls long gone
                self._store.warm.clear()
            self._store.warm.add((key, stream.cuda_stream))
        return out

    def _run_with_compiled_layers(self, inputs: dict):
        """The step with the decoder layers compiled (they compile now, at a new key's first step: never while
        recording). If compiling fails, this model's steps record the eager layers from now on; the cache's written
        lengths are restored first, so the step runs again from the same state."""
        lengths = [t.clone() for t in self.cache.suffix_lengths()]
        policy = _step().new_shapes
        misses = 0 if policy is None else policy.misses
        try:
            with compiled_layers(self.model, self.cache):
                out = self.model(**inputs)
            if policy is not None and policy.misses > misses:
                # No compiled code fit this call's shapes and none was compiled (compiled_layers.NewShapes): its
                # steps record the eager layers, under a key that says so (not replayed once the shapes compile).
                self.compile_layers, self._cache_key = False, None
            return out
        except Exception as err:  # noqa: BLE001 (any compiler error: the eager layers compute the same step)
            for saved, current in zip(lengths, self.cache.suffix_lengths()):
                current.copy_(saved)
            self.compile_layers = False
            with self._store.lock:
                self._store.layers_failed = True
            self._cache_key = None  # the key names the eager layers now
            logger.warning_once(f"hf_cascade: compiling this model's decoder layers for the recorded decode step "
                                f"failed ({type(err).__name__}: {str(err)[:300]}); the step records the eager "
                                "layers instead.")
            return self.model(**inputs)

    def _record(self, key: tuple, inputs: dict, tensors: dict[tuple, torch.Tensor],
                stream: torch.cuda.Stream) -> _Graph | None:
        """Record this step (not run: the caller replays it); None where it cannot be recorded."""
        store = self._store
        entry = _Graph()
        entry.inputs = {path: value.clone() for path, value in tensors.items()}
        recorded_inputs = dict(inputs)
        for path, value in entry.inputs.items():
            if len(path) == 1:
                recorded_inputs[path[0]] = value
            else:
                recorded_inputs[path[0]] = {**recorded_inputs[path[0]], path[1]: value}
        entry.graph = torch.cuda.CUDAGraph()
        # CUDAGraph.capture_begin rather than torch.cuda.graph, which empties the allocator's cache first (the next
        # prefill would then allocate its activations from the driver again).
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with static_step_mode(), torch.cuda.stream(stream):
                entry.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    with compiled_layers(self.model, self.cache) if self.compile_layers else contextlib.nullcontext():
                        output = self.model(**recorded_inputs)
                finally:
                    entry.graph.capture_end()
        except RuntimeError as err:  # something in this model's step cannot be recorded: it runs eagerly
            with store.lock:
                store.failed.add(key)
            logger.warning_once(f"hf_cascade: this model's decode step could not be recorded into a CUDA graph "
                                f"({type(err).__name__}: {str(err)[:200]}); it runs eagerly.")
            return None
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        # The cache is this call's: the graph keeps the output's tensors, not the cache object.
        entry.output = (type(output), {k: v for k, v in output.items() if k != CACHE_KWARG},
                        CACHE_KWARG in output)
        entry.keepalive = getattr(self.cache, "static_step_keepalive", lambda: None)()
        with store.lock:
            store.warm.discard((key, stream.cuda_stream))
            store.graphs[key] = entry
            while len(store.graphs) > GRAPHS_PER_MODEL:
                store.graphs.popitem(last=False)
            store.recorded += 1
            store.replayed += 1  # the caller replays it now
        return entry

    def _output(self, entry: _Graph):
        """The recorded output (its tensors the graph's), with this call's cache."""
        cls, fields, has_cache = entry.output
        return cls(**fields, **{CACHE_KWARG: self.cache}) if has_cache else cls(**fields)
