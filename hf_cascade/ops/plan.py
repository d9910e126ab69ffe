"""The batch layout of cascade attention, planned once on the host (FlashInfer's plan/run).

Per prefix level a :class:`PrefixPlan` (:func:`plan_shared_prefix`: the host layout, the rows by node, the prefix
kernel's tile schedules, and how the PyTorch reference reads the level); per batch a :class:`CascadePlan`, all levels
(:func:`plan_cascade`, called by :meth:`CascadeWrapper.plan <hf_cascade.ops.cascade_wrapper.CascadeWrapper.plan>`)
with each row's node on the device. Every layer and decode step then runs on the plan. A compiled decode step reads
the layout from index tensors made from the plan (:func:`~hf_cascade.ops.cascade_wrapper.step_inputs`), so a batch
with another sharing tree re-plans here and runs the same compiled graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._backend import host_to_device

__all__ = ["CascadePlan", "PrefixPlan", "plan_cascade", "plan_shared_prefix"]

_PLAN_OP = "shared_prefix_attention"
# The PyTorch reference (ops/reference.py) reads a level one of three ways (PrefixPlan.torch_way):
# a level runs as one matmul of every row's queries against all its keys (other nodes' columns masked) where that is
# at most this many times the keys the rows read, or small;
_DENSE_WASTE = 2
_DENSE_SMALL = 4096  # rows x level keys: one matmul whatever the waste
# else a level of at least this many nodes runs as one gather of each row's node keys (a few ops per layer) instead of
# a loop over nodes (8 ops per node): hf_cascade.score's question nodes, 200 of ~9 tokens, took 40 of 100 s on 2 CPU
# cores in the loop (SmolLM2, 800 rows). Only where the rows' padded keys are at most twice the real ones.
_GATHER_MIN_NODES = 8


@dataclass(eq=False)
class PrefixPlan:
    """Schedule of one prefix level for one batch layout; build once, reuse in every layer/step.

    Built by :func:`plan_shared_prefix` (one host sync). Holds the host copy of the layout and small
    index tensors on the query device. Tile lists per ``(G * Lq, BLOCK_M)`` are cached lazily.

    Attributes:
        batch_size: B.  num_nodes: N.  total_keys: T = node_starts[N].
        node_starts: host tuple of N+1 key offsets.  row_node: host tuple of B node ids (-1 = none).
        device: device of the index tensors (the query's device).
        rows: int32 [B'] batch rows with a node, stably sorted by node.
        node_starts_dev: int64 [N+1] copy of node_starts on ``device``.
        rows_by_node: per node an int64 index tensor of its rows, or None (torch path).
    """

    batch_size: int
    num_nodes: int
    total_keys: int
    node_starts: tuple[int, ...]
    row_node: tuple[int, ...]
    device: torch.device
    rows: Tensor
    node_starts_dev: Tensor
    rows_by_node: list[Tensor | None]
    rows_per_node: tuple[int, ...]
    _tiles: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def key_row_pairs(self) -> int:
        """Sum over nodes of rows x keys: the prefix pass's work per query head and position."""
        return sum(r * (self.node_starts[n + 1] - self.node_starts[n]) for n, r in enumerate(self.rows_per_node))

    @functools.cached_property
    def gather_index(self) -> tuple[Tensor, Tensor]:
        """``(index int64 [B, max_node_len], valid bool [B, max_node_len])`` on ``device``: the key columns of each
        row's node, left-aligned (invalid entries point at column 0); rows without a node have none valid."""
        lengths = [b - a for a, b in zip(self.node_starts, self.node_starts[1:])]
        start = torch.tensor([self.node_starts[n] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        length = torch.tensor([lengths[n] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        columns = torch.arange(max(self.max_node_len, 1), dtype=torch.int64)
        valid = columns[None, :] < length[:, None]
        index = torch.where(valid, start[:, None] + columns[None, :], 0)
        return index.to(self.device), valid.to(self.device)

    @functools.cached_property
    def torch_way(self) -> str:
        """How the PyTorch reference reads this level (:func:`~hf_cascade.ops.reference.cascade_attention_ref`): ``"empty"`` (no row
        reads a key), ``"dense"`` (every row against all the level's keys, one matmul), ``"gather"`` (each row's node
        keys gathered: many short nodes) or ``"nodes"`` (node by node)."""
        pairs = self.key_row_pairs
        if pairs == 0:
            return "empty"
        everything = self.batch_size * self.total_keys
        if everything <= max(_DENSE_WASTE * pairs, _DENSE_SMALL):
            return "dense"
        if self.num_nodes >= _GATHER_MIN_NODES and self.batch_size * self.max_node_len <= 2 * pairs:
            return "gather"
        return "nodes"

    @functools.cached_property
    def dense_hide(self) -> Tensor | None:
        """bool ``[B, 1, T]`` on ``device``: True at the level's key columns a row does not read (other nodes', or
        all for a row without a node); None when every row reads every column (one node, every row on it)."""
        start = torch.tensor([self.node_starts[n] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        end = torch.tensor([self.node_starts[n + 1] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        if bool((start == 0).all()) and bool((end == self.total_keys).all()):
            return None
        columns = torch.arange(self.total_keys, dtype=torch.int64)
        hide = (columns[None, :] < start[:, None]) | (columns[None, :] >= end[:, None])
        return hide.view(self.batch_size, 1, self.total_keys).to(self.device)

    @functools.cached_property
    def gather_all_valid(self) -> bool:
        """Every row's node is ``max_node_len`` long: :attr:`gather_index` pads no row."""
        return all(n >= 0 and self.node_starts[n + 1] - self.node_starts[n] == self.max_node_len
                   for n in self.row_node)

    @functools.cached_property
    def node_row_ranges(self) -> tuple[tuple[int, int] | None, ...]:
        """Per node ``(first, last + 1)`` when its rows are consecutive batch rows (they can be read as a slice), else
        None (read them through ``rows_by_node``); ``(0, 0)`` for a node without rows."""
        members: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for row, node in enumerate(self.row_node):
            if node >= 0:
                members[node].append(row)
        return tuple((rows[0], rows[-1] + 1) if rows and rows[-1] - rows[0] + 1 == len(rows) else
                     (None if rows else (0, 0)) for rows in members)

    @functools.cached_property
    def varlen_layout(self) -> tuple[Tensor | None, Tensor, Tensor, int, int, bool]:
        """The level as packed sequences, for one variable-length attention call over all its nodes
        (:mod:`~hf_cascade.ops.builtin_cascade`): ``(order, row_offsets int32 [N+1] cumulative rows per node,
        key_offsets int32 [N+1] = node_starts, most rows of a node, longest node, every node with rows has keys)`` on
        ``device``; ``order``: int64 [B'] the rows with a node sorted by node, or None where that is every row in
        batch order (a prompt's samples side by side: nothing to gather or scatter)."""
        row_offsets = [0]
        for count in self.rows_per_node:
            row_offsets.append(row_offsets[-1] + count)
        keyed = all(b > a for a, b, r in zip(self.node_starts, self.node_starts[1:], self.rows_per_node) if r)
        in_order = all(node == sorted_node for node, sorted_node in zip(self.row_node, sorted(self.row_node))) \
            and min(self.row_node, default=0) >= 0
        return (None if in_order else self.rows.long(),
                host_to_device(torch.tensor(row_offsets, dtype=torch.int32), self.device),
                self.node_starts_dev.int(), max(self.rows_per_node, default=0), self.max_node_len, keyed)

    @functools.cached_property
    def max_node_len(self) -> int:
        return max((b - a for a, b in zip(self.node_starts, self.node_starts[1:])), default=0)

    def schedule(self, m_per_row: int, block_m: int) -> "_Schedule":
        """The kernel's tile list for ``m_per_row = G * Lq`` query rows per batch row (cached).

        Rows without keys at this level (row_node -1, or an empty node) form a last pseudo-node
        with an empty key range: its tiles write out 0 / lse -inf, so no zero-fill is needed.
        """
        key = (m_per_row, block_m)
        sched = self._tiles.get(key)
        if sched is None:
            sched = self._tiles[key] = _build_schedule(self, m_per_row, block_m)
        return sched


@dataclass(eq=False)
class _Schedule:
    """Device index tensors of one (plan, G * Lq, BLOCK_M): see ``_prefix_kernel``'s docstring."""

    rows: Tensor  # int32 [B]: covered rows sorted by node, then the uncovered rows
    row_start: Tensor  # int32 [N+2]
    node_starts: Tensor  # int64 [N+2]: node_starts + [T] (the pseudo-node is empty)
    tile_node: Tensor  # int32 [tiles]
    tile_m0: Tensor  # int32 [tiles]
    num_tiles: int


def _build_schedule(plan: PrefixPlan, m_per_row: int, block_m: int) -> _Schedule:
    starts = plan.node_starts
    groups: list[list[int]] = [[] for _ in range(plan.num_nodes + 1)]
    for b, n in enumerate(plan.row_node):
        has_keys = n >= 0 and starts[n + 1] > starts[n]
        groups[n if has_keys else plan.num_nodes].append(b)
    rows, row_start, tile_node, tile_m0 = [], [0], [], []
    for n, members in enumerate(groups):
        rows.extend(members)
        row_start.append(len(rows))
        for m0 in range(0, len(members) * m_per_row, block_m):
            tile_node.append(n)
            tile_m0.append(m0)
    dev = plan.device
    # Queued like a kernel (no wait for the work in flight: a schedule is built at a layer's first call, while the
    # prefill of the prefix nodes still runs on the GPU).
    as_dev = lambda x, dt: host_to_device(torch.tensor(x, dtype=dt), dev)  # noqa: E731
    return _Schedule(
        rows=as_dev(rows, torch.int32),
        row_start=as_dev(row_start, torch.int32),
        node_starts=as_dev([*starts, starts[-1]], torch.int64),
        tile_node=as_dev(tile_node, torch.int32),
        tile_m0=as_dev(tile_m0, torch.int32),
        num_tiles=len(tile_node),
    )


def plan_shared_prefix(
    row_node: Tensor, node_starts: Tensor, *, device: torch.device | str | None = None
) -> PrefixPlan:
    """Validate one prefix level's layout and build its :class:`PrefixPlan` (one host sync).

    Args:
        row_node: int64 [B]; node of each batch row, -1 = no node at this level.
        node_starts: int64 [N+1] (CPU or device), nondecreasing, node_starts[0] = 0.
        device: where the index tensors live (default: ``row_node.device``).
    """
    if row_node.dim() != 1 or row_node.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{_PLAN_OP}: row_node must be an int64 tensor [B]; got {row_node.dtype} with shape "
            f"{tuple(row_node.shape)}. Build it with torch.tensor(nodes, dtype=torch.long)."
        )
    if node_starts.dim() != 1 or node_starts.numel() < 1 or node_starts.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{_PLAN_OP}: node_starts must be an int64 tensor [N+1] with N >= 0; got {node_starts.dtype} "
            f"with shape {tuple(node_starts.shape)}."
        )
    starts = tuple(int(x) for x in node_starts.tolist())
    nodes = tuple(int(x) for x in row_node.tolist())
    num_nodes = len(starts) - 1
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"{_PLAN_OP}: node_starts must start at 0 and be nondecreasing; got {list(starts)[:16]}"
            f"{'...' if len(starts) > 16 else ''}. Node n owns keys [node_starts[n], node_starts[n+1])."
        )
    bad = [x for x in nodes if x < -1 or x >= num_nodes]
    if bad:
        raise ValueError(
            f"{_PLAN_OP}: row_node values must be in [-1, {num_nodes - 1}] (N = {num_nodes} nodes); "
            f"got {bad[:8]}. Use -1 for rows without a node at this level."
        )
    device = torch.device(device) if device is not None else row_node.device
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device: match query.device
        device = torch.device("cuda", torch.cuda.current_device())
    order = sorted((n, b) for b, n in enumerate(nodes) if n >= 0)  # stable: by node, then row
    counts = [0] * num_nodes
    for n, _ in order:
        counts[n] += 1
    row_start = [0]
    for c in counts:
        row_start.append(row_start[-1] + c)
    rows_host = [b for _, b in order]
    rows_by_node: list[Tensor | None] = []
    for n in range(num_nodes):
        sel = rows_host[row_start[n]:row_start[n + 1]]
        rows_by_node.append(host_to_device(torch.tensor(sel, dtype=torch.int64), device) if sel else None)
    return PrefixPlan(
        batch_size=len(nodes),
        num_nodes=num_nodes,
        total_keys=starts[-1],
        node_starts=starts,
        row_node=nodes,
        device=device,
        rows=host_to_device(torch.tensor(rows_host, dtype=torch.int32), device),
        node_starts_dev=host_to_device(torch.tensor(starts, dtype=torch.int64), device),
        rows_by_node=rows_by_node,
        rows_per_node=tuple(counts),
    )


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
