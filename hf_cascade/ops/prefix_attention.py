"""Shared-prefix pass of cascade attention: all queries of a batch against prefix KV stored once."""

from __future__ import annotations

from torch import Tensor

from ._backend import check_float_dtype, resolve_backend
from ._launch import prefix_triton
from .plan import PrefixPlan, plan_shared_prefix
from .reference import cascade_attention_ref

__all__ = ["PrefixPlan", "plan_shared_prefix", "shared_prefix_attention"]

_OP = "shared_prefix_attention"


def shared_prefix_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    row_node: Tensor,
    node_starts: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    backend: str = "auto",
    plan: PrefixPlan | None = None,
) -> tuple[Tensor, Tensor]:
    """All queries of the batch against shared prefix KV, stored once (never per row, no repeat_kv).

    Args:
        query: [B, Hq, Lq, D] float32/float16/bfloat16 (any strides).
        key, value: [Hkv, T, D] / [Hkv, T, Dv] (Dv may differ from D: MLA-style 192/128), query's dtype and
            device: the packed KV of all N nodes of one
            prefix level; node n owns ``key[:, node_starts[n]:node_starts[n+1]]`` (may be empty).
        row_node: int64 [B]; node each batch row attends, -1 = none (that row: out 0, lse -inf).
        node_starts: int64 [N+1] (CPU or device), nondecreasing, node_starts[0] = 0, [N] = T.
        scale: softmax scale (usually head_dim ** -0.5).
        softcap: if given, ``scores = softcap * tanh(scale * q.k / softcap)`` (Gemma 2).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".
        plan: optional :func:`plan_shared_prefix` result for this (row_node, node_starts); pass it
            to skip the per-call host sync. Hq = Hkv * G (MHA, GQA, MQA). No mask: every query
            sees all keys of its node.

    Returns:
        (out [B, Hq, Lq, Dv] float32, lse [B, Hq, Lq] float32 natural log). out is fp32 on purpose:
        it is merged with the suffix state next.

    Example:
        >>> plan = plan_shared_prefix(row_node, node_starts)  # once per batch layout
        >>> o, lse = shared_prefix_attention(q, k_pre, v_pre, row_node, node_starts,
        ...                                  scale=q.shape[-1] ** -0.5, plan=plan)
    """
    _validate(query, key, value, scale, softcap)
    if plan is None:
        plan = plan_shared_prefix(row_node, node_starts, device=query.device)
    _check_plan(plan, query, key)
    if resolve_backend(backend, query.device, _OP) == "torch":  # the reference's cascade of this one level
        return cascade_attention_ref(query, None, None, [(key, value, plan)], scale=scale, softcap=softcap)
    return prefix_triton(query, key, value, plan, scale=scale, softcap=softcap)


def _validate(query: Tensor, key: Tensor, value: Tensor, scale: float, softcap: float | None) -> None:
    if query.dim() != 4:
        raise ValueError(f"{_OP}: query must be [B, Hq, Lq, D]; got shape {tuple(query.shape)}.")
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"{_OP}: key and value must be [Hkv, T, D] and [Hkv, T, Dv] (the packed prefix KV, no batch dim); got "
            f"{tuple(key.shape)} and {tuple(value.shape)}."
        )
    check_float_dtype("query", query, _OP)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"{_OP}: key/value dtype ({key.dtype}/{value.dtype}) must match query ({query.dtype}); "
            "cast the prefix cache to the model dtype."
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"{_OP}: query, key, value must share a device; got {query.device}, {key.device}.")
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    if key.shape[2] != D:
        raise ValueError(f"{_OP}: key head_dim {key.shape[2]} != query head_dim {D} (query {tuple(query.shape)}).")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"{_OP}: query heads ({Hq}) must be a multiple of key heads ({Hkv}); query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}. Pass the un-repeated KV heads."
        )
    if not scale > 0:
        raise ValueError(f"{_OP}: scale must be > 0; got {scale}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{_OP}: softcap must be None or > 0; got {softcap}.")


def _check_plan(plan: PrefixPlan, query: Tensor, key: Tensor) -> None:
    if plan.batch_size != query.shape[0] or plan.total_keys != key.shape[1] or plan.device != query.device:
        raise ValueError(
            f"{_OP}: plan (B={plan.batch_size}, T={plan.total_keys}, {plan.device}) does not match "
            f"query {tuple(query.shape)} on {query.device} / key {tuple(key.shape)}. Rebuild it with "
            "plan_shared_prefix(row_node, node_starts) when the batch layout changes."
        )
