"""The next tier prepared in the background: child processes fill the compile caches while the calls go on.

After a call on a tier below the one it could reach (greedy or sampling on CUDA, default options, cold caches),
:func:`build_in_background` starts a **rows child** (:mod:`hf_cascade.tier_build_child`, nice 19) that runs
the call's rows again through ``hf_cascade.generate`` on the model's config cut to :data:`PREWARM_LAYERS` layers of
random weights (the layers compile to one graph for all layers, so the cut model makes the same graphs and Triton
kernels), greedy, :data:`~hf_cascade.tier_build_child.BUILD_STEPS` decode steps: with ``compile="now"`` for the
compiled tier, or :data:`TRITON_BUILD_OPTIONS` (Triton kernels, recorded steps, nothing compiled) where the calls'
step may not compile (TRL's ``disable_compile=True``). **Grid children** run slices of
:func:`~hf_cascade.build_grid.variant_grid` (other batch layouts, whose Triton kernel variants a later call would
otherwise build: 1-3 s each on an H100) for at most :data:`GRID_BUDGET_S`, on the eager layers beside the rows child
and on the compiled layers after it.

No thread waits for the children: a :class:`BackgroundBuild` holds them and each call's tier choice polls it (a
``waitpid`` per child). While the rows child runs the calls build nothing themselves; once it is done the tier's
expected cost is the warm one (:mod:`hf_cascade.tiers`) and the call that moves up compiles from the warm caches, in
the foreground (nothing compiles beside a serving thread: torch's tracer patches ``nn.Module.__call__`` process-wide).
The children need room on the GPU (:data:`MIN_FREE_FRACTION`, :data:`CACHE_MULTIPLE`), end with their parent
(``PR_SET_PDEATHSIG``), and a failure is a warning and an error in :func:`~hf_cascade.tiers.tier_report`: the calls
then move up by the ski rental alone. Off with ``HF_CASCADE_BACKGROUND=off`` (read at every call), and with
``compile="now"`` / ``"never"``, beam search, CPU, a user's cache, warm caches. More: ``docs/internals.md``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers.utils import logging

from hf_cascade._env import background_off
from hf_cascade.build_grid import GRID_OPTIONS
from hf_cascade.transformers_compat import CACHE_KWARG, text_config

logger = logging.get_logger(__name__)

__all__ = ["BackgroundBuild", "GRID_BUDGET_S", "background_builds_on", "build_in_background",
           "describe", "start_build", "wait_for_build"]

MIN_FREE_FRACTION = 0.15
CACHE_MULTIPLE = 3
PREWARM_LAYERS = 2
PREWARM_TIMEOUT_S = 900
# After the call's rows, the children run the batches of variant_grid for at most this long: the Triton kernels of
# layouts no call has run yet (each new one ~1-3 s to build, H100), so that a later call of a new layout loads them.
GRID_BUDGET_S = 240.0
# Children that run slices of the grid at once (grid_processes). H200, Llama-3-8B shape, fresh machines: 3 ended the
# grid's 672 runs 38.2 s after the rows child, 6 in 39.5-46.8 s (three runs): more children only contend (the
# stream's largest calls beside 6 took up to 2.1-2.4x their steady time; beside 3 at most 1.8x, one run in which
# the 80-row layouts came after the grid; results/stall.jsonl).
GRID_PROCESSES = 3
GRID_CHILD_BYTES = 3 << 30  # GPU memory a grid child may take (the cut model, a small vocabulary, the batches)
GRID_VOCAB = 4096  # the grid children's vocabulary (the kernels do not depend on it)
# The build call of a build for the Triton tier (calls that may not compile): Triton kernels, steps recorded into CUDA
# graphs (the grid's eager path, GRID_OPTIONS), nothing compiled.
TRITON_BUILD_OPTIONS = {"compile": "never", "decode_step": "graphs"}


def background_builds_on() -> bool:
    """Whether background builds may start: ``HF_CASCADE_BACKGROUND`` is not ``off`` (read at every call)."""
    return not background_off()


def describe() -> str:
    """One line on the background builds of this process (``python -m hf_cascade info``)."""
    rental = ("the call that moves up compiles; calls of shapes new to the compiled tier run them uncompiled until "
              "the time lost pays for compiling them")
    if not background_builds_on():
        return f"off (HF_CASCADE_BACKGROUND=off): calls move up by the ski rental; {rental}"
    return (f"on (HF_CASCADE_BACKGROUND=off turns it off): after the first call, child processes fill the compile "
            f"caches for its rows, then for a grid of other layouts (no thread; nothing compiles outside a call); "
            f"{rental}")


class BackgroundBuild:
    """One model's background build: the rows child (``ROWS_DONE`` once it has run the call's rows) and the grid's
    children, advanced by :meth:`poll` from the calls (no thread waits for them).

    Args:
        rows: ``[(Popen or OSError, stdout file, stderr file)]`` of the rows child (:func:`_start_children`).
        early: the grid children started beside it (same form).
        start_late: called once the rows child has succeeded, with the number of early children still running;
            returns the grid children that compile the layers (they read the Inductor cache the rows child filled).
        folder: the spec files' temporary folder (removed once every child has ended).
        compiled: whether the build call compiles the layers (else it fills the Triton tier's kernels only).
    """

    def __init__(self, rows: list, early: list = (), start_late=None, folder=None, compiled: bool = True):
        self.started = time.perf_counter()
        self.deadline = self.started + PREWARM_TIMEOUT_S
        self._lock = threading.Lock()  # calls of several threads poll it
        self.rows, self.grid, self._start_late, self._folder = rows, list(early), start_late, folder
        self.early = len(self.grid)
        self.compiled = compiled  # the build call compiled the layers (else: the Triton tier's kernels only)
        self.rows_outcome: tuple | None = None  # (returncode, stdout, stderr's tail where it failed)
        self.rows_s: float | None = None
        self.summary: dict | None = None  # once every child has ended (tier_report's "prewarm")

    @classmethod
    def failed(cls, error: str) -> "BackgroundBuild":
        """A build that could not start (``error`` says why): reported as failed, never tried again."""
        logger.warning(f"hf_cascade: no background build ({error}); the calls move up only when the time they lost "
                       "would have paid for building the next tier.")
        build = cls([])
        build.rows_outcome, build.rows_s = (None, "", error), 0.0
        build.summary = {"seconds": 0.0, "returncode": None, "error": error, "rows_done": False}
        return build

    @property
    def rows_running(self) -> bool:
        return self.rows_outcome is None

    @property
    def caches_filled(self) -> bool:
        """The rows child succeeded: the compile caches hold the call's graphs and kernels."""
        return self.rows_outcome is not None and self.rows_outcome[0] == 0

    @property
    def error(self) -> str | None:
        if self.rows_outcome is None or self.rows_outcome[0] == 0:
            return None
        if not self.rows:
            return self.rows_outcome[2]
        return f"the child process that fills the compile caches failed: {self.rows_outcome[2]}"

    def poll(self) -> None:
        """Take in the children that have ended (a child past :data:`PREWARM_TIMEOUT_S` is killed); once the rows
        child has succeeded, start the compiled-layer grid children; once all have ended, the summary."""
        if self.summary is not None:
            return
        with self._lock:
            if self.summary is None:
                self._advance()

    def _advance(self) -> None:
        if self.rows_outcome is None:
            if not _ended(self.rows, self.deadline):
                return
            self.rows_outcome = _collect(self.rows)[0] if self.rows else (None, "", "no rows child was started")
            self.rows_s = round(time.perf_counter() - self.started, 3)
            if self.caches_filled and self._start_late is not None:
                try:
                    self.grid += self._start_late(sum(1 for c, *_ in self.grid if _running(c)))
                except Exception as err:  # noqa: BLE001 (a spec that cannot be written: the calls must go on)
                    logger.warning(f"hf_cascade: the compiled-layer grid of the background build did not start "
                                   f"({type(err).__name__}: {str(err)[:200]}).")
            elif not self.caches_filled:
                logger.warning(f"hf_cascade: preparing the compiled tier in the background failed ({self.error}); "
                               "the calls move up only when the time they lost would have paid for compiling.")
        if not _ended(self.grid, self.deadline):
            return
        code, _, tail = self.rows_outcome
        self.summary = {"seconds": round(time.perf_counter() - self.started, 3), "returncode": code, "error": tail,
                        "rows_done": code == 0}
        if self.early or len(self.grid):
            self.summary["grid"] = _grid_summary(_collect(self.grid), len(self.grid))
            self.summary["grid"]["seconds_after_rows"] = round(self.summary["seconds"] - self.rows_s, 3)
        if self._folder is not None:
            self._folder.cleanup()

    def wait(self, timeout: float | None = None, progress: bool = False) -> bool:
        """Poll until every child has ended (or ``timeout`` seconds); True when they have. ``progress``: a tqdm bar
        over the children (``warmup``)."""
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.perf_counter() + timeout
        bar = tqdm(total=1, unit="child", desc="background build", disable=not progress, dynamic_ncols=True)
        self.poll()
        while self.summary is None and (deadline is None or time.perf_counter() < deadline):
            time.sleep(0.05)
            self.poll()
            children = self.rows + self.grid
            ended = sum(1 for child, *_ in children if not _running(child))
            if (bar.n, bar.total) != (ended, len(children)):
                bar.total, bar.n = len(children), ended
                bar.set_postfix_str("rows" if self.rows_running else "grid")
        bar.close()
        return self.summary is not None

    def report(self) -> dict:
        """``{"running" (the rows child), "seconds" (until it ended), "error", "prewarm" (the summary once every child
        ended), "caches_filled", "grid_running"}``."""
        self.poll()
        return {"running": self.rows_running, "seconds": self.rows_s, "error": self.error, "prewarm": self.summary,
                "caches_filled": self.caches_filled, "grid_running": not self.rows_running and self.summary is None}


def build_in_background(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict,
                        cascade_options: dict | None, batch_buckets: bool, cache_nbytes: int,
                        tier: str = "compiled") -> bool:
    """Start the background build for ``model``'s ``tier`` (``"compiled"``, or ``"triton"`` for calls that may not
    compile) from the call that just ran, on ``model``'s tier state (module docstring). ``input_ids [B, L]`` int64:
    the rows as generate() handed them to ``hf_cascade.generate``; ``generation_config`` (copied; the build is
    greedy), ``model_kwargs`` (tensors copied to the CPU; cache and streamer left out) and ``cascade_options``: the
    call's; ``batch_buckets``: whether the call added rows up to a bucket; ``cache_nbytes``: its KV's bytes (the
    memory check). Returns whether a build started (not where one ran for this model already, the tier is ready,
    the caches are warm or it would not fit)."""
    from hf_cascade.tiers import caches_warm, tier_state

    if not background_builds_on() or input_ids.device.type != "cuda":
        return False
    state = tier_state(model)
    with state.lock:
        if state.build is not None or state.ready[tier] or caches_warm(model, state, tier):
            return False
        free, total = torch.cuda.mem_get_info(input_ids.device)
        free += torch.cuda.memory_reserved(input_ids.device) - torch.cuda.memory_allocated(input_ids.device)
        if free < max(MIN_FREE_FRACTION * total, CACHE_MULTIPLE * cache_nbytes):
            return False
        path = {"compile": "now"} if tier == "compiled" else TRITON_BUILD_OPTIONS
        options = {**(cascade_options or {}), **path, "batch_buckets": batch_buckets}
        state.build = start_build(model, input_ids, generation_config, model_kwargs, options,
                                  compiled=tier == "compiled")
        children = len(state.build.rows) + len(state.build.grid)
    if not children:  # (it could not start: BackgroundBuild.failed warned)
        return False
    # Visible at transformers' default verbosity: processes on the user's GPU that they did not start must be said.
    more = f", more once the first is done (at most {GRID_PROCESSES} at once)" if tier == "compiled" else ""
    logger.warning(f"hf_cascade: {children} low-priority child process(es) now build the {tier} tier's kernels in "
                   f"the background{more}; they end within {PREWARM_TIMEOUT_S // 60} min. HF_CASCADE_BACKGROUND=off "
                   "turns this off; `python -m hf_cascade info` describes it.")
    return True


def start_build(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict, options: dict, *,
                grid: bool = True, grid_batches: list | None = None, grid_budget_s: float | None = None,
                compiled: bool = True) -> BackgroundBuild:
    """Start the rows child (the build call on the model cut to :data:`PREWARM_LAYERS` layers, random weights) and,
    with ``grid``, the grid's children: beside it on the eager layers, after it on the compiled ones (not where
    ``compiled`` is False: a build for the Triton tier). ``grid_batches``: the grid's ``(input_ids, attention_mask)``
    batches instead of the children's own :func:`variant_grid` (``warmup``); ``grid_budget_s``: each grid child's
    longest run (default :data:`GRID_BUDGET_S`). A :meth:`BackgroundBuild.failed` build where the config names no
    layer count or the spec cannot be written."""
    config = _cut_config(model.config)
    if config is None:
        return BackgroundBuild.failed("the config names no num_hidden_layers")
    generation_config = copy.deepcopy(generation_config)
    for name, value in (("do_sample", False), ("num_beams", 1), ("return_dict_in_generate", False),
                        ("output_scores", False), ("output_logits", False)):
        setattr(generation_config, name, value)
    spec = {"model_class": type(model), "config": config, "dtype": model.dtype, "device": str(input_ids.device),
            "input_ids": input_ids.cpu(), "generation_config": generation_config, "options": options,
            "model_kwargs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()
                             if k not in (CACHE_KWARG, "streamer")},
            "rows": True, "grid": None,
            "grid_budget_s": GRID_BUDGET_S if grid_budget_s is None else grid_budget_s, "grid_options": GRID_OPTIONS}
    folder = tempfile.TemporaryDirectory(prefix="hf_cascade_build_")
    try:
        path = os.path.join(folder.name, "rows.pt")
        torch.save(spec, path)
        if grid:
            grid_spec = _grid_spec(spec, grid_batches)
            early = _start_grid(folder.name, grid_spec, input_ids.device, eager=True)
    except Exception as err:  # noqa: BLE001 (something in the call cannot be pickled: no child)
        folder.cleanup()
        return BackgroundBuild.failed(f"{type(err).__name__}: {str(err)[:200]}")
    rows = _start_children([path])
    if not grid or not compiled:
        return BackgroundBuild(rows, early if grid else [], folder=folder, compiled=compiled)

    def start_late(running: int) -> list:
        return _start_grid(folder.name, grid_spec, input_ids.device, eager=False, beside=running)

    return BackgroundBuild(rows, early, start_late, folder)


def wait_for_build(model, timeout: float | None = None) -> bool:
    """Wait until every child of ``model``'s background build (if one started) has ended; True when the build
    filled the compile caches (or the compiled tier is ready) without error."""
    from hf_cascade.tiers import tier_state

    state = tier_state(model)
    build = state.build
    if build is not None:
        build.wait(timeout)
    with state.lock:
        return state.ready["compiled"] or (build is not None and build.summary is not None and build.caches_filled)


def _cut_config(config):
    """A copy of ``config`` cut to :data:`PREWARM_LAYERS` decoder layers (one of every layer type at least), or None
    where it names no layer count."""
    config = copy.deepcopy(config)
    text = text_config(config)
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
    count = min(GRID_PROCESSES, max(1, (os.cpu_count() or 2) // 2)) - beside
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        count = min(count, int((free - MIN_FREE_FRACTION * total) // GRID_CHILD_BYTES) - beside)
    return max(count, 0)


def _grid_spec(spec: dict, batches: list | None) -> dict:
    """The grid children's spec: the rows child's ``spec`` with the cut model's vocabulary cut to :data:`GRID_VOCAB`
    (the kernels do not depend on it), no rows; ``batches`` (token ids taken modulo it) or None (each child makes
    its slice of :func:`variant_grid`)."""
    config = copy.deepcopy(spec["config"])
    text = text_config(config)
    vocab = min(GRID_VOCAB, int(getattr(text, "vocab_size", GRID_VOCAB) or GRID_VOCAB))
    text.vocab_size = vocab
    grid = None if batches is None else [(ids % vocab, mask) for ids, mask in batches]
    return {**spec, "config": config, "rows": False, "grid": grid}


def _start_grid(folder: str, grid_spec: dict, device: torch.device, *, eager: bool, beside: int = 0) -> list:
    """Start the grid's runs on one kind of path (``eager``: the :data:`GRID_OPTIONS` that compile nothing; else
    those that compile the layers) in slices of the grid, one child each (``grid_slice``: its index and the count):
    half of :func:`grid_processes` beside the rows child, else what it allows ``beside`` the children running."""
    paths = [o for o in GRID_OPTIONS if (o.get("compile") != "now") == eager]
    count = max(1, grid_processes(device, beside=1) // 2) if eager else grid_processes(device, beside=beside)
    if not paths or count == 0:
        return []
    files = []
    for index in range(count):
        files.append(os.path.join(folder, f"grid_{'eager' if eager else 'compiled'}{index}.pt"))
        torch.save({**grid_spec, "grid_slice": (index, count), "grid_options": paths}, files[-1])
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


def _running(child) -> bool:
    return not isinstance(child, OSError) and child.poll() is None


def _ended(children: list[tuple], deadline: float) -> bool:
    """Whether every child has ended (without waiting); a child still running past ``deadline`` is killed."""
    running = [child for child, *_ in children if _running(child)]
    if running and time.perf_counter() > deadline:
        for child in running:
            child.kill()
            child.wait()
        return True
    return not running


def _collect(children: list[tuple]) -> list[tuple]:
    """Per ended child ``(returncode or None, stdout, stderr's tail where it failed)``; its files closed."""
    out = []
    for child, stdout, stderr in children:
        if isinstance(child, OSError):
            out.append((None, "", f"{type(child).__name__}: {str(child)[:200]}"))
            continue
        code = child.wait()
        stdout.seek(0)
        stderr.seek(0)
        out.append((code, stdout.read(), stderr.read()[-400:] if code else None))
        stdout.close()
        stderr.close()
    return out
