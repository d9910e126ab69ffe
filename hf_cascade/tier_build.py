"""The compiled tier prepared in the background: a child process fills the compile caches while the calls go on.

:mod:`hf_cascade.tiers` starts a model's calls on tiers that need no compilation. After such a call (greedy or
sampling on CUDA, default options), where the compile caches are cold, :func:`build_in_background` starts one thread
per model that runs the *build call* (the same rows again through ``hf_cascade.generate`` with
``cascade_options={"compile": "now"}``, same options, batch bucket and buffer capacity, so the same graphs; greedy;
stopped after :data:`BUILD_STEPS` decode steps) in a **child process** (:mod:`hf_cascade.tier_build_child`), on a copy
of the model's config cut to :data:`PREWARM_LAYERS` decoder layers of random weights, at low CPU priority. The layers
compile to one graph for all layers, so the cut model makes the same graphs and Triton kernels: the child fills the
Triton and Inductor caches on disk. The thread only waits for it (the GIL is free meanwhile), and the calls meanwhile
build nothing themselves (they would build what the child is building). Children run the batches of
:func:`variant_grid` (batch sizes, one to three shared levels, short and long prefixes, own tokens of several widths,
padded or not; on the eager layers beside the rows child, on the compiled layers after it; each child for at most
:data:`GRID_BUDGET_S`): the Triton kernel variants of layouts no call has run yet, which a process that had moved
up built in the call (3-10 s on a new layout's first call, H100, Llama-3-8B shape: results/stall.jsonl). Once the
call's rows are done, the compiled tier's
expected cost is what compiling from warm caches costs (:data:`~hf_cascade.tiers.WARM_COMPILE_COST_S`, or what a
process recorded), and the ski rental of :mod:`hf_cascade.tiers` moves a call up once the calls' regret reaches it:
that call compiles the layers in the foreground, from the warm caches. Where a record says the caches are warm, no
child runs and only the ski rental applies.

Nothing compiles in a thread of this process: a compile that misses the caches traces with ``make_fx``, whose tracer
replaces ``torch.nn.Module.__call__`` for the whole process while it runs, so a layer called on a serving thread
meanwhile is taken for part of the traced graph and the user's call fails (``NameError: module is not installed as a
submodule``: H100, torch 2.11, ``benchmarks/results/stall_thread_race.log``); on torch 2.13 the compile flag is
process-wide too (``torch.compiler.is_compiling()`` True in every thread). Shapes new to a ready compiled tier are
left to the calls: they run those layers uncompiled until a per-shape regret pays for compiling them in the call
(:func:`hf_cascade.tiers.shape_policy`).

What the child shares with the serving process: the GPU (it starts only where free device memory is at least
:data:`MIN_FREE_FRACTION` of the GPU and :data:`CACHE_MULTIPLE` times the call's KV); the caches on disk. A child that
fails is an error in :func:`hf_cascade.tiers.tier_report` and a warning; the calls then move up by the ski rental
alone, with the cold costs. The thread is a daemon; an interpreter that exits while it builds does not wait for it,
and the child ends with it (:func:`_leave_with_parent`). Each start is logged (``logger.info``).

Where this does not start: ``compile="now"`` / ``"never"``, beam search, CPU, a user's own cache, a call without
decode steps, warm caches, :data:`ENABLED` set False (the benchmarks compare the policies), or the environment
variable ``HF_CASCADE_BACKGROUND`` set to ``off`` (also ``0``, ``false``, ``no``; :func:`background_builds_on`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import sys
import threading
import time

import torch
from transformers.utils import logging

from hf_cascade._env import background_off
from hf_cascade.build_grid import GRID_OPTIONS, variant_grid
from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)

__all__ = ["BUILD_STEPS", "ENABLED", "GRID_BUDGET_S", "background_builds_on", "build_in_background", "describe",
           "wait_for_all_builds", "wait_for_build"]

ENABLED = True
# Decode steps of the build call: the first compiles the layers for the decode step, the next runs them again (a
# build records no CUDA graph: hf_cascade.decode.captured_step).
BUILD_STEPS = 2
MIN_FREE_FRACTION = 0.15
CACHE_MULTIPLE = 3
PREWARM_LAYERS = 2
PREWARM_TIMEOUT_S = 900
# After the call's rows, the child runs the batches of variant_grid for at most this long: the Triton kernels of
# layouts no call has run yet (each new one ~1-3 s to build, H100), so that a later call of a new layout loads them.
GRID_BUDGET_S = 240.0
GRID_PROCESSES = 6  # children that run slices of the grid at once (grid_processes)
GRID_CHILD_BYTES = 3 << 30  # GPU memory a grid child may take (the cut model, a small vocabulary, the batches)
GRID_VOCAB = 4096  # the grid children's vocabulary (the kernels do not depend on it)
_THREAD_NAME = "hf_cascade-compiled-tier"
EXIT_WAIT_S = 30.0  # at exit, the longest wait for the build thread to leave a torch call


class _Exiting(BaseException):
    """The interpreter exits: the build thread stops before its next torch call (not an ``Exception``: no
    handler of a failed build catches it)."""


class ExitGuard:
    """Ends the build thread before the interpreter does.

    A daemon thread still alive when Python finalizes is ended mid-call by ``pthread_exit``; where that call is in
    torch's C++ the process aborts (``terminate called without an active exception``, exit code 134) after the
    user's script has finished: seen on an H100 when a script made one generate() call and exited while the build
    ran. So at exit (``atexit``, while threads still run) :meth:`close` stops the children the thread waits for
    (they would end with this process anyway), lets no stretch of the thread's torch work (:meth:`section`) start
    and waits for the one in progress, and joins the thread, which then unwinds on its own (each wait: at most
    :data:`EXIT_WAIT_S`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._closed = False
        self._children: list = []
        self._thread = threading.current_thread()
        atexit.register(self.close)

    @contextlib.contextmanager
    def section(self):
        """Run torch work; raises :class:`_Exiting` (before any of it) once the interpreter exits."""
        if self._closed:  # (close holds the lock from then on)
            raise _Exiting()
        with self._lock:
            if self._closed:
                raise _Exiting()
            yield

    def track(self, children: list) -> list:
        """Children that :meth:`close` stops (:func:`_start_children`'s ``(Popen, ...)`` tuples); returns
        ``children``."""
        self._children.extend(children)
        if self._closed:
            self._stop_children()
        return children

    def done(self) -> None:
        """The thread's build ended on its own: nothing to stop at exit (the handler goes, with what it holds)."""
        if not self._closed:
            atexit.unregister(self.close)

    def close(self) -> None:
        self._closed = True
        self._stop_children()
        self._lock.acquire(timeout=EXIT_WAIT_S)  # held from now on: no section starts again
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(EXIT_WAIT_S)

    def _stop_children(self) -> None:
        for child, *_files in self._children:
            if hasattr(child, "poll") and child.poll() is None:  # (an OSError: it never started)
                child.kill()


def background_builds_on() -> bool:
    """Whether background builds may start: :data:`ENABLED`, and ``HF_CASCADE_BACKGROUND`` is not ``off``."""
    return ENABLED and not background_off()


def describe() -> str:
    """One line on the background builds of this process (``python -m hf_cascade info``)."""
    rental = ("the call that moves up compiles; calls of shapes new to the compiled tier run them uncompiled until "
              "the time lost pays for compiling them")
    if not background_builds_on():
        return f"off (HF_CASCADE_BACKGROUND=off or tier_build.ENABLED False): calls move up by the ski rental; {rental}"
    return (f"on (HF_CASCADE_BACKGROUND=off turns it off): a child process fills the compile caches for the call's "
            f"rows, then for a grid of other layouts (no thread compiles); {rental}")


def build_in_background(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict,
                        cascade_options: dict | None, batch_buckets: bool, cache_nbytes: int) -> bool:
    """Start filling the compile caches for ``model``'s compiled tier from the rows of the call that just ran: a
    thread that runs the build call in a child process (module docstring).

    Args:
        model: the model of the call (on CUDA).
        input_ids: ``[B, L]`` int64, the rows as generate() handed them to ``hf_cascade.generate``.
        generation_config: the call's generation config (copied; the build is greedy).
        model_kwargs: the call's model kwargs as handed in (tensors copied; its cache and streamer left out).
        cascade_options: the user's ``cascade_options`` (the build adds ``compile="now"`` and ``batch_buckets``).
        batch_buckets: whether the call added rows up to a batch bucket (the build does the same).
        cache_nbytes: bytes of the call's KV (the memory check).
    Returns:
        Whether a build started (False: one is running or done or failed for this model, the compiled tier is
        ready, the caches are warm, or it would not fit).
    """
    from hf_cascade.tiers import tier_state

    if not background_builds_on() or input_ids.device.type != "cuda":
        return False
    state = tier_state(model)
    with state.lock:
        if not _plan_build(model, state):
            return False
        device = input_ids.device
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free < max(MIN_FREE_FRACTION * total, CACHE_MULTIPLE * cache_nbytes):
            return False
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
        thread = threading.Thread(target=_build, args=(model, state, ids, config, kwargs, options, inputs_ready),
                                  name=_THREAD_NAME, daemon=True)
        state.building = thread
        state.build_started = time.perf_counter()
    logger.info("hf_cascade: a child process fills the compile caches for the compiled tier in the background "
                "(HF_CASCADE_BACKGROUND=off: none).")
    thread.start()
    return True


def _plan_build(model, state) -> bool:
    """Whether a build may start now: none runs or failed, the compiled tier is not ready and the compile caches
    are cold (warm ones: the ski rental moves the calls up with the warm cost). Call with ``state.lock`` held."""
    from hf_cascade.tiers import caches_warm

    return (state.building is None and state.build_error is None and not state.ready["compiled"]
            and not caches_warm(model, state))


def wait_for_build(model, timeout: float | None = None) -> bool:
    """Wait until ``model``'s background build (if one runs) ends; True when it ended without error (the compile
    caches are filled, or the compiled tier is ready)."""
    from hf_cascade.tiers import tier_state

    state = tier_state(model)
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


def _build(model, state, input_ids, generation_config, model_kwargs, options, inputs_ready) -> None:
    """The background thread: the child process that fills the compile caches; its outcome on ``state``. The
    caches count as filled once the child has run the call's rows (it goes on with :func:`variant_grid`)."""
    error = prewarmed = None
    filled = False

    def rows_done():  # the calls may move up now (from warm caches); the child goes on with the grid
        with state.lock:
            state.caches_filled, state.building, state.grid_running = True, None, True
            state.build_s = round(time.perf_counter() - state.build_started, 3)

    guard = ExitGuard()
    try:
        with guard.section():
            stream = torch.cuda.Stream(device=input_ids.device) if input_ids.is_cuda else None
            if inputs_ready is not None:
                stream.wait_event(inputs_ready)
            grid = variant_grid(model, input_ids, generation_config) if input_ids.is_cuda else None
        prewarmed = _prewarm_in_child(model, input_ids, generation_config, model_kwargs, options, stream,
                                      grid=grid, on_rows_done=rows_done, guard=guard)
        filled = prewarmed["returncode"] == 0  # (the rows child's: its grid children do not count)
        if not filled:
            error = f"the child process that fills the compile caches failed: {prewarmed['error']}"
    except _Exiting:  # the interpreter exits: nothing to report
        return
    except Exception as err:  # noqa: BLE001 (out of memory, a spec that cannot be written: the calls go on)
        error = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        guard.done()
        if error is not None:
            logger.warning(f"hf_cascade: preparing the compiled tier in the background failed ({error}); the calls "
                           "move up only when the time they lost would have paid for compiling.")
        with state.lock:
            state.building, state.grid_running = None, False
            state.build_error = error
            state.build_prewarm = prewarmed if prewarmed is not None else state.build_prewarm
            if not state.caches_filled:
                state.build_s = round(time.perf_counter() - state.build_started, 3)
            state.caches_filled = state.caches_filled or filled


def _prewarm_in_child(model, input_ids, generation_config, model_kwargs, options, stream, *, grid=None,
                      on_rows_done=None, guard: ExitGuard | None = None) -> dict:
    """Run the build call in a child process on the model's config cut to :data:`PREWARM_LAYERS` layers (random
    weights), which fills the compile caches on disk this process's build then loads from; then, where ``grid`` (a
    list of ``(input_ids, attention_mask)``, :func:`variant_grid`) is given, the same call for each of those batches
    in children that run slices of the grid (:func:`_start_grid`: the eager-layer runs beside the rows child, the
    compiled-layer runs after it; the cut model's vocabulary cut to :data:`GRID_VOCAB` too), each for at most
    :data:`GRID_BUDGET_S`. ``on_rows_done()`` runs once the call's own rows are done. Returns ``{"seconds",
    "returncode", "error", "rows_done", "grid": {"processes", "batches", "done", "failed", "seconds_after_rows"}}``;
    a child that fails is reported, not raised (the calls then move up with the cold costs). ``guard``: the
    :class:`ExitGuard` the torch work runs in (a thread's; None: this thread needs none)."""
    import os
    import tempfile

    section = guard.section if guard is not None else contextlib.nullcontext
    started = time.perf_counter()
    config = _cut_config(model.config)
    if config is None:
        return {"seconds": 0.0, "returncode": None, "error": "the config names no num_hidden_layers"}
    with section(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        spec = {"model_class": type(model), "config": config, "dtype": model.dtype,
                "device": str(input_ids.device), "input_ids": input_ids.cpu(),
                "generation_config": generation_config, "options": options,
                "model_kwargs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()},
                "rows": True, "grid": [], "grid_budget_s": GRID_BUDGET_S, "grid_options": GRID_OPTIONS}
    with tempfile.TemporaryDirectory(prefix="hf_cascade_build_") as folder:
        try:
            path = os.path.join(folder, "rows.pt")
            with section():
                torch.save(spec, path)
        except Exception as err:  # noqa: BLE001 (something in the call cannot be pickled: no child)
            return {"seconds": 0.0, "returncode": None, "error": f"{type(err).__name__}: {str(err)[:200]}"}
        deadline = time.perf_counter() + PREWARM_TIMEOUT_S
        track = guard.track if guard is not None else (lambda children: children)
        rows = track(_start_children([path]))
        # The grid's eager-layer runs need no Inductor cache: they start beside the rows child; the compiled-layer
        # runs start once it has filled that cache (a compile of their own would duplicate its work).
        with section():
            grid_spec = _grid_spec(spec, grid) if grid else None
            early = track(_start_grid(folder, grid_spec, input_ids.device, eager=True) if grid else [])
        code, _, tail = _wait_children(rows, deadline)[0]
        outcome = {"returncode": code, "error": tail, "rows_done": code == 0}
        if code == 0 and on_rows_done is not None:
            on_rows_done()
        with section():
            late = track(_start_grid(folder, grid_spec, input_ids.device, eager=False, beside=len(early))
                         if code == 0 and grid else [])
        if grid:
            grid_started = time.perf_counter()
            outcome["grid"] = _grid_summary(_wait_children(early + late, deadline), len(early) + len(late))
            outcome["grid"]["seconds_after_rows"] = round(time.perf_counter() - grid_started, 3)
    return {"seconds": round(time.perf_counter() - started, 3), **outcome}


def _cut_config(config):
    """A copy of ``config`` cut to :data:`PREWARM_LAYERS` decoder layers (one of every layer type at least), or None
    where it names no layer count."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if layers is None:
        return None
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
    return config


def grid_processes(device: torch.device, beside: int = 0) -> int:
    """Children that may run grid slices now, ``beside`` such children (or the rows child) already running: at most
    :data:`GRID_PROCESSES` in all, one per 2 CPU cores, and as many as fit in :data:`GRID_CHILD_BYTES` each of the
    GPU's free memory beyond :data:`MIN_FREE_FRACTION` of it."""
    import os

    count = min(GRID_PROCESSES, max(1, (os.cpu_count() or 2) // 2)) - beside
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        count = min(count, int((free - MIN_FREE_FRACTION * total) // GRID_CHILD_BYTES) - beside)
    return max(count, 0)


def _grid_spec(spec: dict, grid) -> dict:
    """The grid children's spec: the rows child's ``spec`` on the cut model with its vocabulary cut to
    :data:`GRID_VOCAB` (the kernels do not depend on it: token ids taken modulo it), no rows, ``grid``'s batches."""
    config = copy.deepcopy(spec["config"])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = min(GRID_VOCAB, int(getattr(text, "vocab_size", GRID_VOCAB) or GRID_VOCAB))
    text.vocab_size = vocab
    return {**spec, "config": config, "rows": False, "grid": [(ids % vocab, mask) for ids, mask in grid]}


def _start_grid(folder: str, grid_spec: dict, device: torch.device, *, eager: bool, beside: int = 0) -> list:
    """Start the grid's runs on one kind of path (``eager``: the :data:`GRID_OPTIONS` that compile nothing; else
    those that compile the layers) in slices of ``grid_spec``'s batches (:func:`_grid_spec`), one child each: half of
    :func:`grid_processes` beside the rows child, else what it allows ``beside`` the children still running."""
    import os

    paths = [o for o in GRID_OPTIONS if (o.get("compile") != "now") == eager]
    count = max(1, grid_processes(device, beside=1) // 2) if eager else grid_processes(device, beside=beside)
    if not paths or count == 0:
        return []
    files = []
    for index in range(count):
        files.append(os.path.join(folder, f"grid_{'eager' if eager else 'compiled'}{index}.pt"))
        torch.save({**grid_spec, "grid": grid_spec["grid"][index::count], "grid_options": paths}, files[-1])
    return _start_children(files)


def _grid_summary(results: list[tuple], processes: int) -> dict:
    """``{"processes", "batches", "done", "failed"}`` from the grid children's report lines."""
    summary = {"processes": processes, "batches": 0, "done": 0, "failed": 0}
    for _, out, _ in results:
        for line in out.splitlines():
            kind = line.split(" ", 1)[0]
            if kind in ("GRID_DONE", "GRID_FAILED"):
                summary["done" if kind == "GRID_DONE" else "failed"] += 1
            elif kind == "GRID_END":
                summary["batches"] += int(float(line.split()[1]))
    return summary


def _start_children(spec_paths: list[str]) -> list[tuple]:
    """Start one child per spec (``python -m hf_cascade.tier_build_child SPEC PARENT``, its output to files next to
    the spec): ``(Popen or the OSError that stopped it, stdout file, stderr file)`` each."""
    import os
    import subprocess

    from hf_cascade.ops._backend import keyed_ptxas

    env = dict(os.environ)
    try:
        ptxas = keyed_ptxas()  # the children key their kernels as this process does, or it builds them again
    except Exception:  # noqa: BLE001 (a diagnosis of Triton's internals must never stop the build)
        ptxas = None
    if ptxas is not None:
        env["TRITON_PTXAS_PATH"] = ptxas
    children = []
    for path in spec_paths:
        stdout, stderr = open(f"{path}.out", "w+"), open(f"{path}.err", "w+")
        try:
            child = subprocess.Popen([sys.executable, "-m", "hf_cascade.tier_build_child", path, str(os.getpid())],
                                     stdout=stdout, stderr=stderr, text=True, env=env)
        except OSError as err:
            child = err
        children.append((child, stdout, stderr))
    return children


def _wait_children(children: list[tuple], deadline: float) -> list[tuple]:
    """Wait for children of :func:`_start_children`, each killed past ``deadline`` (``time.perf_counter()``); per
    child ``(returncode or None, stdout, stderr's tail where it failed)``."""
    import subprocess

    out = []
    for child, stdout, stderr in children:
        if isinstance(child, OSError):
            out.append((None, "", f"{type(child).__name__}: {str(child)[:200]}"))
            continue
        try:
            code = child.wait(max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
        stdout.seek(0)
        stderr.seek(0)
        out.append((code, stdout.read(), stderr.read()[-400:] if code else None))
        stdout.close()
        stderr.close()
    return out


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
