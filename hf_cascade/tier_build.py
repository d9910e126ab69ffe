"""The compiled tier prepared in the background: no generate() call waits for a cold compiler.

:mod:`hf_cascade.tiers` starts a model's calls on tiers that need no compilation. After such a call (greedy or
sampling on CUDA, default options) :func:`build_in_background` starts one thread per model that runs the *build
call* (the same rows again through ``hf_cascade.generate`` with ``cascade_options={"compile": "now"}``, same
options, batch bucket and buffer capacity, so the same graphs; greedy; stopped after :data:`BUILD_STEPS` decode
steps) in a **child process** (:mod:`hf_cascade.tier_build_child`), on a copy of the model's config cut to :data:`PREWARM_LAYERS` decoder layers of
random weights, at low CPU priority. The layers compile to one graph for all layers, so the cut model makes the
same graphs and Triton kernels: the child fills the Triton and Inductor caches on disk. The thread only waits for it
(the GIL is free meanwhile), and the calls meanwhile build nothing themselves (they would build what the child is
building).

Then (``MODE = "child+thread"``, the default, where the installed torch lets a thread compile beside other threads:
:func:`threads_may_compile`; else as ``"child"``), once the calls' regret (:mod:`hf_cascade.tiers`: what the
compiled tier would have saved them) reaches what compiling from warm caches costs this process, the next call
starts the thread again to run the build call *in this process*: it traces the layers and loads what the child compiled, on
its own CUDA stream, with the compiled layer calls installed for its own thread only
(:class:`~hf_cascade.decode.compiled_layers._ThreadCompiledCall`), and the first call after it runs the compiled
tier. That part is Python holding the GIL: a fresh process's first compiled call on warm caches takes 8-10 s on the
device machine (H100, Llama-3-8B shape: imports of the compile stack, 2 s more where no bytecode cache was written;
dynamo's tracing 3.6 s; ``results/probe_warm_compile.jsonl``). The serving thread gives the GIL up at each torch op
and, with Python's 5 ms switch interval, waits that long to get it back each time: its call made almost no progress
until the build ended (one 4.3 s call beside a 4.1 s build). With :data:`BUILD_SWITCH_INTERVAL_S` (0.1 ms) while the
thread compiles, the two share it: the build takes 5-6 s and the calls beside it 1.2-2.8 s against 0.82 s
(``results/first_call.jsonl``). Waiting for the regret keeps that stall off short jobs: a stream of 12 batches on
warm caches took 24.9 s with the thread started at once, against 16.9 s without a build. Where the caches start
warm (a record says so), no child runs and only the wait applies.

Measured against the alternatives (same H100, one run; 75 s of the same 32-row call): ``MODE = "child"`` (the
thread only fills the caches; the ski rental then compiles in the foreground, expecting
:data:`~hf_cascade.tiers.WARM_COMPILE_COST_S`) stalls one call as long (7-9 s) and reaches the compiled tier later
(call 52 against 41 on empty caches, call 17 against 3 on warm ones): the thread overlaps part of the work with the
serving calls' GPU time. ``"thread"`` (no child): Triton's compiler holds the GIL for up to a second per kernel, a
1.0 s call took 7.5 s once and 2-4 s several times.

What the build shares with the serving process: the GPU (it starts only where free device memory is at least
:data:`MIN_FREE_FRACTION` of the GPU and :data:`CACHE_MULTIPLE` times the call's KV); the caches on disk. Where a
record says the caches are warm, no child runs (``"child"``: nothing runs; the ski rental decides with the recorded
cost). A child that fails is an error in :func:`hf_cascade.tiers.tier_report` and a warning; the calls then move up
by the ski rental alone, with the cold costs. The thread is a daemon; an
interpreter that exits while it builds does not wait for it, and the child ends with it (:func:`_leave_with_parent`).

**Shapes new to the compiled tier.** Once the compiled tier is ready, a call whose shapes its compiled layers were
not made for runs those layers uncompiled (:func:`hf_cascade.tiers.shape_policy`); after it, the thread runs the same
build call on that call's rows in this process (no child: the compile caches are warm, and a child would compile the
decode step for the batch size as a constant where this process compiles it symbolic), which compiles what was
missing (dynamo recompiles the layer; the batch becomes symbolic after a second size, so later sizes need nothing).
The calls meanwhile run the Triton tier (the build holds the compiled layers' lock while it compiles); the call
after it runs the compiled tier. At most :data:`MAX_VARIANT_BUILDS` per model, each layout ``(rows, levels)`` once;
only where a thread may compile (:func:`variant_builds_possible`); elsewhere the per-shape ski rental of
:mod:`hf_cascade.tiers` decides when a call compiles them itself. Each start is logged (``logger.info``).

Where this does not start: ``compile="now"`` / ``"never"``, beam search, CPU, a user's own cache, a call without
decode steps, :data:`ENABLED` set False (the benchmarks compare the policies), or the environment variable
``HF_CASCADE_BACKGROUND`` set to ``off`` (also ``0``, ``false``, ``no``; :func:`background_builds_on`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import time

import torch
from transformers.utils import logging

from hf_cascade._env import background_off
from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)

__all__ = ["BUILD_STEPS", "ENABLED", "MAX_VARIANT_BUILDS", "MODE", "background_builds_on", "build_in_background",
           "describe", "threads_may_compile", "variant_builds_possible", "wait_for_all_builds", "wait_for_build"]

ENABLED = True
# Decode steps of the build call: the first compiles the layers for the decode step, the next runs them again (a
# build records no CUDA graph: hf_cascade.decode.captured_step).
BUILD_STEPS = 2
MIN_FREE_FRACTION = 0.15
CACHE_MULTIPLE = 3
# "child+thread" (the default): the child process fills the compile caches, then the thread compiles in this process;
# "child": the child only, the calls move up by the ski rental; "thread": the thread alone (module docstring).
MODE = "child+thread"
MODES = ("child", "child+thread", "thread")
PREWARM_LAYERS = 2
# The GIL switch interval while a thread compiles in this process (Python's default: 5 ms; None leaves it). The
# serving thread gives the GIL up at every torch op (thousands per call) and, while the build's tracing runs, waits
# a whole interval for it each time: its call makes almost no progress until the build ends.
BUILD_SWITCH_INTERVAL_S: float | None = 1e-4
PREWARM_TIMEOUT_S = 900
_THREAD_NAME = "hf_cascade-compiled-tier"
# Builds of shapes new to a ready compiled tier, per model (a handful is what a stream needs: the batch becomes
# symbolic after the second batch size; a bound on a model whose shapes keep missing).
MAX_VARIANT_BUILDS = 8


def background_builds_on() -> bool:
    """Whether background builds may start: :data:`ENABLED`, and ``HF_CASCADE_BACKGROUND`` is not ``off``."""
    return ENABLED and not background_off()


def variant_builds_possible(state) -> bool:
    """Whether a thread may compile shapes new to ``state``'s ready compiled tier (module docstring): background
    builds on, a mode that compiles in this process, a torch whose threads may compile and that can run compiled
    layers without compiling new shapes, no failed build, fewer than :data:`MAX_VARIANT_BUILDS` so far. Call with
    ``state.lock`` held."""
    from hf_cascade.decode.compiled_layers import skipping_new_shapes_supported

    return (background_builds_on() and MODE in ("child+thread", "thread") and threads_may_compile()
            and skipping_new_shapes_supported() and state.build_error is None
            and len(state.variant_builds) < MAX_VARIANT_BUILDS)


def describe() -> str:
    """One line on the background builds of this process (``python -m hf_cascade info``)."""
    rental = "calls of shapes new to the compiled tier run them uncompiled until the time lost pays for compiling them"
    if not background_builds_on():
        return f"off (HF_CASCADE_BACKGROUND=off or tier_build.ENABLED False): calls move up by the ski rental; {rental}"
    if MODE != "child" and threads_may_compile():
        return ("on (HF_CASCADE_BACKGROUND=off turns it off): a child process fills the compile caches, a thread "
                "compiles the decoder layers; then calls of shapes new to them run them uncompiled while a thread "
                "compiles them")
    why = "tier_build.MODE 'child'" if MODE == "child" else "this torch's compile flag is process-wide"
    return (f"on (HF_CASCADE_BACKGROUND=off turns it off): a child process fills the compile caches ({why}: no "
            f"thread compiles), the call that moves up compiles; {rental}")


def build_in_background(run, model, input_ids: torch.Tensor, generation_config, model_kwargs: dict,
                        cascade_options: dict | None, batch_buckets: bool, cache_nbytes: int,
                        layout: tuple | None = None) -> bool:
    """Start building ``model``'s compiled tier on a background thread, from the rows of the call that just ran (or,
    where the tier is ready, the shapes of that call it was not compiled for: ``layout``).

    Args:
        run: ``hf_cascade.generate`` (the build call runs it; passed in, as this module is imported by it).
        model: the model of the call (on CUDA).
        input_ids: ``[B, L]`` int64, the rows as generate() handed them to ``hf_cascade.generate``.
        generation_config: the call's generation config (copied; the build is greedy).
        model_kwargs: the call's model kwargs as handed in (tensors copied; its cache and streamer left out).
        cascade_options: the user's ``cascade_options`` (the build adds ``compile="now"`` and ``batch_buckets``).
        batch_buckets: whether the call added rows up to a batch bucket (the build does the same).
        cache_nbytes: bytes of the call's KV (the memory check).
        layout: ``(rows, prefix levels)`` of the call, for a build of shapes new to a ready compiled tier (each
            layout is built once).
    Returns:
        Whether a build started (False: one is running or done or failed for this model, or it would not fit).
    """
    from hf_cascade.tiers import building_state

    if not background_builds_on() or input_ids.device.type != "cuda":
        return False
    state = building_state(model)
    with state.lock:
        step = _plan_build(model, state, layout)
        if step is None:
            return False
        prewarm, compile_here = step
        device = input_ids.device
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free < max(MIN_FREE_FRACTION * total, CACHE_MULTIPLE * cache_nbytes):
            if not state.ready["compiled"]:
                state.thread_builds = False  # no room beside the calls: the ski rental compiles in the foreground
            return False
        if state.ready["compiled"]:
            state.variant_builds.append(layout)
            state.shapes_regret = 0.0  # the build compiles what the calls missed (tiers.shape_policy)
            logger.info(f"hf_cascade: a call of {layout[0]} rows and {layout[1]} prefix levels ran decoder layers "
                        "uncompiled (shapes new to their compiled code); a background thread compiles them now "
                        "(the calls run the Triton tier until it ends; HF_CASCADE_BACKGROUND=off: no thread).")
        else:
            state.thread_builds = MODE != "child" and threads_may_compile()
        config = copy.deepcopy(generation_config)
        for name, value in (("do_sample", False), ("num_beams", 1), ("return_dict_in_generate", False),
                            ("output_scores", False), ("output_logits", False)):
            setattr(config, name, value)
        kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()
                  if k not in (CACHE_KWARG, "streamer")}
        options = {**(cascade_options or {}), "compile": "now", "batch_buckets": batch_buckets}
        ids = input_ids.clone()
        inputs_ready = torch.cuda.Event()
        inputs_ready.record(torch.cuda.current_stream(device))
        thread = threading.Thread(target=_build, args=(run, model, state, ids, config, kwargs, options, inputs_ready,
                                                       prewarm, compile_here),
                                  name=_THREAD_NAME, daemon=True)
        state.building = thread
        state.build_started = time.perf_counter()
    thread.start()
    return True


def threads_may_compile() -> bool:
    """Whether a thread may compile beside calls on another thread. Not where torch holds one process-wide flag for
    a whole compile session (``torch.compiler.is_compiling()`` True in every thread; torch 2.13 has it, as
    ``torch.compiler._compile_session_context``): the calls beside it would take the code paths meant for traced
    code (hf_cascade's static-step masks, the Triton op instead of the built-in kernels; transformers' own checks).
    There the background build only fills the caches (``MODE`` ``"child"``).

    Nowhere, for now: a compile that misses the caches traces with ``make_fx``, whose tracer replaces
    ``torch.nn.Module.__call__`` for the whole process while it runs, so a layer called on the serving thread meanwhile
    is taken for part of the traced graph and the user's call fails (``NameError: module is not installed as a
    submodule``: H100, torch 2.11, ``benchmarks/results/stall_thread_race.log``, 2026-11-28)."""
    return False


def _plan_build(model, state, layout: tuple | None) -> tuple[bool, bool] | None:
    """What a build started now would do (``(prewarm, compile_here)``, see :func:`_next_build_step`), or None (none
    now): before the compiled tier is ready, the steps that get it ready; once it is, a build in this process of a
    layout (``(rows, levels)``) not built before, where :func:`variant_builds_possible`. Call with ``state.lock``
    held."""
    if state.building is not None or state.build_error is not None:
        return None
    if not state.ready["compiled"]:
        return _next_build_step(model, state)
    if layout is None or layout in state.variant_builds or not variant_builds_possible(state):
        return None
    return False, True


def _next_build_step(model, state) -> tuple[bool, bool] | None:
    """What the thread would do now (``(prewarm, compile_here)``: run the child; compile in this process), or None
    (nothing now). Sets ``state.thread_builds`` when a later call will start the thread. Call with ``state.lock``
    held."""
    from hf_cascade.tiers import caches_warm, expected_compile_cost

    if MODE not in MODES:
        raise ValueError(f"`hf_cascade.tier_build.MODE` must be one of {list(MODES)}; got {MODE!r}.")
    mode = MODE if threads_may_compile() else "child"
    if mode == "thread":
        return False, True
    if not caches_warm(model, state):
        return True, False  # the child fills the caches; this process compiles nothing yet
    if mode == "child":
        return None  # the caches are warm: the ski rental moves the calls up (the foreground compiles)
    if state.regret["compiled"] < expected_compile_cost(model, state):
        state.thread_builds = True  # a later call starts the thread, once the regret pays for compiling
        return None
    return False, True


def wait_for_build(model, timeout: float | None = None) -> bool:
    """Wait until ``model``'s background build (if one runs) ends; True when it ended without error (the compile
    caches are filled, or with ``MODE`` ``"child+thread"`` / ``"thread"`` the compiled tier is ready)."""
    from hf_cascade.tiers import building_state

    state = building_state(model)
    with state.lock:
        thread = state.building
    if thread is not None:
        thread.join(timeout)
    with state.lock:
        return state.building is None and state.build_error is None and (
            state.ready["compiled"] or state.caches_filled)


def _build_call(run, model, input_ids, generation_config, model_kwargs, options) -> None:
    """The build call: ``hf_cascade.generate`` of the rows, greedy, stopped after :data:`BUILD_STEPS` steps."""
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    stop_at = input_ids.shape[1] + BUILD_STEPS

    class _StopAfterBuildSteps(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            return torch.full((ids.shape[0],), ids.shape[1] >= stop_at, dtype=torch.bool, device=ids.device)

    stopping = StoppingCriteriaList([MaxLengthCriteria(generation_config.max_length), _StopAfterBuildSteps()])
    with torch.no_grad():
        run(model, input_ids, LogitsProcessorList(), stopping, generation_config, cascade_options=options,
            **model_kwargs)


def wait_for_all_builds(timeout: float | None = None) -> None:
    """Wait until every background build of this process has ended (tests; a job that wants its compile records
    written before it exits)."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    for thread in threading.enumerate():
        if thread.name == _THREAD_NAME:
            thread.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))


def _build(run, model, state, input_ids, generation_config, model_kwargs, options, inputs_ready, prewarm: bool,
           compile_here: bool) -> None:
    """The background thread: the child process that fills the compile caches (``prewarm``), or the build call in
    this process (``compile_here``)."""
    from hf_cascade.tiers import IN_BUILD

    error = prewarmed = None
    filled = False
    try:
        stream = torch.cuda.Stream(device=input_ids.device) if input_ids.is_cuda else None
        if inputs_ready is not None:
            stream.wait_event(inputs_ready)
        if prewarm:
            prewarmed = _prewarm_in_child(model, input_ids, generation_config, model_kwargs, options, stream)
            filled = prewarmed["returncode"] == 0
            if not filled:
                error = f"the child process that fills the compile caches failed: {prewarmed['error']}"
        if compile_here:
            IN_BUILD.active = True
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), _gil_switch(
                    BUILD_SWITCH_INTERVAL_S):
                _build_call(run, model, input_ids, generation_config, model_kwargs, options)
            if stream is not None:
                stream.synchronize()
    except Exception as err:  # noqa: BLE001 (a compiler error or out of memory: the calls keep the tiers they have)
        error = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        IN_BUILD.active = False
        if error is not None:
            logger.warning(f"hf_cascade: preparing the compiled tier in the background failed ({error}); the calls "
                           "move up only when the time they lost would have paid for compiling.")
        with state.lock:
            state.building = None
            state.build_error = error
            state.build_prewarm = prewarmed if prewarm else state.build_prewarm
            state.caches_filled = state.caches_filled or filled
            if error is not None:
                state.thread_builds = False  # the ski rental decides in the foreground
            state.build_s = round(time.perf_counter() - state.build_started, 3)


class _SwitchInterval:
    """The process's GIL switch interval while any build compiles in it (builds of several models may overlap)."""

    lock = threading.Lock()
    builds = 0
    previous: float | None = None


@contextlib.contextmanager
def _gil_switch(interval: float | None):
    """Set the GIL switch interval to ``interval`` seconds while inside (None: leave it); the first build in sets
    it, the last one out restores what it was."""
    if interval is None:
        yield
        return
    with _SwitchInterval.lock:
        if _SwitchInterval.builds == 0:
            _SwitchInterval.previous = sys.getswitchinterval()
            sys.setswitchinterval(interval)
        _SwitchInterval.builds += 1
    try:
        yield
    finally:
        with _SwitchInterval.lock:
            _SwitchInterval.builds -= 1
            if _SwitchInterval.builds == 0:
                sys.setswitchinterval(_SwitchInterval.previous)


def _prewarm_in_child(model, input_ids, generation_config, model_kwargs, options, stream) -> dict:
    """Run the build call in a child process on the model's config cut to :data:`PREWARM_LAYERS` layers (random
    weights), which fills the compile caches on disk this process's build then loads from. Returns ``{"seconds",
    "returncode", "error"}``; a child that fails is reported, not raised (the thread's build then compiles)."""
    import os
    import subprocess
    import tempfile

    started = time.perf_counter()
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if layers is None:
        return {"seconds": 0.0, "returncode": None, "error": "the config names no num_hidden_layers"}
    keep = min(layers, PREWARM_LAYERS)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:  # keep a layer of every type (Gemma's sliding and full layers)
        seen = []
        for index, kind in enumerate(layer_types):
            if kind not in seen:
                seen.append(kind)
                keep = max(keep, index + 1)
        text.layer_types = list(layer_types[:keep])
    text.num_hidden_layers = keep
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        spec = {"model_class": type(model), "config": config, "dtype": model.dtype,
                "device": str(input_ids.device), "input_ids": input_ids.cpu(),
                "generation_config": generation_config, "options": options,
                "model_kwargs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()}}
    with tempfile.TemporaryDirectory(prefix="hf_cascade_build_") as folder:
        path = os.path.join(folder, "spec.pt")
        try:
            torch.save(spec, path)
        except Exception as err:  # noqa: BLE001 (something in the call cannot be pickled: no child)
            return {"seconds": 0.0, "returncode": None, "error": f"{type(err).__name__}: {str(err)[:200]}"}
        try:
            done = subprocess.run([sys.executable, "-m", "hf_cascade.tier_build_child", path, str(os.getpid())],
                                  capture_output=True, text=True, timeout=PREWARM_TIMEOUT_S)
            code, tail = done.returncode, done.stderr[-400:] if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as err:
            code, tail = None, f"{type(err).__name__}: {str(err)[:200]}"
    return {"seconds": round(time.perf_counter() - started, 3), "returncode": code, "error": tail}


def _leave_with_parent(parent_pid: int) -> None:
    """In the child: low CPU priority, and end when the process that started it ends (Linux: the kernel sends
    SIGTERM; a parent already gone ends it now), so an interpreter that exits mid-build leaves no child behind."""
    import os
    import signal

    try:
        os.nice(10)
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid and os.getppid() != parent_pid:
        raise SystemExit(0)
