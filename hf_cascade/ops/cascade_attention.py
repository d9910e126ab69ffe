"""One cascade attention call: shared-prefix levels + per-row suffix, in L + 1 launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._backend import resolve_backend
from .merge import merge_attention_states
from .prefix_attention import (
    PrefixPlan,
    _check_plan,
    _prefix_launch_config,
    launch_prefix,
    partial_strides,
    shared_prefix_attention,
)
from .prefix_attention import _validate as _validate_prefix
from .suffix_attention import _validate as _validate_suffix
from .suffix_attention import launch_suffix, suffix_attention

__all__ = ["cascade_attention"]

_OP = "cascade_attention"


def cascade_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefixes: Sequence[tuple[Tensor, Tensor, PrefixPlan]] = (),
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Attention of every row over its shared-prefix levels and its own suffix, merged exactly.

    Same result as ``shared_prefix_attention`` per level, ``merge_attention_states`` across levels
    and ``suffix_attention(..., prefix_out=, prefix_lse=)``, but on Triton one launch per prefix
    level plus one suffix launch: the levels write their KV-split states (fp32) to one buffer and
    the suffix kernel combines them in its prologue (no separate combine or merge kernels).

    Args:
        query: [B, Hq, Lq, D] float32/float16/bfloat16 (any strides).
        key, value: the per-row suffix KV [B, Hkv, S, D] (S may be 0), query's dtype and device.
        prefixes: per level ``(prefix_key [Hkv, T, D], prefix_value [Hkv, T, D], plan)``, with
            ``plan = plan_shared_prefix(row_node, node_starts)`` built once per batch layout.
        scale, mask, causal, softcap: as in :func:`suffix_attention` (mask and causal apply to the
            suffix keys only; every query sees all keys of its prefix nodes).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".

    Returns:
        (out [B, Hq, Lq, D] in query.dtype, memory laid out [B, Lq, Hq, D] so ``out.transpose(1, 2)``
        is contiguous; lse [B, Hq, Lq] float32 natural log over all keys; -inf where none).

    Example:
        >>> plan = plan_shared_prefix(row_node, node_starts)  # once per batch layout
        >>> o, lse = cascade_attention(q, k_suffix, v_suffix, [(k_pre, v_pre, plan)],
        ...                            scale=q.shape[-1] ** -0.5)
    """
    mask = _validate_suffix(query, key, value, scale, mask, softcap, None, None)
    for k_pre, v_pre, plan in prefixes:
        _validate_prefix(query, k_pre, v_pre, scale, softcap)
        if k_pre.shape[0] != key.shape[1]:
            raise ValueError(
                f"{_OP}: prefix key heads ({k_pre.shape[0]}) must equal suffix key heads ({key.shape[1]}); "
                f"prefix key {tuple(k_pre.shape)}, suffix key {tuple(key.shape)}."
            )
        if not isinstance(plan, PrefixPlan):
            raise ValueError(f"{_OP}: each prefix level needs a PrefixPlan (plan_shared_prefix); got {type(plan)}.")
        _check_plan(plan, query, k_pre)
    if resolve_backend(backend, query.device, _OP) == "torch" or not prefixes:
        return _cascade_unfused(query, key, value, prefixes, scale=scale, mask=mask, causal=causal,
                                softcap=softcap, backend=backend)
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    configs = [_prefix_launch_config(query, k_pre, plan, None, None, None) for k_pre, _, plan in prefixes]
    slots = sum(cfg[1] for cfg in configs)
    m_total = B * Lq * G
    part_out = torch.empty((slots, Hkv, m_total, D), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((slots, Hkv, m_total), dtype=torch.float32, device=query.device)
    o_strides, l_strides = partial_strides(part_out, part_lse, Lq, G, D)
    slot0 = 0
    for (k_pre, v_pre, plan), cfg in zip(prefixes, configs):
        if m_total:
            launch_prefix(query, k_pre, v_pre, plan, cfg, part_out, part_lse, o_strides, l_strides, slot0,
                          scale=scale, softcap=softcap)
        slot0 += cfg[1]
    return launch_suffix(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                         states=(part_out, part_lse, slots, (*o_strides, 1), l_strides))


def _cascade_unfused(query, key, value, prefixes, *, scale, mask, causal, softcap, backend):
    """The composition of the three public ops (torch backend, or no prefix level)."""
    prefix_out = prefix_lse = None
    for k_pre, v_pre, plan in prefixes:
        o, lse = shared_prefix_attention(query, k_pre, v_pre, plan.rows, plan.node_starts_dev, scale=scale,
                                         softcap=softcap, backend=backend, plan=plan)
        if prefix_out is None:
            prefix_out, prefix_lse = o, lse
        else:
            prefix_out, prefix_lse = merge_attention_states(prefix_out, prefix_lse, o, lse, backend=backend)
    return suffix_attention(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                            prefix_out=prefix_out, prefix_lse=prefix_lse, backend=backend)
