"""Which engine a generate() call runs on a GPU, so that no call waits for a compiler it would not win back.

Three tiers, each faster once ready and each costing more to get ready:

``builtin``
    Attention by kernels that ship compiled inside PyTorch (FlashAttention-2 and matmuls,
    :mod:`hf_cascade.ops.builtin_cascade`), decode steps recorded into CUDA graphs
    (:mod:`hf_cascade.decode.captured_step`), the model's layers eager. Nothing is compiled: ready at once.
``triton``
    hf_cascade's Triton kernels instead. Triton builds each kernel the first time a process launches it, about a
    second each with an empty Triton cache; from a warm cache it loads them in milliseconds.
``compiled``
    The decoder layers compiled by ``torch.compile`` for the decode step and the prefill
    (:mod:`hf_cascade.compiled_layers`): the model's small kernels fused, ~20% off a decode step (Llama-3-8B shape,
    H100), after 10-25 s of compilation with empty caches, 7-10 s in a new process with warm ones.

The policy (``cascade_options={"compile": "auto"}``, the default) is ski rental: a call runs the best tier that is
ready; each call run below a tier adds what that tier would have saved (a fixed fraction of the call's seconds,
measured: :data:`SAVED_FRACTION`) to the tier's *regret*, and the next call moves up once the regret reaches the
tier's expected cost. So the time lost to waiting is never more than the time the compiler would have taken, and
the time spent compiling is never more than what a slower tier already lost (at most twice the better of the two
choices, whatever calls come later). Where a record says this machine built the Triton kernels before, their
expected cost is what an earlier process's first Triton call cost beyond its second (else
:data:`RECORDED_TRITON_COST_S`): the Triton tier comes after a call or a few.

Expected costs come from **records on disk** (``$HF_CASCADE_RECORDS``, else ``$HF_CASCADE_CACHE/compile_records``,
else ``~/.cache/hf_cascade/compile_records``), one per model shape, dtype, GPU, versions and compile-cache folders: what
an earlier process measured when it moved up. Pointing the compile caches at a new folder (``TRITON_CACHE_DIR``,
``TORCHINDUCTOR_CACHE_DIR``) starts from no record. ``python -m hf_cascade warmup --model PATH`` compiles every
tier ahead (for images and CI) and writes the records.

**In the background** (:mod:`hf_cascade.tier_build`): after the first call that could use the compiled tier, where
the compile caches are cold, a child process runs that call's rows on the model cut to two layers and fills them
while the calls go on below (they build nothing themselves meanwhile; no thread: each tier choice asks the child
where it stands); then the expected cost is what compiling
from warm caches costs (:data:`WARM_COMPILE_COST_S`, or what a process recorded), and the call that moves up
compiles the layers from the warm caches.

**Shapes new to the compiled tier** (:func:`shape_policy`): once the compiled tier is ready, a call whose shapes the
compiled layers were not compiled for (the decode step's graph is specialised to the batch size until a second one
makes it symbolic; a prefill forward of a new kind) does not compile them: those layer calls run uncompiled
(:class:`~hf_cascade.compiled_layers.NewShapes`). A ski rental per shape: such a call adds what compiling
would have saved it to a regret, and once the regret reaches :data:`NEW_SHAPES_COST_S` the next call compiles what
it needs itself (and clears the regret).

``compile="now"`` runs the compiled tier from the first call (the old default: the first call compiles; so do calls
of new shapes); ``compile="never"`` never compiles the layers (Triton kernels when ready, by the same rule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
import time
import warnings

import torch

from hf_cascade._env import cache_root, is_off
from hf_cascade.compiled_layers import NewShapes
from hf_cascade.engine import engine_of
from hf_cascade.options import COMPILE_CHOICES

__all__ = ["COMPILE_CHOICES", "NEW_SHAPES_COST_S", "SAVED_FRACTION", "Tier", "choose_tier", "note_caches_warm",
           "raise_regret", "record_call", "shape_policy", "tier_report", "tier_state"]



# What each tier saves over the one below it, as a fraction of a call's seconds there (Llama-3-8B shape, H100,
# benchmarks/results/first_call.jsonl: a stream of 12 layouts ran 1.0-2.5 s per batch on the built-in tier and
# 0.65-1.1 s compiled, about half; a decode step 10.3 -> 8.1 ms with the layers compiled, and a step's attention
# ~4x faster on the Triton kernels than on the built-in ones: probe_builtin_attention.jsonl).
SAVED_FRACTION = {"triton": 0.25, "compiled": 0.20}
# Expected seconds to get a tier ready when no record says otherwise (H100, empty caches:
# benchmarks/results/first_call.jsonl): Triton builds ~1 s per kernel, several kernels per layout; compiling the
# layers of an 8B model for the prefill and the decode step.
DEFAULT_COST_S = {"triton": 8.0, "compiled": 20.0}
# The Triton tier where a record says this machine built its kernels: loading them costs milliseconds, but a call
# of another shape can still need a few new specialisations (~1 s each): measured 2.6 s for a first call of ragged
# chat rows after a warm-up of plain batches (benchmarks/results/first_call.jsonl), against 0.75 s built-in.
# A process whose first Triton call loaded built kernels records what that call cost beyond the next one, and later
# processes expect that instead (H100, Llama-3-8B shape: 1.47 s against 0.83 s after, kernels built for the same
# call: results/probe_warm_compile.jsonl; 3.7-5.1 s where the warm-up had built only the compiled tier's
# specialisations: first_call.jsonl).
RECORDED_TRITON_COST_S = 1.0
# What Triton's first launch in a process costs on top of any recorded cost while its cache key is not hashed yet
# (it hashes its 0.5 GB library: 0.37-0.47 s on the H100 machine, results/probe_warm_compile.jsonl). A record's cost
# comes from a process whose key was hashed already (its first Triton call came after built-in calls), so a new
# process's first call would otherwise take the Triton tier at once and wait for the hashing: chat48 on warm caches
# 1.13 s against 0.81 s built-in (results/first_call.jsonl). The hashing runs in the background from the first call
# (ops._backend.prepare_triton), so from the second call on this is 0.
TRITON_KEY_COST_S = 0.4
# The compiled tier where the caches are warm but no process recorded what its first compiled call cost (a background
# child or `warmup` filled them): H100, Llama-3-8B shape, a fresh process's first compiled call on warm caches took
# 10.0 s against 0.64 s after (imports of the compile stack ~5 s, dynamo's tracing 3.6 s:
# benchmarks/results/probe_warm_compile.jsonl), and the call it stalled 7.1-8.9 s (first_call.jsonl).
WARM_COMPILE_COST_S = 8.0
# Compiling the layers again for shapes new to a process that has the compiled tier (the decode step's graph for a
# second batch size, with the batch symbolic): the stream's first 7-row batch after 32-row ones took 4.7 s against
# 0.8 s with empty caches, 2.1 s against 0.8 s with warm ones (results/first_call.jsonl, compiled-now peer, H100,
# Llama-3-8B shape); 7-8 s in issue 48's sequence.
NEW_SHAPES_COST_S = 4.0


@dataclasses.dataclass(frozen=True)
class Tier:
    """The engine of one call. ``builtin_kernels``: attention on PyTorch's kernels (no Triton build);
    ``compiled``: decoder layers compiled (decode step ``"layers"`` and a compiled prefill; else ``"graphs"``)."""

    name: str
    builtin_kernels: bool
    compiled: bool


_TIERS = {"builtin": Tier("builtin", True, False), "triton": Tier("triton", False, False),
          "compiled": Tier("compiled", False, True)}


class _ModelTiers:
    """One model's tier state in this process: what is ready, the regret of the tiers above, the record."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ready = {"triton": False, "compiled": False}
        self.regret = {"triton": 0.0, "compiled": 0.0}
        self.record: dict | None = None
        self.record_path: str | None = None
        self.record_key: dict | None = None
        self.calls: list[tuple[str, float]] = []  # (tier, seconds) of the calls so far
        self.build = None  # the background build of the compiled tier (hf_cascade.tier_build.BackgroundBuild)
        self.triton_first_s: float | None = None  # this process's first Triton call, on built kernels
        # shapes new to the compiled tier (shape_policy): calls that ran some layers uncompiled, what they lost (the
        # per-shape ski rental)
        self.missed_calls = 0
        self.shapes_regret = 0.0


def tier_state(model) -> _ModelTiers:
    """``model``'s tier state in this process (its :class:`~hf_cascade.engine.Engine`'s ``tiers`` part)."""
    return engine_of(model).part("tiers", _ModelTiers)


def raise_regret(model, tier: str, seconds: float) -> None:
    """Raise ``model``'s regret of ``tier`` (``"triton"`` or ``"compiled"``) to at least ``seconds``: as if the calls
    below it had lost that much (``warmup`` moves its next call up to the Triton tier so)."""
    state = tier_state(model)
    with state.lock:
        state.regret[tier] = max(state.regret[tier], seconds)


def choose_tier(model, compile: str = "auto") -> Tier:
    """The tier of the next call of ``model`` on CUDA (see the module docstring).

    Raises:
        ValueError: ``compile`` is not one of :data:`COMPILE_CHOICES`.
    """
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"`cascade_options['compile']` must be one of {list(COMPILE_CHOICES)}; got {compile!r}.")
    state = tier_state(model)
    with state.lock:
        if compile == "now":
            return _TIERS["compiled"]
        if state.ready["compiled"] and compile == "auto":
            return _TIERS["compiled"]
        # While a background build runs (hf_cascade.tier_build: the compiled tier's builds the Triton kernels too;
        # the Triton tier's, where the step may not compile, arrives here as "never"), the calls do not build
        # anything themselves: they would wait for what the build is making.
        if state.build is not None:
            state.build.poll()  # (once per choice: the helpers below read what it found)
        building = _rows_building(state) and compile != "now"
        record = _load_record(model, state)
        triton = state.ready["triton"] or (not building and state.regret["triton"] >= _triton_cost(
            record, caches_warm(model, state, "triton")) + (0.0 if triton_key_ready() else TRITON_KEY_COST_S))
        if not triton:
            return _TIERS["builtin"]
        if compile == "never":
            return _TIERS["triton"]
        compiled = state.ready["compiled"] or (
            state.regret["compiled"] >= _compiled_cost(record, _caches_filled(state)) and not building)
        return _TIERS["compiled" if compiled else "triton"]


def shape_policy(model, tier: Tier, compile: str = "auto") -> NewShapes | None:
    """What the compiled layers of the next call on ``tier`` do with shapes they were not compiled for (see the
    module docstring), or None (compile them in the call: not the compiled tier, ``compile`` not ``"auto"``, or the
    call that moves up to the compiled tier)."""
    if not tier.compiled or compile != "auto":
        return None
    state = tier_state(model)
    with state.lock:
        if not state.ready["compiled"]:
            return None
        return NewShapes(compile=state.shapes_regret >= NEW_SHAPES_COST_S)


def record_call(model, tier: Tier, seconds: float, shapes: NewShapes | None = None) -> None:
    """After a call of ``model`` on ``tier`` that took ``seconds``: the tiers it ran are ready; the tiers above it
    gain regret; a tier that became ready now is written to the record (with the call's seconds, an upper bound
    of what getting it ready cost). ``shapes``: the call's :func:`shape_policy` (a call that ran layers uncompiled
    adds to the per-shape regret; one that could compile them clears it)."""
    state = tier_state(model)
    with state.lock:
        state.calls.append((tier.name, round(seconds, 3)))
        if shapes is not None and shapes.compile:
            state.shapes_regret = 0.0
        elif shapes is not None and shapes.misses:
            state.missed_calls += 1
            state.shapes_regret += SAVED_FRACTION["compiled"] * seconds
        record = _load_record(model, state)
        changed = False
        if not tier.builtin_kernels:
            if not state.ready["triton"]:
                state.ready["triton"] = True
                if caches_warm(model, state, "triton") and not tier.compiled:
                    # loaded from warm caches: what the next process's first Triton call will cost (the call's
                    # seconds now; less the next Triton call's seconds once there is one)
                    costs = record.setdefault("triton_cost_s", [])
                    costs.append(round(seconds, 3))
                    del costs[:-4]
                    state.triton_first_s = seconds
                record["triton_built"], changed = True, True
            elif state.triton_first_s is not None and not tier.compiled:
                record["triton_cost_s"][-1] = round(max(state.triton_first_s - seconds, 0.0), 3)
                state.triton_first_s, changed = None, True
        else:
            state.regret["triton"] += SAVED_FRACTION["triton"] * seconds
        if tier.compiled:
            if not state.ready["compiled"]:
                state.ready["compiled"] = True
                if caches_warm(model, state):  # what a process pays on warm caches
                    costs = record.setdefault("compiled_call_s", [])
                    costs.append(round(seconds, 3))
                    del costs[:-4]
                record["caches_warm"] = True  # (a cold compile's seconds would overstate the next process's cost)
                changed = True
        else:
            state.regret["compiled"] += SAVED_FRACTION["compiled"] * seconds
        if changed:
            _write_record(state)


def note_caches_warm(model) -> None:
    """Record that the compile caches hold ``model``'s graphs and kernels (``warmup`` filled them): a later process
    expects :data:`WARM_COMPILE_COST_S` for its first compiled call until one records what it took."""
    state = tier_state(model)
    with state.lock:
        record = _load_record(model, state)
        record["caches_warm"] = True
        _write_record(state)


def tier_report(model) -> dict:
    """``{"calls": [(tier, seconds), ...], "ready": {...}, "regret_s": {...}, "record": path, "background_build":
    {"running", "seconds", "error", "prewarm", "caches_filled", "grid_running"}, "new_shapes": {"missed_calls",
    "regret_s"}}`` for ``model`` in this process (benchmarks print it). ``new_shapes``: calls of the compiled tier
    that ran layers uncompiled (shapes new to it), and the per-shape regret."""
    state = tier_state(model)
    with state.lock:
        return {"calls": list(state.calls), "ready": dict(state.ready),
                "regret_s": {k: round(v, 3) for k, v in state.regret.items()}, "record": state.record_path,
                "background_build": state.build.report() if state.build is not None else {
                    "running": False, "seconds": None, "error": None, "prewarm": None, "caches_filled": False,
                    "grid_running": False},
                "new_shapes": {"missed_calls": state.missed_calls, "regret_s": round(state.shapes_regret, 3)}}


def caches_warm(model, state: _ModelTiers, tier: str = "compiled") -> bool:
    """Whether the compile caches hold ``model``'s graphs and kernels for ``tier`` (``"compiled"``: both;
    ``"triton"``: the Triton kernels): an earlier process built them (a record says so) or a child of this one
    filled them. Call with ``state.lock`` held."""
    record = _load_record(model, state)
    if record.get("caches_warm") or record.get("compiled_call_s"):
        return True
    return _caches_filled(state, tier) or (tier == "triton" and bool(record.get("triton_built")))


def _rows_building(state: _ModelTiers) -> bool:
    """Whether the background build's rows child still ran when it was last polled."""
    return state.build is not None and state.build.rows_running


def _caches_filled(state: _ModelTiers, tier: str = "compiled") -> bool:
    """Whether a background build of this process filled the compile caches for the model's calls on ``tier``
    (a build for the compiled tier fills the Triton kernels too), as it stood when last polled."""
    if state.build is None or (tier == "compiled" and not state.build.compiled):
        return False
    return state.build.caches_filled


def triton_key_ready() -> bool:
    """Whether this process has Triton's cache key already (hashed by a launch or by the background thread of
    :func:`hf_cascade.ops._backend.prepare_triton`); True where no launch would hash it (no CUDA, the interpreter,
    no Triton) or Triton has no such key."""
    from hf_cascade.ops._backend import _triton_key_function, interpret_mode, triton_available

    if interpret_mode() or not torch.cuda.is_available() or not triton_available():
        return True
    key = _triton_key_function()
    info = getattr(key, "cache_info", None)
    return key is None or info is None or info().currsize > 0


def _triton_cost(record: dict, caches_warm: bool) -> float:
    """Expected seconds to get the Triton tier ready: the least an earlier process paid for it where the kernels
    were already built (its first Triton call's seconds less its second's), else :data:`RECORDED_TRITON_COST_S` where a
    record says they were built or the caches are warm, else :data:`DEFAULT_COST_S`."""
    costs = record.get("triton_cost_s")
    if costs:
        return min(costs)
    return RECORDED_TRITON_COST_S if record.get("triton_built") or caches_warm else DEFAULT_COST_S["triton"]


def _compiled_cost(record: dict, caches_filled: bool = False) -> float:
    """Expected seconds to compile the layers: the least an earlier process's first compiled call took (it
    includes the call's own work, so it overstates), else :data:`WARM_COMPILE_COST_S` where the caches are warm (a
    child filled them, or ``warmup``), else :data:`DEFAULT_COST_S`."""
    costs = record.get("compiled_call_s")
    if costs:
        return min(costs)
    return WARM_COMPILE_COST_S if caches_filled or record.get("caches_warm") else DEFAULT_COST_S["compiled"]


# ---------------------------------------------------------------------------------------------- records on disk
def records_folder() -> str | None:
    """Where the compile records live: ``$HF_CASCADE_RECORDS``, else ``compile_records`` in ``$HF_CASCADE_CACHE`` or
    ``~/.cache/hf_cascade``; None where either is ``off`` (any case; also ``0``, ``false``, ``no``)."""
    folder = os.environ.get("HF_CASCADE_RECORDS")
    if folder:
        return None if is_off(folder) else folder
    root = cache_root()
    return None if root is None else os.path.join(root, "compile_records")


def record_key(model) -> dict:
    """What a record is valid for: the model's shape and dtype, the GPU, the versions and the compile caches."""
    import transformers

    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    shape = {name: getattr(text, name, None) for name in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "sliding_window")}
    device = model.device
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 (no Triton: the record still keys the compiled tier)
        triton_version = None
    return {
        "model": type(model).__name__, "shape": shape, "dtype": str(model.dtype),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
        "hf_cascade": _package_version(),
        "triton_cache": os.path.realpath(os.environ.get("TRITON_CACHE_DIR") or _default_triton_cache()),
        "inductor_cache": os.path.realpath(_inductor_cache()),
    }


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-cascade")
    except PackageNotFoundError:
        return "unknown"


def _default_triton_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".triton", "cache")


def _inductor_cache() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 (another torch layout)
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")


def _load_record(model, state: _ModelTiers) -> dict:
    """The model's record (read once per process; an empty dict where there is none or it cannot be read)."""
    if state.record is not None:
        return state.record
    state.record = {}
    folder = records_folder()
    if folder is None:
        return state.record
    key = record_key(model)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    state.record_path = os.path.join(folder, f"{digest}.json")
    stored = _read_record(state.record_path)
    if stored is not None and stored["key"] == key:
        state.record = stored["tiers"]
    state.record_key = key
    return state.record


def _read_record(path: str) -> dict | None:
    """The record at ``path`` (``{"key": {...}, "tiers": {...}}``), or None where there is none or it cannot be
    used: a file that is not such a record (edited, or written by something else) is ignored with a warning naming
    it, and replaced when this process records a tier."""
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except OSError:
        return None
    except ValueError as err:  # not JSON (records are written whole: os.replace)
        problem = f"not JSON ({err})"
    else:
        problem = _record_problem(stored)
    if problem is not None:
        warnings.warn(f"hf_cascade: ignoring the compile record {path}: {problem}. It is rewritten when this "
                      "process records a tier.", stacklevel=4)
        return None
    return stored


# A record's "tiers" fields: booleans, and lists of seconds (the costs the rules above take the least of).
_RECORD_FLAGS = ("triton_built", "caches_warm")
_RECORD_COSTS = ("triton_cost_s", "compiled_call_s")


def _record_problem(stored) -> str | None:
    """None for a record of the shape :func:`_write_record` writes, else what is wrong with it (a file edited or
    written by something else: it must not break every call that reads it)."""
    if not isinstance(stored, dict):
        return f"not a JSON object but {type(stored).__name__}"
    if not isinstance(stored.get("key"), dict) or not isinstance(stored.get("tiers"), dict):
        return '"key" and "tiers" must be objects'
    tiers = stored["tiers"]
    for name in _RECORD_FLAGS:
        if name in tiers and not isinstance(tiers[name], bool):
            return f'"{name}" must be true or false, not {tiers[name]!r}'
    for name in _RECORD_COSTS:
        costs = tiers.get(name)
        if costs is not None and not (isinstance(costs, list) and all(_is_seconds(c) for c in costs)):
            return f'"{name}" must be a list of seconds (numbers >= 0), not {costs!r}'
    return None


def _is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _write_record(state: _ModelTiers) -> None:
    """Write the record atomically; a folder that cannot be written is skipped (the next process starts cold)."""
    if state.record_path is None:
        return
    try:
        os.makedirs(os.path.dirname(state.record_path), exist_ok=True)
        temporary = f"{state.record_path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        with open(temporary, "w") as f:
            json.dump({"key": state.record_key, "tiers": state.record}, f, indent=1)
        os.replace(temporary, state.record_path)
    except OSError:
        pass
