"""``CascadePlan``: one batch's prefix layout, all levels, as host data and device tensors (FlashInfer's plan/run).

A cache builds one plan per batch layout on the host, before any compiled or captured step (``plan_cascade``,
through :class:`~hf_cascade.ops.cascade_wrapper.CascadeWrapper`); every layer and decode step then runs on it. The
compiled decode step calls the custom op ``hf_cascade::cascade_attention`` with the plan's **index tensors** (no
layout ints), and every launch choice the op makes (tile size, KV splits, fused suffix or not) is a function of
tensor shapes alone. So a batch with another sharing tree re-plans on the host and runs the same compiled graph:
dynamo has nothing to specialise on (the tensors' sizes are marked dynamic), and a CUDA graph replay reads the new
layout from the op's inputs.

Per level the op takes the six tensors of a :class:`LevelTensors`: the tile schedule of the prefix kernel for the
step's ``G * Lq`` query rows per batch row (``rows`` int32 [B], ``row_start`` int32 [N+2], ``node_starts`` int64
[N+2], ``tile_node`` / ``tile_m0`` int32 [tiles]; see ``_prefix_kernel``), and ``row_node`` int64 [B] (the torch
path's key mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ._backend import host_to_device
from .cascade_attention import launch_configs
from .prefix_attention import PrefixPlan, _Schedule, plan_shared_prefix

__all__ = ["COMPILED_LEVELS", "CascadePlan", "LevelTensors", "padded_level_count", "plan_cascade"]


class LevelTensors(NamedTuple):
    """One prefix level's index tensors as the compiled op reads them (see the module docstring)."""

    rows: Tensor  # int32 [B]: rows sorted by node, then the rows without keys here
    row_start: Tensor  # int32 [N + 2]
    node_starts: Tensor  # int64 [N + 2]: the nodes' key offsets + [T] (the keyless rows' empty pseudo-node)
    tile_node: Tensor  # int32 [tiles]
    tile_m0: Tensor  # int32 [tiles]
    row_node: Tensor  # int64 [B]: each row's node, -1 none

    def schedule(self) -> _Schedule:
        """The prefix kernel's tile schedule these tensors hold."""
        return _Schedule(rows=self.rows, row_start=self.row_start, node_starts=self.node_starts,
                         tile_node=self.tile_node, tile_m0=self.tile_m0, num_tiles=self.tile_node.numel())

    @staticmethod
    def unflatten(tensors: Sequence[Tensor]) -> list["LevelTensors"]:
        """The levels of the op's flat ``Tensor[]`` argument (``len(LevelTensors._fields)`` tensors a level)."""
        n = len(LevelTensors._fields)
        return [LevelTensors(*tensors[i : i + n]) for i in range(0, len(tensors), n)]


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

    def op_inputs(self, query: Tensor, key: Tensor, prefix_keys: Sequence[Tensor],
                  buffers=None) -> tuple[LevelTensors, ...]:
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
            tensors = ()
            for plan, row_node, (sched, *_rest) in zip(levels, row_nodes, configs):
                tile_node, tile_m0 = sched.tile_node, sched.tile_m0
                if tile_node.numel() < 2:
                    tile_node = torch.cat([tile_node, tile_node.new_full((1,), plan.num_nodes)])
                    tile_m0 = torch.cat([tile_m0, tile_m0.new_full((1,), _NO_OP_TILE_M0)])
                level = LevelTensors(sched.rows, sched.row_start, sched.node_starts, tile_node, tile_m0, row_node)
                if buffers is not None:
                    level = LevelTensors(*(buffers.take(t.shape, t.dtype, t.device).copy_(t) for t in level))
                for t in (level.row_start, level.node_starts, level.tile_node, level.tile_m0):  # differ between trees
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                tensors += (level,)
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
