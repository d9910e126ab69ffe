"""``CascadePlan``: one batch's prefix layout, all levels, as host data and device tensors (FlashInfer's plan/run).

A cache builds one plan per batch layout on the host, before any compiled or captured step (``plan_cascade``);
every layer and decode step then runs on it. The compiled decode step calls the custom op
``torch.ops.hf_cascade.cascade_attention`` with the plan's **index tensors** (no layout ints), and every launch
choice the op makes (tile size, KV splits, fused suffix or not) is a function of tensor shapes alone. So a batch
with another sharing tree re-plans on the host and runs the same compiled graph: dynamo has nothing to specialise
on (the tensors' sizes are marked dynamic), and a CUDA graph replay reads the new layout from the op's inputs.

Per level the op takes six tensors: the tile schedule of the prefix kernel for the step's ``G * Lq`` query rows
per batch row (``rows`` int32 [B], ``row_start`` int32 [N+2], ``node_starts`` int64 [N+2], ``tile_node`` /
``tile_m0`` int32 [tiles]; see ``_prefix_kernel``), and ``row_node`` int64 [B] (the torch path's key mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._backend import host_to_device, resolve_backend
from ._cascade_torch import dense_part, heads_major, joint_softmax, suffix_part
from .cascade_attention import cascade_attention, launch_cascade, launch_configs
from .prefix_attention import PrefixPlan, _Schedule, plan_shared_prefix
from .suffix_attention import mask_with_key_length

__all__ = ["COMPILED_LEVELS", "CascadePlan", "padded_level_count", "plan_cascade"]

_TENSORS_PER_LEVEL = 6
# A compiled step takes at least this many prefix levels: a tree with fewer is padded with empty levels in front
# (no node, so the op launches nothing for them), so trees of 1 to 4 levels share one graph. Deeper trees compile
# one graph per level count.
COMPILED_LEVELS = 4
_NO_OP_TILE_M0 = 1 << 30  # a tile past every node's rows: reads nothing, writes nothing


@dataclass(eq=False)
class CascadePlan:
    """The prefix layout of one batch (all levels) on one device.

    Attributes:
        levels: per level the :class:`PrefixPlan` (host layout, device row lists, cached tile schedules).
        row_node: per level int64 ``[B]`` on the device: the node of each row (-1 none).
    """

    levels: tuple[PrefixPlan, ...]
    row_node: tuple[Tensor, ...]
    _inputs: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return self.levels[0].batch_size if self.levels else 0

    def prefixes(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> list[tuple[Tensor, Tensor, PrefixPlan]]:
        """``[(prefix_key [Hkv, T_l, D], prefix_value, PrefixPlan)]`` for :func:`cascade_attention` (eager)."""
        return list(zip(keys, values, self.levels))

    def op_inputs(self, query: Tensor, key: Tensor, prefix_keys: Sequence[Tensor], buffers=None) -> list[Tensor]:
        """The index tensors of the compiled op for a step with ``query`` ``[B, Hq, Lq, D]`` (built once per
        ``(G, Lq)`` and cached; call it eagerly before a CUDA graph captures the step).

        ``prefix_keys``: per level ``[Hkv, T_l, D]``, as the compiled step passes them: the real levels last,
        after ``len(prefix_keys) - len(self.levels)`` padding levels (see :func:`padded_level_count`).
        ``buffers``: a :class:`~hf_cascade.decode.step_buffers.StepBuffers`; the tensors are copies in tensors taken from
        it, in the order returned (so that a later layout of the same sizes has them at the same addresses).

        What may change between two layouts is a size of dimension 0 of these tensors (nodes + 2, tiles), marked
        dynamic; each is >= 2 (a no-op tile is appended to a 1-tile list), so that no layout gets a size dynamo
        specialises (0 or 1)."""
        B, Hq, Lq, D = query.shape
        Hkv = key.shape[1]
        pad = len(prefix_keys) - len(self.levels)
        if pad < 0:
            raise ValueError(f"op_inputs: {len(prefix_keys)} prefix keys for a plan of {len(self.levels)} levels.")
        cache_key = (Hq // Hkv, Lq, D, query.dtype, tuple(k.shape[1] for k in prefix_keys), key.shape[2])
        tensors = self._inputs.get(cache_key)
        if tensors is None:
            # Every tensor its own object (dynamo guards on which inputs alias; a padding slot holds a real level
            # in another batch).
            levels = self._padding(pad) + self.levels
            fuse, configs = launch_configs(query, key, [(k, None, p) for k, p in zip(prefix_keys, levels)],
                                           shape_only=True)
            row_nodes = tuple(torch.full((B,), -1, dtype=torch.int64, device=query.device) for _ in range(pad))
            row_nodes += self.row_node
            tensors = []
            for plan, row_node, (sched, *_rest) in zip(levels, row_nodes, configs):
                tile_node, tile_m0 = sched.tile_node, sched.tile_m0
                if tile_node.numel() < 2:
                    tile_node = torch.cat([tile_node, tile_node.new_full((1,), plan.num_nodes)])
                    tile_m0 = torch.cat([tile_m0, tile_m0.new_full((1,), _NO_OP_TILE_M0)])
                level_tensors = [sched.rows, sched.row_start, sched.node_starts, tile_node, tile_m0, row_node]
                if buffers is not None:
                    level_tensors = [buffers.take(t.shape, t.dtype, t.device).copy_(t) for t in level_tensors]
                for t in level_tensors[1:5]:  # the layout: sizes that differ between trees
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                tensors += level_tensors
            self._inputs[cache_key] = tensors
        return tensors

    def _padding(self, count: int) -> tuple[PrefixPlan, ...]:
        """``count`` empty levels (no row has keys there) for :meth:`op_inputs`."""
        if count == 0:
            return ()
        device = self.row_node[0].device if self.row_node else torch.device("cpu")
        return tuple(plan_shared_prefix(torch.full((self.batch_size,), -1, dtype=torch.int64),
                                        torch.zeros(1, dtype=torch.int64), device=device) for _ in range(count))


def padded_level_count(num_levels: int) -> int:
    """The number of prefix levels a compiled step takes for a tree of ``num_levels`` levels."""
    return max(num_levels, COMPILED_LEVELS)


def plan_cascade(
    row_nodes: Tensor | None, node_starts: Sequence[Sequence[int]], batch_size: int, device: torch.device
) -> CascadePlan:
    """Build the plan of a batch: ``row_nodes`` int64 ``[L, B]`` on the host (None: every row reads node 0 of
    every level), ``node_starts[l]`` the ``N_l + 1`` key offsets of level ``l``'s packed nodes."""
    levels, row_node_dev = [], []
    for level, starts in enumerate(node_starts):
        nodes = torch.zeros(batch_size, dtype=torch.int64) if row_nodes is None else row_nodes[level]
        plan = plan_shared_prefix(nodes, torch.tensor(list(starts), dtype=torch.int64), device=device)
        levels.append(plan)
        row_node_dev.append(host_to_device(nodes, plan.device))
    return CascadePlan(tuple(levels), tuple(row_node_dev))


def _planned_attention(query, key, value, prefix_keys, prefix_values, plan_tensors, mask, scale, softcap,
                       backend: str = "auto", key_length=None):
    """The op's body: launch choices from shapes only, the layout from ``plan_tensors``."""
    levels = [plan_tensors[i : i + _TENSORS_PER_LEVEL] for i in range(0, len(plan_tensors), _TENSORS_PER_LEVEL)]
    # A level of no node (node_starts [N + 2] with N = 0: the padding of a shallower tree) has no keys for any
    # row: nothing to launch. A shape, so a CUDA graph recorded for this layout's shapes holds no launch for it.
    kept = [i for i, t in enumerate(levels) if t[2].shape[0] > 2]
    if len(kept) < len(levels):
        levels = [levels[i] for i in kept]
        prefix_keys, prefix_values = [prefix_keys[i] for i in kept], [prefix_values[i] for i in kept]
    if resolve_backend(backend, query.device, "cascade_attention") == "torch" or not levels:
        mask = mask_with_key_length(mask, key_length, query.shape[2], key.shape[2], True, key.device)
        out, lse = _planned_torch(query, key, value, prefix_keys, prefix_values, levels, mask, scale, softcap)
    else:
        schedules = [
            _Schedule(rows=t[0], row_start=t[1], node_starts=t[2], tile_node=t[3], tile_m0=t[4],
                      num_tiles=t[3].numel())
            for t in levels
        ]
        fuse, configs = launch_configs(query, key, list(zip(prefix_keys, [None] * len(levels), schedules)),
                                       shape_only=True)
        out, lse = launch_cascade(query, key, value, list(zip(prefix_keys, prefix_values)), configs, fuse,
                                  scale=scale, mask=mask, causal=True, softcap=softcap, key_length=key_length)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


def _planned_torch(query, key, value, prefix_keys, prefix_values, levels, mask, scale, softcap):
    """fp32 from the index tensors alone (no host sync): every row's queries against all keys of each level (the
    other nodes' columns masked) and its suffix, in one softmax (``ops/_cascade_torch.py``)."""
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[1]
    q = query.float().reshape(B * Hkv, Hq // Hkv * Lq, D)
    q_heads = heads_major(q, B, Hkv) if levels else None
    parts = []
    for k_pre, v_pre, tensors in zip(prefix_keys, prefix_values, levels):
        node_starts, row_node = tensors[2], tensors[5]
        T = k_pre.shape[1]
        has_node = row_node >= 0
        node = row_node.clamp(min=0)
        start = torch.where(has_node, node_starts[node], 0)
        end = torch.where(has_node, node_starts[node + 1], 0)
        columns = torch.arange(T, device=query.device)
        hide = (columns[None, :] < start[:, None]) | (columns[None, :] >= end[:, None])  # [B, T]
        parts.append(dense_part(q_heads, k_pre, v_pre, hide.view(1, B, 1, T), scale, softcap))
    suffix_part(parts, q, query, key, value, mask, True, scale, softcap)
    return joint_softmax(parts, query, Hkv, value.shape[-1])


@torch.library.custom_op(
    "hf_cascade::cascade_attention",
    mutates_args=(),
    schema=(
        "(Tensor query, Tensor key, Tensor value, Tensor[] prefix_keys, Tensor[] prefix_values, Tensor[] plan, "
        "Tensor? mask, float scale, float? softcap, int? layer=None, Tensor? key_length=None) -> (Tensor, Tensor)"
    ),
)
def _cascade_attention_op(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer=None,
                          key_length=None):
    """``layer``: None when ``prefix_keys``/``prefix_values`` are one layer's ``[Hkv, T, D]`` per level; else they
    are every layer's ``[layers, Hkv, T, D]`` per level and this layer's are read from them here (a compiled step
    then traces no per-layer views of them). ``key_length``: the written suffix keys (see ``cascade_attention``)."""
    if layer is not None:
        prefix_keys = [k[layer] for k in prefix_keys]
        prefix_values = [v[layer] for v in prefix_values]
    return _planned_attention(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap,
                              key_length=key_length)


@_cascade_attention_op.register_fake
def _(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer=None, key_length=None):
    B, Hq, Lq, _ = query.shape
    out = query.new_empty((B, Lq, Hq, value.shape[-1]))
    lse = query.new_empty((B, Hq, Lq), dtype=torch.float32)
    return out, lse


def cascade_attention_planned(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefix_keys: Sequence[Tensor],
    prefix_values: Sequence[Tensor],
    plan: CascadePlan,
    *,
    scale: float,
    mask: Tensor | None = None,
    softcap: float | None = None,
    compiled: bool = False,
    key_length: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cascade attention of one layer on a :class:`CascadePlan`; causal suffix.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: the suffix KV ``[B, Hkv, S, D]``.
        prefix_keys, prefix_values: per level ``[Hkv, T_l, D]``.
        mask: None (causal, bottom-right) or bool ``[B or 1, Lq, S]`` over the suffix keys.
        compiled: go through the custom op with the plan's index tensors (inside ``torch.compile``).
        key_length: the written suffix keys (int64 device scalar; fixed buffers), as in ``cascade_attention``.
        return_lse: also return the LSE (to merge more states, e.g. attention sinks).
    Returns:
        ``[B, Lq, Hq, D]`` contiguous, in ``query.dtype``; with ``return_lse``, ``(that, lse [B, Hq, Lq] fp32)``.
    """
    if not len(prefix_keys) == len(prefix_values) == len(plan.levels):
        raise ValueError(
            f"cascade_attention: got {len(prefix_keys)} prefix keys, {len(prefix_values)} prefix values and a plan "
            f"of {len(plan.levels)} levels; pass one of each per prefix level."
        )
    if compiled:
        out, lse = torch.ops.hf_cascade.cascade_attention(
            query, key, value, list(prefix_keys), list(prefix_values), plan.op_inputs(query, key, prefix_keys),
            mask, scale, softcap, key_length=key_length,
        )
    else:
        out, lse = cascade_attention(query, key, value, plan.prefixes(prefix_keys, prefix_values), scale=scale,
                                     mask=mask, causal=True, softcap=softcap, key_length=key_length)
        out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out
