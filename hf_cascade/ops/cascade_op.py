"""``torch.ops.hf_cascade.cascade_attention``: :func:`cascade_attention` as a PyTorch custom op, for compiled decoding.

``torch.compile`` cannot trace what :func:`cascade_attention` does on the host (prefix schedules, Triton launch
choices), and CUDA graphs must not see it either. The compiled path therefore calls the op through an opaque
custom op: dynamo records one node per attention layer, CUDA graphs capture the kernels it launches. The prefix
layout (which node each row reads at each level) travels as plain ints, so the op carries no Python objects; its
:class:`~hf_cascade.ops.PrefixPlan` is built once per layout and device (host work, then cached here) and reused by
every layer and step. Eager callers use :func:`cascade_attention_with_layout` directly (same code, no dispatch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from ._backend import resolve_backend
from .cascade_attention import cascade_attention, launch_plan
from .prefix_attention import PrefixPlan, plan_shared_prefix

__all__ = ["LevelLayout", "cascade_attention_with_layout", "encode_layouts", "layout_plan", "prepare_cascade_attention"]

# One prefix level: (row_node: node of each batch row, -1 = none; node_starts: N + 1 key offsets).
LevelLayout = tuple[tuple[int, ...], tuple[int, ...]]

_MAX_PLANS = 64
_PLANS: OrderedDict[tuple, PrefixPlan] = OrderedDict()
# Plans a CUDA graph has captured: the graph reads their index tensors at fixed addresses on every replay, so they
# are never evicted (a few KiB each, one per compiled batch layout).
_CAPTURED_PLANS: dict[tuple, PrefixPlan] = {}


def layout_plan(row_node: tuple[int, ...], node_starts: tuple[int, ...], device: torch.device) -> PrefixPlan:
    """The :class:`PrefixPlan` of one level layout on ``device`` (built on first use, then cached; LRU of 64,
    except plans used while a CUDA graph was capturing, which are kept for good)."""
    key = (row_node, node_starts, device)
    plan = _CAPTURED_PLANS.get(key)
    if plan is not None:
        return plan
    plan = _PLANS.get(key)
    if plan is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED_PLANS[key] = plan
        del _PLANS[key]
    elif plan is None:
        plan = plan_shared_prefix(
            torch.tensor(row_node, dtype=torch.int64), torch.tensor(node_starts, dtype=torch.int64), device=device
        )
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def cascade_attention_with_layout(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefix_keys: Sequence[Tensor],
    prefix_values: Sequence[Tensor],
    layouts: Sequence[LevelLayout],
    *,
    scale: float,
    mask: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`cascade_attention` with each level given by its layout instead of a plan; causal suffix.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: the suffix KV ``[B, Hkv, S, D]``.
        prefix_keys, prefix_values: per level ``[Hkv, T_l, D]``.
        layouts: per level ``(row_node, node_starts)`` host int tuples (``len(row_node) == B``).
        mask: None (causal, bottom-right) or bool ``[B or 1, Lq, S]`` over the suffix keys.
    Returns:
        ``(out [B, Lq, Hq, D] contiguous in query.dtype, lse [B, Hq, Lq] float32)``.
    """
    if not len(prefix_keys) == len(prefix_values) == len(layouts):
        raise ValueError(
            f"cascade_attention: got {len(prefix_keys)} prefix keys, {len(prefix_values)} prefix values and "
            f"{len(layouts)} layouts; pass one of each per prefix level."
        )
    prefixes = [
        (k, v, layout_plan(row_node, node_starts, query.device))
        for k, v, (row_node, node_starts) in zip(prefix_keys, prefix_values, layouts)
    ]
    out, lse = cascade_attention(query, key, value, prefixes, scale=scale, mask=mask, causal=True, softcap=softcap)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


def prepare_cascade_attention(
    query: Tensor, key: Tensor, prefix_keys: Sequence[Tensor], layouts: Sequence[LevelLayout]
) -> None:
    """Do the host-side planning of a :func:`cascade_attention_with_layout` call with these shapes now (plans,
    tile schedules, launch choices; all cached). Call it eagerly before a CUDA graph captures such calls:
    torch.compile's CUDA graphs reject tensors created during their warm-up that outlive it."""
    plans = [layout_plan(row_node, node_starts, query.device) for row_node, node_starts in layouts]
    if prefix_keys and resolve_backend("auto", query.device, "cascade_attention") == "triton":
        launch_plan(query, key, [(k, None, plan) for k, plan in zip(prefix_keys, plans)])


def encode_layouts(layouts: Sequence[LevelLayout]) -> list[int]:
    """Flatten level layouts to the op's ``int[]``: ``[B, N+1, *row_node, *node_starts]`` per level."""
    flat: list[int] = []
    for row_node, node_starts in layouts:
        flat += [len(row_node), len(node_starts), *row_node, *node_starts]
    return flat


def _decode_layouts(flat: Sequence[int]) -> list[LevelLayout]:
    layouts, i = [], 0
    while i < len(flat):
        batch, num_starts = flat[i], flat[i + 1]
        i += 2
        row_node = tuple(flat[i : i + batch])
        node_starts = tuple(flat[i + batch : i + batch + num_starts])
        i += batch + num_starts
        layouts.append((row_node, node_starts))
    return layouts


@torch.library.custom_op(
    "hf_cascade::cascade_attention",
    mutates_args=(),
    schema=(
        "(Tensor query, Tensor key, Tensor value, Tensor[] prefix_keys, Tensor[] prefix_values, int[] layout, "
        "Tensor? mask, float scale, float? softcap) -> (Tensor, Tensor)"
    ),
)
def _cascade_attention_op(query, key, value, prefix_keys, prefix_values, layout, mask, scale, softcap):
    return cascade_attention_with_layout(
        query, key, value, prefix_keys, prefix_values, _decode_layouts(layout), scale=scale, mask=mask,
        softcap=softcap,
    )


@_cascade_attention_op.register_fake
def _(query, key, value, prefix_keys, prefix_values, layout, mask, scale, softcap):
    B, Hq, Lq, D = query.shape
    out = query.new_empty((B, Lq, Hq, D))
    lse = query.new_empty((B, Hq, Lq), dtype=torch.float32)
    return out, lse
