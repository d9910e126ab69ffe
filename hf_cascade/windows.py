"""Sliding windows, chunked attention and attention sinks in a :class:`~hf_cascade.cache.CascadeCache`.

A layer whose window (or chunk) is shorter than the sequence runs :func:`~hf_cascade.ops.bounded
.bounded_cascade_attention`: the query at coordinate ``p`` sees the keys at coordinates ``(p - W, p]`` (chunked:
``[p - p mod C, p]``), expressed as a first visible column per level and per suffix. A coordinate is what
transformers' masks count: the column, from the row's first real column, masked columns inside the row included
(for a row without them, generate()'s position ``attention_mask.cumsum(-1) - 1``). A row's chain of shared nodes
holds its first tokens with no masked column among them (:func:`hf_cascade.inputs._rows_for_sharing`: coordinates 0
.. chain - 1), its own columns follow from ``suffix_start`` in the suffix columns. So, per row ``b``:

* column ``t`` of prefix level ``l`` (inside the row's node) holds coordinate ``t - level_shift[l, b]``, with
  ``level_shift = node_start - (tokens of the row's chain before level l)``;
* suffix column ``c`` holds coordinate ``c + suffix_shift[b]``, with ``suffix_shift = chain - suffix_start``.

Both are host data of the batch layout (built once per layout, like the cascade plan); the query columns move with
the written suffix length, so decode steps move every bound by one per step with no host work. A
:meth:`~hf_cascade.CascadeCache.from_prefix` cache given straight to generate() reads ``suffix_shift`` from the
forward's position ids instead: its rows ``[prefix | pads | suffix]`` stand for the left-padded rows of prefix +
suffix, so its windows count positions.

Attention sinks (GPT-OSS ``s_aux``) are merged into the final state: :func:`~hf_cascade.ops.bounded.merge_sink`.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import Tensor

from hf_cascade.ops.bounded import BOUNDED_PATHS, RowShifts, bound_columns, lower_positions, row_shifts  # noqa: F401
from hf_cascade.ops.cascade_wrapper import bounded_planned_attention


def layer_window(module: torch.nn.Module, sliding_window: int | None = None) -> int | None:
    """The sliding window of ``module``'s layer: ``sliding_window`` when the model passed it to the attention, else
    None on a layer its config's ``layer_types`` calls ``"full_attention"`` (Exaone 4 keeps the window on every
    module, Qwen2-MoE on its config), else the module's own ``sliding_window`` (Qwen2/3, Gemma 2/3, GPT-OSS: None on
    full-attention layers), else its config's where its forward passes one (Mistral, Mixtral, Phi3: every layer; not
    Moshi). None: full attention."""
    if sliding_window is not None:
        return int(sliding_window)
    config = getattr(module, "config", None)
    layer_types, layer_idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types and isinstance(layer_idx, int) and layer_idx < len(layer_types) \
            and layer_types[layer_idx] == "full_attention":
        return None
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
        window = window if window and _forward_passes_window(type(module)) else None
    return int(window) if window else None


def _forward_passes_window(attention_class: type) -> bool:
    """Whether a model with a config window applies it: its attention's forward hands the attention one (Mistral,
    Mixtral, Phi3 pass their config's) or its modeling module builds a sliding-window mask (PhiMoE); Moshi's config
    has one that neither does. Read once per class from the source, eagerly (a compiled graph reads the answer
    found before it, or assumes True); True where the source cannot be read."""
    known = _WINDOW_APPLIED.get(attention_class)
    if known is not None or torch.compiler.is_compiling():
        return True if known is None else known
    try:
        applied = "sliding_window" in inspect.getsource(attention_class.forward) or (
            "create_sliding_window_causal_mask" in inspect.getsource(sys.modules[attention_class.__module__]))
    except (OSError, TypeError, KeyError):
        applied = True
    _WINDOW_APPLIED[attention_class] = applied
    return applied


_WINDOW_APPLIED: dict[type, bool] = {}  # attention class -> whether its model applies its config's window


def layer_sinks(module: torch.nn.Module, s_aux: Tensor | None = None) -> Tensor | None:
    """The per-head sink logits ``[Hq]`` of ``module``'s layer: ``s_aux`` as the model passed it, else GPT-OSS's
    ``module.sinks`` (a compiled layer step does not forward the model's keyword arguments), else None."""
    if s_aux is not None:
        return s_aux
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, Tensor) and getattr(getattr(module, "config", None), "model_type", None) == "gpt_oss":
        return sinks
    return None


def bounded_attend(
    shifts: RowShifts,
    plan,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefix_keys: list[Tensor],
    prefix_values: list[Tensor],
    mask: Tensor | None,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    chunk: int | None,
    key_length: Tensor | None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One layer's cascade attention with its window (or chunk) as a lower bound on every query's keys: the bounds
    of :func:`bound_columns`, then :func:`~hf_cascade.ops.cascade_wrapper.bounded_planned_attention` (what a
    :class:`~hf_cascade.cache.CascadeCache` runs through its wrapper, for a layout given by hand).

    Args:
        shifts: the batch layout's :class:`RowShifts`; plan: its :class:`~hf_cascade.ops.plan.CascadePlan` (None
            without prefix levels).
        query: ``[B, Hq, Lq, D]``; key, value: the suffix KV ``[B, Hkv, S, D / Dv]``; prefix_keys/values: per level
            ``[Hkv, T_l, D / Dv]``; mask: bool ``[B or 1, Lq, S]`` over the suffix, or None (causal).
        key_length: the written suffix columns (fixed buffers, int64 device scalar) or None (all S).
        backend: "auto" (the Triton kernels with the bounds on CUDA, else PyTorch), "triton" or "torch".
    Returns:
        ``(out [B, Lq, Hq, Dv] in query.dtype, lse [B, Hq, Lq] fp32)``.
    """
    written = key.shape[2] if key_length is None else key_length.reshape(())
    key_lower, suffix_lower = bound_columns(shifts, query.shape[2], written, len(prefix_keys), window=window,
                                            chunk=chunk)
    return bounded_planned_attention(query, key, value, plan, prefix_keys, prefix_values, mask, scale=scale,
                                     softcap=softcap, key_length=key_length, key_lower=key_lower,
                                     suffix_lower=suffix_lower, backend=backend)


def droppable_prefix_tokens(shifts: RowShifts, levels, row_nodes: Tensor | None, window: int) -> int:
    """Prefix tokens (summed over the levels' packed columns) that no row's current or later query can see in a
    sliding layer of ``window``: every query of row ``b`` sits at position >= ``first_position[b]``, so the columns of
    its node below ``first_position[b] - window + 1`` are dead for it, and a column is dead when every row reading it
    has it dead. A sliding layer could free those columns' KV."""
    shift = shifts.level_shift.cpu()
    dropped = 0
    for level_idx, level in enumerate(levels):
        starts = list(level.node_starts)
        for node in range(len(starts) - 1):
            readers = [b for b in range(len(shifts.first_position))
                       if (0 if row_nodes is None else int(row_nodes[level_idx, b])) == node]
            if not readers:
                dropped += starts[node + 1] - starts[node]
                continue
            # first live column of the node: the smallest over its readers of (their first lower bound + shift)
            live_from = min(shifts.first_position[b] - window + 1 + int(shift[level_idx, b]) for b in readers)
            dropped += max(0, min(live_from, starts[node + 1]) - starts[node])
    return dropped


def droppable_kv_bytes(cache) -> int:
    """Bytes of shared-prefix KV that the sliding-window layers of ``cache``'s model could free for its current rows
    (:func:`droppable_prefix_tokens` per sliding layer, times that layer's K and V bytes per token). hf_cascade keeps
    them (the full-attention layers and later batches may read them); this is the saving a sliding layer leaves."""
    if not cache.levels:
        return 0
    row_nodes, suffix_start = cache.row_nodes, cache.suffix_start
    batch = next((t.shape[-1] for t in (row_nodes, suffix_start) if t is not None), 1)
    shifts = row_shifts(cache.levels, row_nodes, suffix_start, batch, torch.device("cpu"))
    total, tokens_by_window = 0, {}
    for layer_idx in range(len(cache.levels[0].keys)):
        window = layer_window(cache.attention_module(layer_idx))
        if window is None:
            continue
        if window not in tokens_by_window:
            tokens_by_window[window] = droppable_prefix_tokens(shifts, cache.levels, row_nodes, window)
        keys, values = cache.levels[0].keys[layer_idx], cache.levels[0].values[layer_idx]
        per_token = (keys.shape[0] * keys.shape[2] * keys.element_size()
                     + values.shape[0] * values.shape[2] * values.element_size())
        total += tokens_by_window[window] * per_token
    return total
