"""``CascadeWrapper``: the one door from a cache to the cascade attention kernels (FlashInfer's plan/run wrappers).

A cache keeps its storage (the shared-prefix levels, the rows' suffix KV) and its rows' layout; the wrapper owns what
attention needs of them: the batch layout's :class:`~hf_cascade.ops.plan.CascadePlan` (``plan(...)``, once per
layout), the tensors a compiled or recorded decode step reads (the prefix KV slots and the op's index tensors), and
every call of the custom op ``hf_cascade::cascade_attention`` (``run(layer, ...)``, per layer): an eager launch, the
built-in kernels (:mod:`~hf_cascade.ops.builtin_cascade`), or the op while a step is compiled or recorded.

The op takes the layout as **index tensors** only (no layout ints; :func:`step_inputs`), and every launch choice it
makes (tile size, KV splits, fused suffix or not) is a function of tensor shapes alone. So a batch with another
sharing tree re-plans on the host and runs the same compiled graph: dynamo has nothing to specialise on (the
tensors' sizes are marked dynamic), and a CUDA graph replay reads the new layout from the op's inputs. Per level the
op takes the six tensors of a :class:`LevelTensors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._launch import launch_cascade, launch_configs
from .bounded import RowShifts, WindowRequest, count_path, window_bounds
from .cascade_attention import cascade_attention
from .plan import CascadePlan, _Schedule, plan_cascade, plan_shared_prefix
from .reference import cascade_attention_ref

__all__ = ["COMPILED_LEVELS", "CascadeWrapper", "LevelKV", "LevelTensors", "PrefixSlots", "bounded_planned_attention",
           "bounded_prefixes", "padded_level_count", "planned_attention", "step_inputs"]

# A compiled step takes at least this many prefix levels: a tree with fewer is padded with empty levels in front
# (no node, so the op launches nothing for them), so trees of 1 to 4 levels share one graph. Deeper trees compile
# one graph per level count.
COMPILED_LEVELS = 4
_NO_OP_TILE_M0 = 1 << 30  # a tile past every node's rows: reads nothing, writes nothing


def padded_level_count(num_levels: int) -> int:
    """The number of prefix levels a compiled step takes for a tree of ``num_levels`` levels."""
    return max(num_levels, COMPILED_LEVELS)


class LevelKV(NamedTuple):
    """One prefix level's KV by layer, as :meth:`CascadeWrapper.run` reads it (a
    :class:`~hf_cascade.prefill.PrefixLevel` has the same two members): ``keys[layer]`` ``[Hkv, T, D]``,
    ``values[layer]`` ``[Hkv, T, Dv]``; a list over layers, or a dict of the layers at hand."""

    keys: Sequence[Tensor] | Mapping[int, Tensor]
    values: Sequence[Tensor] | Mapping[int, Tensor]


class PrefixSlots(NamedTuple):
    """The prefix KV a compiled step reads: per level slot, every layer's keys (values) as one tensor
    ``[layers, Hkv, T, D]`` (see ``CascadeCache._pad_prefix_levels``)."""

    keys: list[Tensor]
    values: list[Tensor]


class LevelTensors(NamedTuple):
    """One prefix level's index tensors as the compiled op reads them: the prefix kernel's tile schedule for the
    step's ``G * Lq`` query rows per batch row (see ``_prefix_kernel``) and each row's node (the torch path's key
    mask)."""

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


class CascadeWrapper:
    """Plan once per batch layout, run per layer.

    Attributes:
        layout: the :class:`CascadePlan` of the current rows, or None before :meth:`plan`.
        prefix_slots: :class:`PrefixSlots` (fixed buffers; set once per cache) or None.
        op_inputs: the op's index tensors for a one-query step on ``layout`` (:func:`step_inputs`, flat), planned
            by the first eager :meth:`run` after the slots are set, before any step is compiled or recorded; or None.
        buffers: a :class:`~hf_cascade.step_buffers.StepBuffers` the index tensors are taken from, or None.
        builtin: attend with PyTorch's own kernels (:mod:`~hf_cascade.ops.builtin_cascade`) outside ``torch.compile``.
        shifts: the rows' :class:`~hf_cascade.ops.bounded.RowShifts`, built by the layout's first bounded layer
            (sliding windows, chunks), or None.
    """

    def __init__(self):
        self.layout: CascadePlan | None = None
        self._row_nodes: Tensor | None = None
        self._planned_for: tuple | None = None
        self.prefix_slots: PrefixSlots | None = None
        self.op_inputs: list[Tensor] | None = None
        self.buffers = None
        self.builtin = False
        self.shifts: RowShifts | None = None

    def reset(self) -> None:
        """The rows' layout changed: drop the plan, the op's index tensors and the rows' shifts (the prefix slots
        stay)."""
        self.layout = self._row_nodes = self._planned_for = self.op_inputs = self.shifts = None

    def plan(self, row_nodes: Tensor | None, node_starts: Sequence[Sequence[int]], batch_size: int,
             device: torch.device) -> CascadePlan:
        """The plan of ``batch_size`` rows (see :func:`~hf_cascade.ops.plan.plan_cascade`), built on the host when
        the rows (the same ``row_nodes`` object), the batch size, the device or a level's key count differ from the
        last call's; a caller whose rows change otherwise calls :meth:`reset` first."""
        planned_for = (batch_size, torch.device(device), tuple(starts[-1] for starts in node_starts))
        if self.layout is None or self._row_nodes is not row_nodes or self._planned_for != planned_for:
            self.reset()
            self.layout = plan_cascade(row_nodes, node_starts, batch_size, device)
            self._row_nodes, self._planned_for = row_nodes, planned_for
        return self.layout

    def run(self, layer: int, query: Tensor, key: Tensor, value: Tensor, levels: Sequence[LevelKV], *, scale: float,
            mask: Tensor | None = None, causal: bool = True, softcap: float | None = None,
            key_length: Tensor | None = None, static: bool = False,
            window: WindowRequest | None = None) -> tuple[Tensor, Tensor]:
        """Cascade attention of layer ``layer`` on the planned layout (no level: each row over its own suffix).

        Args:
            query: ``[B, Hq, Lq, D]``; key, value: the rows' suffix KV ``[B, Hkv, S, D / Dv]``.
            levels: per level its KV of every layer (read only outside a compiled or recorded step's op).
            mask: None (causal, bottom-right; full with ``causal=False``) or bool ``[B or 1, Lq, S]`` over the suffix.
            key_length: the written suffix keys (int64 device scalar; fixed buffers), as in ``cascade_attention``.
            static: a compiled or recorded decode step: with prefix slots, the op on the index tensors (device
                work only, no plan read on the host; a causal suffix).
            window: a sliding window's or chunk's :class:`~hf_cascade.ops.bounded.WindowRequest` (each query's keys
                start at a lower bound, ``hf_cascade.windows``; causal); None: no lower bound.
        Returns:
            ``(out [B, Lq, Hq, Dv] contiguous in query.dtype, lse [B, Hq, Lq] fp32)``.
        """
        builtin = self.builtin and not torch.compiler.is_compiling()
        if not (static or builtin):
            self.plan_step(layer, query, key)
        bounds = None
        if window is not None:  # each query's first visible column (the op's index tensors first: buffer order)
            in_buffers = self.buffers is not None and self.op_inputs is not None and not (static or self.builtin)
            self.shifts, bounds = window_bounds(self.shifts, window, levels, query, key.shape[2], key_length,
                                                self.buffers if in_buffers else None)
        op = static and self.prefix_slots is not None and not builtin
        if op and bounds is None:
            # The padded levels: the graph reads no level count (a tree of 1 to 4 levels is the same graph).
            return torch.ops.hf_cascade.cascade_attention(query, key, value, self.prefix_slots.keys,
                                                          self.prefix_slots.values, self.op_inputs, mask, scale,
                                                          softcap, layer, key_length)
        if op and levels and self.op_inputs is not None and key_length is not None and query.shape[2] == 1:
            return torch.ops.hf_cascade.bounded_cascade_attention(
                query, key, value, self.prefix_slots.keys, self.prefix_slots.values, self.op_inputs, mask, scale,
                softcap, layer, key_length, list(bounds[0]), bounds[1])
        prefixes, backend = self._eager_prefixes(layer, levels, query.device, static, builtin, bounds is not None)
        out, lse = cascade_attention(query, key, value, prefixes, scale=scale, mask=mask,
                                     causal=causal or bounds is not None, softcap=softcap, backend=backend,
                                     key_length=None if backend == "builtin" else key_length,
                                     key_lower=None if bounds is None else list(bounds[0]),
                                     suffix_lower=None if bounds is None else bounds[1])
        return out.transpose(1, 2).contiguous(), lse

    def _eager_prefixes(self, layer: int, levels: Sequence[LevelKV], device: torch.device, static: bool,
                        builtin: bool, bounded: bool) -> tuple[list, str]:
        """The prefix levels and backend of a :func:`cascade_attention` call outside the op: ``(prefixes, backend)``.

        Bounded (a window or chunk): the Triton kernels where they run eagerly, else the PyTorch path on the
        layout's device index tensors (no host data: a compiled or recorded step, the built-in tier, CPUs).
        Unbounded: the Triton kernels (PyTorch on CPUs), or in the built-in tier PyTorch's own kernels (the fp32
        PyTorch path for a batch sharing nothing)."""
        prefix_keys, prefix_values = [lv.keys[layer] for lv in levels], [lv.values[layer] for lv in levels]
        if not bounded:
            prefixes = self.layout.prefixes(prefix_keys, prefix_values) if levels else []
            return prefixes, ("builtin" if levels else "torch") if builtin else "auto"
        backend = resolve_backend("torch" if static or builtin else "auto", device, "cascade_attention")
        count_path(f"{'step' if static else 'eager'}:{backend}")
        return bounded_prefixes(self.layout, prefix_keys, prefix_values, backend), backend

    def plan_step(self, layer: int, query: Tensor, key: Tensor) -> None:
        """Plan the decode step's index tensors (:attr:`op_inputs`, one query position) now, eagerly, outside its
        CUDA graphs, where the prefix slots are set and they are not planned yet (the first eager layer of a layout
        plans them, bounded or not)."""
        if self.prefix_slots is not None and self.op_inputs is None:
            tensors = step_inputs(self.layout, query[:, :, -1:], key, [slot[layer] for slot in self.prefix_slots.keys],
                                  buffers=self.buffers)
            self.op_inputs = [t for level in tensors for t in level]


def bounded_prefixes(plan: CascadePlan | None, prefix_keys: Sequence[Tensor], prefix_values: Sequence[Tensor],
                     backend: str) -> list[tuple]:
    """The prefix levels of a bounded :func:`cascade_attention` call on ``plan`` (None without prefix levels): with
    the plan's :class:`~hf_cascade.ops.plan.PrefixPlan` per level on Triton, with its device index tensors
    ``(node_starts [N + 1], row_node [B])`` on PyTorch (no host data, as a compiled step needs)."""
    if plan is None:
        return []
    if backend == "triton":
        return plan.prefixes(prefix_keys, prefix_values)
    return [(k, v, (level.node_starts_dev, row_node))
            for k, v, level, row_node in zip(prefix_keys, prefix_values, plan.levels, plan.row_node)]


def bounded_planned_attention(query: Tensor, key: Tensor, value: Tensor, plan: CascadePlan | None,
                              prefix_keys: Sequence[Tensor], prefix_values: Sequence[Tensor], mask: Tensor | None, *,
                              scale: float, softcap: float | None, key_length: Tensor | None,
                              key_lower: Sequence[Tensor], suffix_lower: Tensor,
                              backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Causal cascade attention on ``plan`` with a lower bound on every query's keys (a sliding window or a chunk),
    for a layout given by hand (:func:`hf_cascade.windows.bounded_attend`; a cache runs :meth:`CascadeWrapper.run`).

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: the suffix KV ``[B, Hkv, S, D / Dv]``; prefix_keys/values: per level
            ``[Hkv, T_l, D / Dv]``; mask: bool ``[B or 1, Lq, S]`` over the suffix, or None (causal).
        plan: the layout's :class:`~hf_cascade.ops.plan.CascadePlan` (None without prefix levels).
        key_length: the written suffix columns (fixed buffers, int64 device scalar) or None (all S).
        key_lower: int64 ``[B, Lq]`` per level, each query's first visible column of the level;
            suffix_lower: int64 ``[B, Lq]``, the same over the suffix (:mod:`~hf_cascade.ops.bounded`).
        backend: "auto" (the Triton kernels with the bounds on CUDA, else PyTorch), "triton" or "torch" (the
            layout's device tensors only: no host data, as a compiled step needs).
    Returns:
        ``(out [B, Lq, Hq, Dv] contiguous in query.dtype, lse [B, Hq, Lq] fp32)``.
    """
    backend = resolve_backend(backend, query.device, "cascade_attention")
    out, lse = cascade_attention(query, key, value, bounded_prefixes(plan, prefix_keys, prefix_values, backend),
                                 scale=scale, mask=mask, causal=True, softcap=softcap, backend=backend,
                                 key_length=key_length, key_lower=list(key_lower), suffix_lower=suffix_lower)
    return out.transpose(1, 2).contiguous(), lse


def step_inputs(plan: CascadePlan, query: Tensor, key: Tensor, prefix_keys: Sequence[Tensor],
                buffers=None) -> tuple[LevelTensors, ...]:
    """The index tensors of the compiled op for a step on ``plan`` with ``query`` ``[B, Hq, Lq, D]`` (call it
    eagerly, before a CUDA graph captures the step).

    ``prefix_keys``: per level ``[Hkv, T_l, D]``, as the compiled step passes them: the real levels last, after
    ``len(prefix_keys) - len(plan.levels)`` padding levels (see :func:`padded_level_count`). ``buffers``: a
    :class:`~hf_cascade.step_buffers.StepBuffers`; the tensors are copies in tensors taken from it, in the
    order returned (so that a later layout of the same sizes has them at the same addresses).

    What may change between two layouts is a size of dimension 0 of these tensors (nodes + 2, tiles), marked
    dynamic; each is >= 2 (a no-op tile is appended to a 1-tile list), so that no layout gets a size dynamo
    specialises (0 or 1). Every tensor is its own object (dynamo guards on which inputs alias; a padding slot holds
    a real level in another batch)."""
    B = query.shape[0]
    pad = len(prefix_keys) - len(plan.levels)
    if pad < 0:
        raise ValueError(f"step_inputs: {len(prefix_keys)} prefix keys for a plan of {len(plan.levels)} levels.")
    device = plan.row_node[0].device if plan.row_node else torch.device("cpu")
    empty = tuple(plan_shared_prefix(torch.full((B,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                     device=device) for _ in range(pad))  # levels no row has keys at
    levels = empty + plan.levels
    row_nodes = tuple(torch.full((B,), -1, dtype=torch.int64, device=query.device) for _ in range(pad))
    _fuse, configs = launch_configs(query, key, [(k, None, p) for k, p in zip(prefix_keys, levels)], shape_only=True)
    tensors = ()
    for level_plan, row_node, (sched, *_rest) in zip(levels, row_nodes + plan.row_node, configs):
        tile_node, tile_m0 = sched.tile_node, sched.tile_m0
        if tile_node.numel() < 2:
            tile_node = torch.cat([tile_node, tile_node.new_full((1,), level_plan.num_nodes)])
            tile_m0 = torch.cat([tile_m0, tile_m0.new_full((1,), _NO_OP_TILE_M0)])
        level = LevelTensors(sched.rows, sched.row_start, sched.node_starts, tile_node, tile_m0, row_node)
        if buffers is not None:
            level = LevelTensors(*(buffers.take(t.shape, t.dtype, t.device).copy_(t) for t in level))
        for t in (level.row_start, level.node_starts, level.tile_node, level.tile_m0):  # differ between trees
            torch._dynamo.maybe_mark_dynamic(t, 0)
        tensors += (level,)
    return tensors


def planned_attention(query, key, value, prefix_keys, prefix_values, plan_tensors, mask, scale, softcap, layer=None,
                      key_length=None, key_lower=None, suffix_lower=None, backend: str = "auto"):
    """The body of both custom ops (``hf_cascade::cascade_attention``, and with per-query lower bounds
    ``hf_cascade::bounded_cascade_attention``): launch choices from shapes only, the layout from ``plan_tensors``
    (flat, a :class:`LevelTensors` per level: no host data, so a CUDA graph or a compiled step replays it for any
    layout of the same sizes); the fp32 PyTorch reference where Triton does not run, or no level has keys.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: the suffix KV ``[B, Hkv, S, D / Dv]`` (fixed buffers).
        prefix_keys, prefix_values: per level ``[Hkv, T, D]``, or (``layer`` given) every layer's ``[layers, Hkv, T,
            D]`` of which layer ``layer``'s are read (a compiled step then traces no per-layer views of them); padding
            levels (no node) first.
        mask: bool ``[B or 1, Lq, S]`` over the suffix, or None (causal); key_length: int64 device scalar, the
            written suffix columns (or None: all S), as in ``cascade_attention``.
        key_lower: None, or int64 ``[B, Lq]`` per *real* level (the last ``len(key_lower)`` levels); suffix_lower:
            ``[B, Lq]`` with it (see :mod:`~hf_cascade.ops.bounded`).
    Returns:
        ``(out [B, Lq, Hq, Dv] contiguous in query.dtype, lse [B, Hq, Lq] fp32)``.
    """
    if layer is not None:
        prefix_keys = [k[layer] for k in prefix_keys]
        prefix_values = [v[layer] for v in prefix_values]
    levels = LevelTensors.unflatten(plan_tensors)
    if len(levels) != len(prefix_keys) or len(prefix_values) != len(prefix_keys):
        raise ValueError(
            f"cascade_attention: {len(prefix_keys)} prefix key levels, {len(prefix_values)} value levels and plan "
            f"tensors of {len(levels)} levels ({len(plan_tensors)} tensors, {len(LevelTensors._fields)} a level)."
        )
    # A level of no node (node_starts [N + 2] with N = 0: the padding of a shallower tree) has no keys for any
    # row: nothing to launch. A shape, so a CUDA graph recorded for this layout's shapes holds no launch for it.
    kept = [i for i, level in enumerate(levels) if level.node_starts.shape[0] > 2]
    if key_lower is not None:  # the real levels are the last len(key_lower)
        pad = len(levels) - len(key_lower)
        if kept != list(range(pad, len(levels))):
            raise ValueError(f"bounded_cascade_attention: {len(key_lower)} level bounds for {len(levels)} levels, "
                             f"{len(kept)} with nodes.")
        key_lower = [key_lower[i - pad] for i in kept]
    levels = [levels[i] for i in kept]
    prefix_keys, prefix_values = [prefix_keys[i] for i in kept], [prefix_values[i] for i in kept]
    torch_path = not levels or resolve_backend(backend, query.device, "cascade_attention") == "torch"
    if key_lower is not None:
        count_path("step:op/torch" if torch_path else "step:op/triton")
    if torch_path:
        out, lse = cascade_attention_ref(
            query, key, value, [(k, v, (level.node_starts, level.row_node))
                                for k, v, level in zip(prefix_keys, prefix_values, levels)],
            scale=scale, mask=mask, causal=True, softcap=softcap, key_length=key_length, key_lower=key_lower,
            suffix_lower=suffix_lower)
        out = out.to(query.dtype)
    else:
        schedules = [level.schedule() for level in levels]
        fuse, configs = launch_configs(query, key, list(zip(prefix_keys, [None] * len(levels), schedules)),
                                       shape_only=True)
        out, lse = launch_cascade(query, key, value, list(zip(prefix_keys, prefix_values)), configs, fuse,
                                  scale=scale, mask=mask, causal=True, softcap=softcap, key_length=key_length,
                                  key_lower=key_lower, suffix_lower=suffix_lower)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


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
    """:func:`planned_attention` (``layer``, ``key_length``: as there)."""
    return planned_attention(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer,
                             key_length)


@_cascade_attention_op.register_fake
def _(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer=None, key_length=None):
    return _fake_outputs(query, value)


@torch.library.custom_op(
    "hf_cascade::bounded_cascade_attention",
    mutates_args=(),
    schema=(
        "(Tensor query, Tensor key, Tensor value, Tensor[] prefix_keys, Tensor[] prefix_values, Tensor[] plan, "
        "Tensor? mask, float scale, float? softcap, int? layer, Tensor? key_length, Tensor[] key_lower, "
        "Tensor suffix_lower) -> (Tensor, Tensor)"
    ),
)
def _bounded_cascade_attention_op(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer,
                                  key_length, key_lower, suffix_lower):
    """:func:`planned_attention` with each query's first visible column per level and over the suffix."""
    return planned_attention(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer,
                             key_length, key_lower, suffix_lower)


@_bounded_cascade_attention_op.register_fake
def _(query, key, value, prefix_keys, prefix_values, plan, mask, scale, softcap, layer, key_length, key_lower,
      suffix_lower):
    return _fake_outputs(query, value)


def _fake_outputs(query, value):
    B, Hq, Lq, _ = query.shape
    return query.new_empty((B, Lq, Hq, value.shape[-1])), query.new_empty((B, Hq, Lq), dtype=torch.float32)
