"""One cascade attention call: shared-prefix levels + per-row suffix, in L + 1 launches (``ops/_launch.py``) or the
PyTorch reference (``ops/reference.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._launch import cascade_triton
from .builtin_cascade import builtin_cascade_attention
from .plan import PrefixPlan
from .prefix_attention import _check_plan
from .prefix_attention import _validate as _validate_prefix
from .reference import cascade_attention_ref
from .suffix_attention import _validate as _validate_suffix

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
    key_length: Tensor | None = None,
    key_lower: Sequence[Tensor] | None = None,
    suffix_lower: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every row over its shared-prefix levels and its own suffix, merged exactly.

    Same result as ``shared_prefix_attention`` per level, ``merge_attention_states`` across levels
    and ``suffix_attention(..., prefix_out=, prefix_lse=)``, but on Triton one launch per prefix
    level plus one suffix launch: the levels write their KV-split states (fp32) to one buffer and
    the suffix kernel combines them in its prologue (no separate combine or merge kernels); on the
    PyTorch path one softmax over every level and the suffix
    (:func:`~hf_cascade.ops.reference.cascade_attention_ref`).

    Args:
        query: [B, Hq, Lq, D] float32/float16/bfloat16 (any strides).
        key, value: the per-row suffix KV [B, Hkv, S, D] / [B, Hkv, S, Dv] (S may be 0; Dv may differ from D,
            MLA-style), query's dtype and device.
        prefixes: per level ``(prefix_key [Hkv, T, D], prefix_value [Hkv, T, Dv], plan)``, with
            ``plan = plan_shared_prefix(row_node, node_starts)`` built once per batch layout; on the torch backend
            ``plan`` may instead be ``(node_starts, row_node)``, int64 device tensors ``[N + 1]`` / ``[B]`` (no
            host data: what a compiled step has).
        scale, mask, causal, softcap: as in :func:`suffix_attention` (mask and causal apply to the
            suffix keys only; every query sees all keys of its prefix nodes).
        backend: "auto" (Triton on CUDA when available, else torch), "triton", "torch", or "builtin":
            PyTorch's own kernels, which need no build (:mod:`~hf_cascade.ops.builtin_cascade`; causal, no
            ``key_length`` or bounds).
        key_length: None, or an int64 tensor of one element on the device: the suffix keys from this index on
            are not written yet (fixed buffers) and never visible, as if masked; the Triton kernels stop reading
            there (a decode step's buffers are read only as far as they are written).
        key_lower, suffix_lower: None, or (both) per level and for the suffix an int64 ``[B, Lq]`` tensor: the first
            column of that level's packed keys / of the suffix keys each query sees (sliding windows, chunked
            attention; see :mod:`hf_cascade.ops.bounded`). The kernels skip the blocks below a tile's bounds.

    Returns:
        (out [B, Hq, Lq, Dv] in query.dtype, memory laid out [B, Lq, Hq, Dv] so ``out.transpose(1, 2)``
        is contiguous; lse [B, Hq, Lq] float32 natural log over all keys; -inf where none).

    Example:
        >>> plan = plan_shared_prefix(row_node, node_starts)  # once per batch layout
        >>> o, lse = cascade_attention(q, k_suffix, v_suffix, [(k_pre, v_pre, plan)],
        ...                            scale=q.shape[-1] ** -0.5)
    """
    mask = _validate_suffix(query, key, value, scale, mask, softcap, None, None)
    _check_key_length(key_length, key)
    backend = "builtin" if backend == "builtin" else resolve_backend(backend, query.device, _OP)
    _check_levels(query, key, value, prefixes, scale, softcap, backend)
    _check_bounds(key_lower, suffix_lower, query, prefixes)
    if backend == "builtin":
        if key_length is not None or key_lower is not None or not causal:
            raise ValueError(f"{_OP}: backend='builtin' is causal and takes no `key_length`, `key_lower` or "
                             "`suffix_lower`; use backend='torch' or 'triton'.")
        out, lse = builtin_cascade_attention(query, key, value, prefixes, scale=scale, mask=mask, softcap=softcap)
        return out.transpose(1, 2), lse
    if backend == "torch":
        out, lse = cascade_attention_ref(query, key, value, prefixes, scale=scale, mask=mask, causal=causal,
                                         softcap=softcap, key_length=key_length, key_lower=key_lower,
                                         suffix_lower=suffix_lower)
        return out.to(query.dtype), lse
    return cascade_triton(query, key, value, prefixes, scale=scale, mask=mask, causal=causal, softcap=softcap,
                          key_length=key_length, key_lower=key_lower, suffix_lower=suffix_lower)


def _check_levels(query: Tensor, key: Tensor, value: Tensor, prefixes, scale: float, softcap: float | None,
                  backend: str) -> None:
    """Validate each prefix level against the query and the suffix KV (see :func:`cascade_attention`)."""
    for k_pre, v_pre, plan in prefixes:
        _validate_prefix(query, k_pre, v_pre, scale, softcap)
        if k_pre.shape[0] != key.shape[1]:
            raise ValueError(
                f"{_OP}: prefix key heads ({k_pre.shape[0]}) must equal suffix key heads ({key.shape[1]}); "
                f"prefix key {tuple(k_pre.shape)}, suffix key {tuple(key.shape)}."
            )
        if v_pre.shape[-1] != value.shape[-1]:
            raise ValueError(
                f"{_OP}: prefix values' head_dim ({v_pre.shape[-1]}) must equal the suffix values' "
                f"({value.shape[-1]}); prefix value {tuple(v_pre.shape)}, suffix value {tuple(value.shape)}."
            )
        _check_layout(plan, query, k_pre, backend)


def _check_layout(plan, query: Tensor, k_pre: Tensor, backend: str) -> None:
    """A level's layout: a :class:`PrefixPlan` of this batch, or on the torch backend ``(node_starts, row_node)``
    int64 tensors on the query's device."""
    if isinstance(plan, PrefixPlan):
        _check_plan(plan, query, k_pre)
        return
    is_pair = isinstance(plan, tuple) and len(plan) == 2 and all(isinstance(t, Tensor) for t in plan)
    if not is_pair or backend != "torch":
        raise ValueError(
            f"{_OP}: each prefix level needs a PrefixPlan (plan_shared_prefix), or on the torch backend a pair "
            f"(node_starts int64 [N + 1], row_node int64 [B]); got {type(plan).__name__} on the {backend} backend."
        )
    node_starts, row_node = plan
    if (node_starts.dtype != torch.int64 or row_node.dtype != torch.int64 or node_starts.dim() != 1
            or tuple(row_node.shape) != (query.shape[0],) or node_starts.device != query.device
            or row_node.device != query.device):
        raise ValueError(
            f"{_OP}: a level's (node_starts, row_node) must be int64 [N + 1] and [B={query.shape[0]}] on "
            f"{query.device}; got {node_starts.dtype} {tuple(node_starts.shape)} on {node_starts.device} and "
            f"{row_node.dtype} {tuple(row_node.shape)} on {row_node.device}."
        )


def _check_bounds(key_lower, suffix_lower, query: Tensor, prefixes) -> None:
    """Validate the per-query lower bounds (see :func:`cascade_attention`)."""
    if key_lower is None and suffix_lower is None:
        return
    B, Lq = query.shape[0], query.shape[2]
    if key_lower is None or suffix_lower is None or len(key_lower) != len(prefixes):
        raise ValueError(
            f"{_OP}: pass `key_lower` (one int64 [B, Lq] tensor per prefix level: {len(prefixes)}) and "
            f"`suffix_lower` (int64 [B, Lq]) together; got {None if key_lower is None else len(key_lower)} level "
            f"bounds and {'no' if suffix_lower is None else 'a'} suffix bound."
        )
    for name, bound in [*((f"key_lower[{i}]", b) for i, b in enumerate(key_lower)), ("suffix_lower", suffix_lower)]:
        if bound.dtype != torch.int64 or tuple(bound.shape) != (B, Lq) or bound.device != query.device:
            raise ValueError(
                f"{_OP}: `{name}` must be int64 [B, Lq] = [{B}, {Lq}] on {query.device} (the first visible key "
                f"column of each query); got {bound.dtype} {tuple(bound.shape)} on {bound.device}."
            )


def _check_key_length(key_length: Tensor | None, key: Tensor) -> None:
    """``key_length`` must be None or an integer tensor of one element on ``key``'s device (a count of written
    suffix keys, read by the kernels on the device)."""
    if key_length is None:
        return
    if (not isinstance(key_length, Tensor) or key_length.numel() != 1 or key_length.dtype.is_floating_point
            or key_length.dtype == torch.bool or key_length.device != key.device):
        shape = tuple(key_length.shape) if isinstance(key_length, Tensor) else type(key_length).__name__
        raise ValueError(
            f"{_OP}: `key_length` must be an integer tensor of one element on the keys' device ({key.device}), the "
            f"number of suffix keys written; got {shape}"
            f"{f' {key_length.dtype} on {key_length.device}' if isinstance(key_length, Tensor) else ''}."
        )
