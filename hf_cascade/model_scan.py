"""What hf_cascade reads from a model's module tree, walked once per model instead of on every call.

Walking a model's modules is host time: ~1-2 ms for the ~450 modules of Llama-3-8B, and a generate() call walked
them four times before its prefill could start (the prefill's temporary cache, the final cache, the cost model's
parameter count). The results are kept per model (its :class:`~hf_cascade.engine.Engine`, freed with the model) and
walked again once a module or parameter is registered on any module of a model walked so far: torch's global
registration hooks (``setattr`` / ``add_module`` / ``register_parameter``) see it, so a model whose attention
modules or layers are replaced is scanned anew and a cache built afterwards serves the new modules. Registrations on
other modules (a forward's ``self.layers[:n]`` builds a new ``ModuleList`` every call) leave the scans alone. Not
seen: ``ModuleList.insert`` / ``del`` / ``pop`` (they edit ``_modules`` directly), a module's ``layer_idx`` set to
another value in place, ``param.data`` swapped for another shape.
"""

from __future__ import annotations

import functools
import weakref

import torch

from hf_cascade.engine import engine_of

_generation = 0  # bumped by every module / parameter registration on a watched module (see _registered)
_watched: weakref.WeakSet = weakref.WeakSet()  # every module of every model scanned so far


def _registered(module: torch.nn.Module, *_args) -> None:
    """torch's global registration hook: ``module`` got a new child module or parameter; if it belongs to a scanned
    model, every scan is stale. Not under torch.compile: a compiled forward registers only into containers it
    builds (``self.layers[:n]``), and tracing the lookup would guard the graph on the watched set."""
    global _generation
    if not torch.compiler.is_compiling() and module in _watched:
        _generation += 1


@functools.cache
def _install_hooks() -> None:
    """torch's global registration hooks, once per process (two threads' first scans at once may both install
    them: each registration then counts twice, which only makes scans stale sooner)."""
    torch.nn.modules.module.register_module_module_registration_hook(_registered)
    torch.nn.modules.module.register_module_parameter_registration_hook(_registered)


class _ModelScan:
    """One model's scan results, valid while ``generation`` is the count of registrations on watched modules."""

    def __init__(self):
        self.generation = -1
        self.attention_modules: dict[int, weakref.WeakSet] | None = None
        self.non_embedding_parameters: int | None = None
        self.rope_limit: int | None = None  # see rope_limit


def _scan(model: torch.nn.Module) -> _ModelScan:
    """``model``'s kept scan, walked again (its attention modules found, every module watched) if a module or
    parameter was registered on a watched module since."""
    _install_hooks()
    generation = _generation  # read before the walk: a registration during it leaves the scan stale, not wrong
    try:
        scan = engine_of(model).part("scan", _ModelScan)
    except TypeError:  # not weak-referenceable or not hashable: nothing to keep it on
        scan = _ModelScan()
    if scan.generation != generation or scan.attention_modules is None:
        modules: dict[int, weakref.WeakSet] = {}
        limits = []
        for module in model.modules():
            _watched.add(module)
            limits += _rope_limits(module)
            layer_idx = getattr(module, "layer_idx", None)
            if isinstance(layer_idx, int):
                modules.setdefault(layer_idx, weakref.WeakSet()).add(module)
        for layer_idx, found in modules.items():
            # Decoder layers that keep a layer_idx of their own (Gemma 3, GPT-OSS) hold their attention module: keep
            # the innermost, the module the attention is called with (its window, sinks, ...).
            if len(found) > 1:
                inner = [m for m in found if not any(o is not m and o in found for o in m.modules())]
                modules[layer_idx] = weakref.WeakSet(inner)
        scan.attention_modules, scan.non_embedding_parameters = modules, None
        scan.rope_limit = min(limits, default=None)
        scan.generation = generation
    return scan


def attention_modules(model: torch.nn.Module) -> dict[int, weakref.WeakSet]:
    """``layer_idx -> the modules of model whose layer_idx is that int`` (its attention modules): the modules a
    cache built for ``model`` may serve. Kept per model and shared by every cache built for it: read, never
    change it. Weak sets: the scan keeps no module (and so no model) alive."""
    return _scan(model).attention_modules


def rope_limit(model: torch.nn.Module) -> int | None:
    """The longest prompt (tokens) for which ``model``'s rotary embedding does not depend on how the prompt is split
    into forwards, or None (it never does). transformers' ``dynamic`` (NTK) and ``longrope`` RoPE pick their
    frequencies from each forward's longest position: past ``max_position_embeddings`` (dynamic) or
    ``original_max_position_embeddings`` (longrope), a forward over a shared prefix alone, or over one rank's shard,
    would rotate its keys otherwise than the one forward over the whole prompt. Kept per model."""
    return _scan(model).rope_limit


def _rope_limits(module: torch.nn.Module) -> list[int]:
    """The limits of :func:`rope_limit` that ``module`` sets (a rotary embedding of a dynamic or longrope type)."""
    rope_type = getattr(module, "rope_type", None)
    kinds = list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
    if not any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in kinds):
        return []
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    groups = [p for p in params.values() if isinstance(p, dict)] or [params]  # (per layer type in some models)
    limits = [int(p["original_max_position_embeddings"]) for p in groups if p.get("original_max_position_embeddings")]
    for value in (getattr(module, "original_max_seq_len", None), getattr(config, "original_max_position_embeddings",
                                                                          None)):
        if isinstance(value, int) and value > 0:
            limits.append(value)
    return limits or [0]


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """``model.num_parameters(exclude_embeddings=True)`` (transformers' count), or every parameter of a module
    without that method. Kept per model."""
    scan = _scan(model)
    if scan.non_embedding_parameters is None:
        try:
            count = model.num_parameters(exclude_embeddings=True)
        except (AttributeError, TypeError):
            count = sum(p.numel() for p in model.parameters())
        scan.non_embedding_parameters = count
    return scan.non_embedding_parameters
