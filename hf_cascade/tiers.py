"""Which engine a generate() call runs on a GPU, so that no call waits for a compiler it would not win back.

Three tiers, each faster once ready and costlier to get ready: ``builtin`` (attention on kernels compiled inside
PyTorch, :mod:`hf_cascade.ops.builtin_cascade`, decode steps recorded into CUDA graphs: ready at once),
``triton`` (hf_cascade's Triton kernels: ~1 s per kernel to build on empty caches, milliseconds from warm ones),
``compiled`` (the decoder layers compiled, :mod:`hf_cascade.compiled_layers`: ~20% off a step after 10-25 s of
compilation on empty caches, ~8 s on warm ones).

``cascade_options={"compile": "auto"}`` (default) is ski rental: a call runs the best tier that is ready; each call
below a tier adds what that tier would have saved (:data:`SAVED_FRACTION` of its seconds) to the tier's regret, and
the next call moves up once the regret reaches the tier's expected cost: cold, or warm where the compile caches hold
the model's kernels (this process's background build filled them, :mod:`hf_cascade.tier_build`, or a marker on disk
says an earlier process built them). So no more time is lost waiting than compiling costs, and no more is spent
compiling than waiting lost. Once the compiled tier is ready, a call whose shapes its layers were not compiled for
runs those layers uncompiled, until the time so lost reaches :data:`NEW_SHAPES_COST_S` and the calls that lose it
last at least as long as that compilation (so it never more than doubles a call), or, with shorter calls, until it
reaches :data:`NEW_SHAPES_PATIENCE` times that (a long-running process still gets there: :func:`shape_policy`).
``"now"`` compiles from the first call; ``"never"`` never compiles the layers. How it behaves, with measurements:
``docs/internals.md`` (First calls).

**Markers on disk**: ``<digest>.triton`` / ``<digest>.compiled`` in :func:`records_folder`, the digest of
:func:`record_key` (model shape, dtype, GPU, versions, compile-cache folders; the file holds the key, for people):
this machine built that tier's kernels into those caches. Only a marker's existence is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

import torch

from hf_cascade._env import cache_root, is_off
from hf_cascade.compiled_layers import NewShapes
from hf_cascade.engine import engine_of
from hf_cascade.options import COMPILE_CHOICES
from hf_cascade.transformers_compat import text_config

__all__ = ["COMPILE_CHOICES", "NEW_SHAPES_COST_S", "NEW_SHAPES_PATIENCE", "SAVED_FRACTION", "Tier", "caches_warm",
           "choose_tier", "record_call", "record_key", "records_folder", "shape_policy", "tier_report", "tier_state"]

# What each tier saves over the one below, as a fraction of a call's seconds there (H100, Llama-3-8B shape: a decode
# step 10.3 -> 8.1 ms with the layers compiled; attention ~4x faster on the Triton kernels than the built-in ones:
# benchmarks/results/first_call.jsonl, probe_builtin_attention.jsonl).
SAVED_FRACTION = {"triton": 0.25, "compiled": 0.20}
# Expected seconds to get a tier ready on empty caches (H100, first_call.jsonl): Triton builds ~1 s per kernel,
# several per layout; compiling an 8B model's layers for the prefill and the decode step.
DEFAULT_COST_S = {"triton": 8.0, "compiled": 20.0}
# On warm caches: the Triton tier's first call, loading built kernels, ~0.6 s more than its next (a call of another
# shape may still build a variant: up to ~2.6 s); the compiled tier's first call in a new process, ~10 s against
# 0.64 s after (imports of the compile stack, dynamo's tracing). results/probe_warm_compile.jsonl, first_call.jsonl.
WARM_TRITON_COST_S = 1.0
WARM_COMPILE_COST_S = 8.0
# Triton's first launch in a process hashes its library for its cache key (0.37-0.47 s, H100); a background thread
# starts it at the first call (ops._backend.prepare_triton), so from the second call on this is 0.
TRITON_KEY_COST_S = 0.4
# Compiling the layers again for shapes new to the compiled tier: 2-8 s on an H100 (first_call.jsonl, issue 48).
NEW_SHAPES_COST_S = 4.0
# Calls shorter than that compilation compile their new shapes only once they have lost this many times its cost.
NEW_SHAPES_PATIENCE = 5.0


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
    """One model's tier state in this process: what is ready, the regret of the tiers above, the markers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ready = {"triton": False, "compiled": False}
        self.regret = {"triton": 0.0, "compiled": 0.0}
        self.built: set[str] | None = None  # tiers whose markers exist (read once per process)
        self.marker_stem: str | None = None  # records_folder()/digest, None where records are off
        self.marker_key: dict | None = None
        self.calls: list[tuple[str, float]] = []  # (tier, seconds) of the calls so far
        self.build = None  # the background build (hf_cascade.tier_build.BackgroundBuild)
        self.missed_calls = 0  # calls of the compiled tier that ran layers uncompiled (shape_policy)
        self.shapes_regret = 0.0
        self.missed_call_s = 0.0  # seconds of the last call that ran layers uncompiled


def tier_state(model) -> _ModelTiers:
    """``model``'s tier state in this process (its :class:`~hf_cascade.engine.Engine`'s ``tiers`` part)."""
    return engine_of(model).part("tiers", _ModelTiers)


def choose_tier(model, compile: str = "auto") -> Tier:
    """The tier of the next call of ``model`` on CUDA (see the module docstring).

    Raises:
        ValueError: ``compile`` is not one of :data:`COMPILE_CHOICES`.
    """
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"`cascade_options['compile']` must be one of {list(COMPILE_CHOICES)}; got {compile!r}.")
    state = tier_state(model)
    with state.lock:
        if compile == "now" or (state.ready["compiled"] and compile == "auto"):
            return _TIERS["compiled"]
        # While a background build's rows child runs (its tier's kernels, and for the compiled tier the Triton ones
        # too), the calls build nothing themselves: they would wait for what it is making.
        if state.build is not None:
            state.build.poll()  # (once per choice: the helpers below read what it found)
        building = state.build is not None and state.build.rows_running
        key_cost = 0.0 if triton_key_ready() else TRITON_KEY_COST_S
        triton = state.ready["triton"] or (not building and state.regret["triton"] >= _cost(
            "triton", caches_warm(model, state, "triton")) + key_cost)
        if not triton:
            return _TIERS["builtin"]
        if compile == "never":
            return _TIERS["triton"]
        compiled = state.ready["compiled"] or (
            not building and state.regret["compiled"] >= _cost("compiled", caches_warm(model, state)))
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
        # Compile in a call where it at most doubles it (the last call that missed as long as the compilation), or
        # where the calls have lost much more than it costs.
        regret = state.shapes_regret
        return NewShapes(compile=regret >= NEW_SHAPES_COST_S and (
            state.missed_call_s >= NEW_SHAPES_COST_S or regret >= NEW_SHAPES_PATIENCE * NEW_SHAPES_COST_S))


def record_call(model, tier: Tier, seconds: float, shapes: NewShapes | None = None) -> None:
    """After a call of ``model`` on ``tier`` that took ``seconds``: the tiers it ran are ready (their markers
    written); the tiers above it gain regret. ``shapes``: the call's :func:`shape_policy` (a call that ran layers
    uncompiled adds to the per-shape regret and is the length a compilation is weighed against; one that could
    compile them clears the regret)."""
    state = tier_state(model)
    with state.lock:
        state.calls.append((tier.name, round(seconds, 3)))
        if shapes is not None and shapes.compile:
            state.shapes_regret = 0.0
        elif shapes is not None and shapes.misses:
            state.missed_calls += 1
            state.missed_call_s = seconds
            state.shapes_regret += SAVED_FRACTION["compiled"] * seconds
        for name, ran in (("triton", not tier.builtin_kernels), ("compiled", tier.compiled)):
            if not ran:
                state.regret[name] += SAVED_FRACTION[name] * seconds
            elif not state.ready[name]:
                state.ready[name] = True
                _write_marker(model, state, name)


def tier_report(model) -> dict:
    """``{"calls": [(tier, seconds), ...], "ready": {...}, "regret_s": {...}, "record": marker path stem,
    "background_build": {"running", "seconds", "error", "prewarm", "caches_filled", "grid_running"}, "new_shapes":
    {"missed_calls", "regret_s"}}`` for ``model`` in this process (benchmarks print it)."""
    state = tier_state(model)
    with state.lock:
        return {"calls": list(state.calls), "ready": dict(state.ready),
                "regret_s": {k: round(v, 3) for k, v in state.regret.items()}, "record": state.marker_stem,
                "background_build": state.build.report() if state.build is not None else {
                    "running": False, "seconds": None, "error": None, "prewarm": None, "caches_filled": False,
                    "grid_running": False},
                "new_shapes": {"missed_calls": state.missed_calls, "regret_s": round(state.shapes_regret, 3)}}


def caches_warm(model, state: _ModelTiers, tier: str = "compiled") -> bool:
    """Whether the compile caches hold ``model``'s kernels for ``tier`` (``"compiled"``: its graphs and kernels;
    ``"triton"``: the Triton kernels): a marker says an earlier process built them, or this process's background
    build filled them (one for the compiled tier fills the Triton kernels too). Call with ``state.lock`` held."""
    built = _read_markers(model, state)
    build = state.build
    filled = build is not None and build.caches_filled and (tier == "triton" or build.compiled)
    return filled or "compiled" in built or (tier == "triton" and "triton" in built)


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


def _cost(tier: str, warm: bool) -> float:
    """Expected seconds to get ``tier`` ready, on warm or on empty compile caches."""
    if tier == "triton":
        return WARM_TRITON_COST_S if warm else DEFAULT_COST_S["triton"]
    return WARM_COMPILE_COST_S if warm else DEFAULT_COST_S["compiled"]


# ---------------------------------------------------------------------------------------------- markers on disk
def records_folder() -> str | None:
    """Where the markers live: ``$HF_CASCADE_RECORDS``, else ``compile_records`` in ``$HF_CASCADE_CACHE`` or
    ``~/.cache/hf_cascade``; None where either is ``off`` (any case; also ``0``, ``false``, ``no``)."""
    folder = os.environ.get("HF_CASCADE_RECORDS")
    if folder:
        return None if is_off(folder) else folder
    root = cache_root()
    return None if root is None else os.path.join(root, "compile_records")


def record_key(model) -> dict:
    """What a marker is valid for: the model's shape and dtype, the GPU, the versions and the compile caches."""
    import transformers

    text = text_config(model.config)
    shape = {name: getattr(text, name, None) for name in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "sliding_window")}
    device = model.device
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 (no Triton: the marker still keys the compiled tier)
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


def _read_markers(model, state: _ModelTiers) -> set[str]:
    """The tiers whose markers exist for ``model`` (looked up once per process; none where records are off)."""
    if state.built is not None:
        return state.built
    state.built = set()
    folder = records_folder()
    if folder is not None:
        state.marker_key = record_key(model)
        digest = hashlib.sha256(json.dumps(state.marker_key, sort_keys=True).encode()).hexdigest()[:24]
        state.marker_stem = os.path.join(folder, digest)
        state.built = {tier for tier in ("triton", "compiled") if os.path.exists(f"{state.marker_stem}.{tier}")}
    return state.built


def _write_marker(model, state: _ModelTiers, tier: str) -> None:
    """Write ``tier``'s marker (its content: the key); a folder that cannot be written is skipped."""
    built = _read_markers(model, state)
    if state.marker_stem is None or tier in built:
        return
    built.add(tier)
    try:
        os.makedirs(os.path.dirname(state.marker_stem), exist_ok=True)
        with open(f"{state.marker_stem}.{tier}", "w", encoding="utf-8") as f:
            json.dump(state.marker_key, f, indent=1)
    except OSError:
        pass
