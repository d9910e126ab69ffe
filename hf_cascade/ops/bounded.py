"""Cascade attention with a lower bound on each query's visible keys (sliding windows, chunked attention), and the
attention-sink merge (GPT-OSS).

**Windows as a lower bound.** A sliding-window layer of window ``W`` lets the query at position ``p`` see the keys
at positions ``(p - W, p]``; a chunked layer (Llama 4) of chunk ``C`` the keys at ``[p - p mod C, p]``. Causality
already gives the upper end, so both are one *lower bound* per query. In the cascade each key lives in a column of
a prefix level (packed nodes) or of the row's suffix; the bound becomes, per level and per (row, query), the first
visible column: ``key_lower[l][b, i]`` over level ``l``'s packed columns, ``suffix_lower[b, i]`` over the suffix
columns. A node wholly below every bound contributes nothing (its state is empty: lse -inf).

**Sinks as a merge operand.** A sink is one more logit ``s_h`` per head in the softmax denominator with a zero
value: the state ``(out 0, lse s_h)``. Merged into ``(out, lse)``: ``out * sigmoid(lse - s_h)``, ``logaddexp(lse,
s_h)`` — no kernel change.

:func:`bounded_cascade_attention` is the PyTorch reference (:func:`~hf_cascade.ops.reference.cascade_attention_ref`)
on the layout's device index tensors, in fp32 (traceable by ``torch.compile``; no host synchronisation): the path of
CPUs and of the built-in tier. The Triton kernels take the same bounds (``cascade_attention(..., key_lower=,
suffix_lower=)``); inside compiled or recorded decode steps they run through the custom op
``torch.ops.hf_cascade.bounded_cascade_attention`` (:func:`~hf_cascade.ops.cascade_wrapper.planned_attention`), which
reads the layout from a :class:`~hf_cascade.ops.plan.CascadePlan`'s index tensors and the bounds as device tensors,
so one recorded graph serves every step (the bounds move with the written suffix length, on the device). LSE is the
natural log, fp32.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from hf_cascade.step_context import memoized

from ._backend import host_to_device
from .reference import cascade_attention_ref

__all__ = ["BOUNDED_PATHS", "RowShifts", "WindowRequest", "bound_columns", "bounded_cascade_attention", "count_path",
           "lower_positions", "merge_sink", "row_shifts", "window_bounds"]

_OP = "bounded_cascade_attention"


def lower_positions(query_positions: Tensor, *, window: int | None = None, chunk: int | None = None) -> Tensor:
    """The first key position each query sees (int64, ``query_positions``' shape).

    ``window``: sliding window (keys in ``(p - window, p]``); ``chunk``: chunked attention (keys in
    ``[p - p mod chunk, p]``). Exactly one of them.
    """
    if (window is None) == (chunk is None):
        raise ValueError(f"lower_positions: pass exactly one of `window` ({window}) and `chunk` ({chunk}).")
    size = window if window is not None else chunk
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"lower_positions: the window or chunk must be a positive int; got {size!r}.")
    if window is not None:
        return query_positions - (window - 1)
    return query_positions - torch.remainder(query_positions, chunk)


@dataclass(eq=False)
class RowShifts:
    """Per row, where its tokens' window coordinates sit in the cascade's columns (see :mod:`hf_cascade.windows`).

    Attributes:
        level_shift: int64 ``[L, B]`` on the device: coordinate = column - level_shift (inside the row's node).
        suffix_shift: int64 ``[B]`` on the device: coordinate = suffix column + suffix_shift.
        first_position: host list of ``B`` ints, the position of each row's first own token (its chain length).
        from_step_buffers: the two device tensors were taken from the model's step buffers (a fixed-buffer cache's
            decode step reads them; the call gives them back with the others).
    """

    level_shift: Tensor
    suffix_shift: Tensor
    first_position: list[int]
    from_step_buffers: bool = False  # the two tensors were taken from a model's StepBuffers (given back with it)


def node_spans(levels, row_nodes: Tensor | None, batch_size: int) -> tuple[Tensor, Tensor]:
    """Per level and row, where the row's node starts in the level's packed KV and how many tokens it has (both 0
    where the row has no node there): int64 ``[L, B]`` on the host. ``row_nodes`` int64 ``[L, B]`` (-1: none; None:
    node 0 of every level). A row's chain length is ``node_len.sum(0)``."""
    L = len(levels)
    nodes = torch.zeros((L, batch_size), dtype=torch.int64) if row_nodes is None else row_nodes.to("cpu", torch.int64)
    node_start = torch.zeros((L, batch_size), dtype=torch.int64)
    node_len = torch.zeros((L, batch_size), dtype=torch.int64)
    for level_idx, (level, level_nodes) in enumerate(zip(levels, nodes)):
        starts = torch.tensor(list(level.node_starts), dtype=torch.int64)
        has = level_nodes >= 0
        index = level_nodes.clamp(min=0)
        node_start[level_idx] = torch.where(has, starts[index], 0)
        node_len[level_idx] = torch.where(has, starts[index + 1] - starts[index], 0)
    return node_start, node_len


def row_shifts(levels, row_nodes: Tensor | None, suffix_start: Tensor | None, batch_size: int,
               device: torch.device, position_ids: Tensor | None = None,
               last_column: int | Tensor | None = None) -> RowShifts:
    """The :class:`RowShifts` of a batch layout: ``levels`` the cache's :class:`~hf_cascade.prefill.PrefixLevel` list,
    ``row_nodes`` int64 ``[L, B]`` on the host (None: node 0 of every level), ``suffix_start`` int64 ``[B]`` (None: 0).

    ``position_ids`` ``[B or 1, Lq]`` and ``last_column`` (the suffix column of the forward's last query: written
    columns - 1): a :meth:`~hf_cascade.CascadeCache.from_prefix` cache given rows ``[prefix | pads | suffix]``
    straight to generate() passes them, and the suffix shift is read from them on the device (the last query of
    every row is a real token): its windows count positions. Planned rows pass None (coordinates from the layout)."""
    node_start, node_len = node_spans(levels, row_nodes, batch_size)
    before = node_len.cumsum(0) - node_len  # the row's chain tokens before each level
    chain = node_len.sum(0)
    start = torch.zeros(batch_size, dtype=torch.int64) if suffix_start is None else suffix_start.to(torch.int64)
    suffix_shift = host_to_device(chain - start, device)
    if position_ids is not None and last_column is not None:
        suffix_shift = (position_ids[:, -1].to(device, torch.int64) - last_column).expand(batch_size).clone()
    return RowShifts(
        level_shift=host_to_device(node_start - before, device),
        suffix_shift=suffix_shift,
        first_position=chain.tolist(),
    )


def bound_columns(shifts: RowShifts, query_length: int, written, levels: int, *, window: int | None,
                  chunk: int | None) -> tuple[list[Tensor], Tensor]:
    """The first visible column of each query: per prefix level (``key_lower``) and over the suffix
    (``suffix_lower``), int64 ``[B, Lq]`` on the device, for a forward whose last query is suffix column
    ``written - 1`` (``written``: an int, or the int64 device scalar of fixed buffers: then no host data at all)."""
    device = shifts.suffix_shift.device
    query_columns = written - query_length + torch.arange(query_length, device=device)  # [Lq]
    positions = query_columns[None, :] + shifts.suffix_shift[:, None]  # [B, Lq]
    lower = lower_positions(positions, window=window, chunk=chunk)
    key_lower = [lower + shifts.level_shift[level, :, None] for level in range(levels)]
    return key_lower, lower - shifts.suffix_shift[:, None]


class WindowRequest(NamedTuple):
    """A layer's sliding window (or chunk) as a cache asks for it (:meth:`~hf_cascade.ops.cascade_wrapper
    .CascadeWrapper.run`): exactly one of ``window`` / ``chunk``, and what the rows' bounds are built from.

    Attributes:
        window, chunk: the layer's window or chunk (one of them; the other None).
        row_nodes: int64 ``[L, B]`` on the host (None: node 0 of every level); suffix_start: int64 ``[B]`` (None: 0).
        position_ids: the forward's ``[B or 1, Lq]``, or None (see :func:`row_shifts`).
        memo: a dict the bounds of one step are kept in (one per eager device-only step), or None.
    """

    window: int | None
    chunk: int | None
    row_nodes: Tensor | None
    suffix_start: Tensor | None
    position_ids: Tensor | None = None
    memo: dict | None = None


def window_bounds(shifts: RowShifts | None, request: WindowRequest, levels, query: Tensor, key_columns: int,
                  key_length: Tensor | None, buffers=None) -> tuple[RowShifts, tuple[list[Tensor], Tensor]]:
    """The rows' :class:`RowShifts` (``shifts``, or built now when None: the layout's first bounded layer) and each
    query's first visible column per prefix level and over the suffix (:func:`bound_columns`), int64 ``[B, Lq]``.

    ``levels``: the cache's prefix levels (their ``node_starts``); ``key_columns``: the suffix KV's columns ``S``;
    ``key_length``: the written columns (fixed buffers, int64 device scalar) or None (all ``S``). ``buffers``: a
    :class:`~hf_cascade.step_buffers.StepBuffers` new shifts are taken from (after the op's index tensors, the order
    a call gives them back: the next call of these shapes then has them at the same addresses and replays the decode
    step recorded for this one), or None. The bounds are kept in ``request.memo`` for every layer of one window.
    """
    written = key_columns if key_length is None else key_length.reshape(())
    if shifts is None:
        shifts = row_shifts(levels, request.row_nodes, request.suffix_start, query.shape[0], query.device,
                            request.position_ids, written - 1)
        if buffers is not None:
            take = lambda t: buffers.take(t.shape, t.dtype, t.device).copy_(t)  # noqa: E731
            shifts = RowShifts(take(shifts.level_shift), take(shifts.suffix_shift), shifts.first_position,
                               from_step_buffers=True)
    return shifts, memoized(request.memo, ("bounds", request.window, request.chunk, query.shape[2], key_columns),
                            lambda: bound_columns(shifts, query.shape[2], written, len(levels),
                                                  window=request.window if request.chunk is None else None,
                                                  chunk=request.chunk))


def merge_sink(out: Tensor, lse: Tensor, sinks: Tensor, *, heads_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Merge one attention sink per head (logit ``sinks[h]``, value 0) into an attention state.

    Args:
        out: ``[..., Dv]`` any float dtype; its head axis is ``heads_dim`` of ``lse`` mapped onto ``out``: pass
            ``out`` ``[B, Hq, Lq, Dv]`` with ``heads_dim=1`` or ``[B, Lq, Hq, Dv]`` with ``heads_dim=2``.
        lse: fp32 natural-log LSE ``[B, Hq, Lq]`` (-inf: no keys; the result is then out 0, lse ``s_h``).
        sinks: ``[Hq]`` any float dtype (GPT-OSS: ``module.sinks``).
    Returns:
        ``(out in out.dtype, lse fp32 [B, Hq, Lq])``, exactly ``merge_states_ref`` of the two states.
    """
    if lse.dim() != 3 or sinks.dim() != 1 or sinks.shape[0] != lse.shape[1]:
        raise ValueError(
            f"merge_sink: `lse` must be [B, Hq, Lq] and `sinks` [Hq]; got lse {tuple(lse.shape)}, sinks "
            f"{tuple(sinks.shape)}. Pass the layer's per-head sink logits (GPT-OSS: `module.sinks`)."
        )
    s = sinks.float().view(1, -1, 1)
    weight = torch.sigmoid(lse - s)  # exp(lse) / (exp(lse) + exp(s)); 0 where lse = -inf
    if heads_dim == 2:
        weight = weight.transpose(1, 2)
    elif heads_dim != 1:
        raise ValueError(f"merge_sink: `heads_dim` must be 1 ([B, Hq, Lq, Dv]) or 2 ([B, Lq, Hq, Dv]); got {heads_dim}.")
    merged = out.float() * weight.unsqueeze(-1)
    return merged.to(out.dtype), torch.logaddexp(lse, s.expand_as(lse))


def bounded_cascade_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefix_keys: Sequence[Tensor],
    prefix_values: Sequence[Tensor],
    node_starts: Sequence[Tensor],
    row_node: Sequence[Tensor],
    key_lower: Sequence[Tensor],
    suffix_lower: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    key_length: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Cascade attention (prefix levels + suffix, merged exactly) where each query sees only the keys at or after a
    lower bound: fp32 PyTorch, no host synchronisation.

    Args:
        query: ``[B, Hq, Lq, D]``; key: the suffix keys ``[B, Hkv, S, D]``; value ``[B, Hkv, S, Dv]`` (Dv may differ
            from D).
        prefix_keys, prefix_values: per level ``[Hkv, T_l, D]`` / ``[Hkv, T_l, Dv]`` (nodes packed).
        node_starts: per level int64 ``[N_l + 1]`` column offsets of the nodes; row_node: per level int64 ``[B]``
            (-1: the row has no node there).
        key_lower: per level int64 ``[B, Lq]``: the first column of ``prefix_keys[l]`` each query sees (columns of
            the row's node below it are not visible).
        suffix_lower: int64 ``[B, Lq]``: the first suffix column each query sees.
        mask, causal: over the suffix keys as in :func:`~hf_cascade.ops.suffix_attention` (bool ``[B or 1, Lq,
            S]``, or None: causal bottom-right / full); ``key_length``: int64 device scalar, suffix columns from it on
            are not written (fixed buffers).
    Returns:
        ``(out [B, Hq, Lq, Dv] fp32, lse [B, Hq, Lq] fp32)``; lse -inf (out 0) where a query sees no key.
    """
    _validate(query, key, value, prefix_keys, prefix_values, node_starts, row_node, key_lower, suffix_lower)
    levels = [(k, v, (starts, nodes)) for k, v, starts, nodes in zip(prefix_keys, prefix_values, node_starts, row_node)]
    return cascade_attention_ref(query, key, value, levels, scale=scale, mask=mask, causal=causal, softcap=softcap,
                                 key_length=key_length, key_lower=key_lower, suffix_lower=suffix_lower)


def _validate(query, key, value, prefix_keys, prefix_values, node_starts, row_node, key_lower, suffix_lower):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"{_OP}: query must be [B, Hq, Lq, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    B, Hq, Lq, D = query.shape
    if key.shape[0] != B or key.shape[-1] != D or value.shape[:3] != key.shape[:3] or Hq % key.shape[1]:
        raise ValueError(
            f"{_OP}: key {tuple(key.shape)} must be [B={B}, Hkv, S, D={D}] with Hq={Hq} a multiple of Hkv, and value "
            f"{tuple(value.shape)} [B, Hkv, S, Dv]."
        )
    levels = len(prefix_keys)
    if not len(prefix_values) == len(node_starts) == len(row_node) == len(key_lower) == levels:
        raise ValueError(
            f"{_OP}: pass one prefix value, node_starts, row_node and key_lower per prefix level; got "
            f"{levels} keys, {len(prefix_values)} values, {len(node_starts)} node_starts, {len(row_node)} row_node, "
            f"{len(key_lower)} key_lower."
        )
    for k, v in zip(prefix_keys, prefix_values):
        if k.dim() != 3 or k.shape[0] != key.shape[1] or k.shape[2] != D or v.shape != (*k.shape[:2], value.shape[-1]):
            raise ValueError(
                f"{_OP}: a prefix level must be key [Hkv={key.shape[1]}, T, D={D}] and value [Hkv, T, "
                f"Dv={value.shape[-1]}]; got {tuple(k.shape)} and {tuple(v.shape)}."
            )
    for lower in (*key_lower, suffix_lower):
        if lower.shape != (B, Lq) or lower.dtype.is_floating_point:
            raise ValueError(
                f"{_OP}: `key_lower` / `suffix_lower` must be integer [B, Lq] = [{B}, {Lq}] (first visible column per "
                f"query); got {lower.dtype} {tuple(lower.shape)}."
            )


# Which path bounded layers took, counted where Python runs (an eager forward; a recorded step's eager run and its
# recording; the custom op's body whenever it runs, a compiled step's included; not a CUDA graph's replay, nor code
# that torch.compile traced). Keys: "eager:triton" / "eager:torch" (eager forwards), "step:torch" (a compiled or
# recorded decode step on the PyTorch path), "step:op/triton" / "step:op/torch" (a decode step through
# ``torch.ops.hf_cascade.bounded_cascade_attention``, which ran the Triton kernels or the PyTorch path).
BOUNDED_PATHS: collections.Counter = collections.Counter()


def count_path(key: str) -> None:
    """Count one bounded layer's path in :data:`BOUNDED_PATHS` (nothing while torch.compile traces)."""
    if not torch.compiler.is_compiling():
        BOUNDED_PATHS[key] += 1
