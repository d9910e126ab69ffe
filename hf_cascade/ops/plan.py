"""``CascadePlan``: one batch's prefix layout, all levels, as host data and device tensors (FlashInfer's plan/run).

A cache plans its rows once per batch layout on the host, before any compiled or recorded step
(:meth:`CascadeWrapper.plan <hf_cascade.ops.cascade_wrapper.CascadeWrapper.plan>`, which calls
:func:`plan_cascade`); every layer and decode step then runs on the plan. Per level it holds a
:class:`~hf_cascade.ops.prefix_attention.PrefixPlan` (the host layout, the rows by node, the prefix kernel's tile
schedules) and each row's node on the device. A compiled decode step reads the layout from index tensors made from
the plan (:func:`~hf_cascade.ops.cascade_wrapper.step_inputs`), so a batch with another sharing tree re-plans here
and runs the same compiled graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._backend import host_to_device
from .prefix_attention import PrefixPlan, plan_shared_prefix

__all__ = ["CascadePlan", "plan_cascade"]


@dataclass(eq=False)
class CascadePlan:
    """The prefix layout of one batch (all levels) on one device.

    Attributes:
        levels: per level the :class:`PrefixPlan` (host layout, device row lists, cached tile schedules).
        row_node: per level int64 ``[B]`` on the device: the node of each row (-1 none).
    """

    levels: tuple[PrefixPlan, ...]
    row_node: tuple[Tensor, ...]

    @property
    def batch_size(self) -> int:
        return self.levels[0].batch_size if self.levels else 0

    def prefixes(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> list[tuple[Tensor, Tensor, PrefixPlan]]:
        """``[(prefix_key [Hkv, T_l, D], prefix_value, PrefixPlan)]`` for :func:`cascade_attention` (eager)."""
        return list(zip(keys, values, self.levels))


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
