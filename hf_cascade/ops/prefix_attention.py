"""Shared-prefix pass of cascade attention: all queries of a batch against prefix KV stored once."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._backend import (
    check_float_dtype,
    dot_precision,
    host_to_device,
    num_programs_target,
    padded_head_dim,
    resolve_backend,
)
from .reference import _NEG_INF, _scores, _softmax_attend, shared_prefix_attention_ref

__all__ = ["PrefixPlan", "plan_shared_prefix", "shared_prefix_attention"]

_OP = "shared_prefix_attention"
_MIN_KEYS_PER_SPLIT = 128  # below this a KV split costs more (partials + combine) than it saves
# torch path: a level of at least this many nodes runs as one gather of each row's node keys (a few ops per layer)
# instead of a loop over nodes (8 ops per node): hf_cascade.score's question nodes, 200 of ~9 tokens, took 40 of 100 s
# on 2 CPU cores in the loop (SmolLM2, 800 rows). Only where the rows' padded keys are at most twice the real ones.
_GATHER_MIN_NODES = 8
# cascade_attention's torch path (ops/_cascade_torch.py): a level runs as one matmul of every row's queries against
# all its keys (other nodes' columns masked) where that is at most this many times the keys the rows read, or small.
_DENSE_WASTE = 2
_DENSE_SMALL = 4096  # rows x level keys: one matmul whatever the waste


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
        """How cascade_attention's torch path reads this level (see ``ops/_cascade_torch.py``): ``"empty"`` (no row
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
        """bool ``[1, B, 1, T]`` on ``device``: True at the level's key columns a row does not read (other nodes', or
        all for a row without a node); None when every row reads every column (one node, every row on it)."""
        start = torch.tensor([self.node_starts[n] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        end = torch.tensor([self.node_starts[n + 1] if n >= 0 else 0 for n in self.row_node], dtype=torch.int64)
        if bool((start == 0).all()) and bool((end == self.total_keys).all()):
            return None
        columns = torch.arange(self.total_keys, dtype=torch.int64)
        hide = (columns[None, :] < start[:, None]) | (columns[None, :] >= end[:, None])
        return hide.view(1, self.batch_size, 1, self.total_keys).to(self.device)

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
            f"{_OP}: row_node must be an int64 tensor [B]; got {row_node.dtype} with shape "
            f"{tuple(row_node.shape)}. Build it with torch.tensor(nodes, dtype=torch.long)."
        )
    if node_starts.dim() != 1 or node_starts.numel() < 1 or node_starts.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{_OP}: node_starts must be an int64 tensor [N+1] with N >= 0; got {node_starts.dtype} "
            f"with shape {tuple(node_starts.shape)}."
        )
    starts = tuple(int(x) for x in node_starts.tolist())
    nodes = tuple(int(x) for x in row_node.tolist())
    num_nodes = len(starts) - 1
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"{_OP}: node_starts must start at 0 and be nondecreasing; got {list(starts)[:16]}"
            f"{'...' if len(starts) > 16 else ''}. Node n owns keys [node_starts[n], node_starts[n+1])."
        )
    bad = [x for x in nodes if x < -1 or x >= num_nodes]
    if bad:
        raise ValueError(
            f"{_OP}: row_node values must be in [-1, {num_nodes - 1}] (N = {num_nodes} nodes); "
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
    if resolve_backend(backend, query.device, _OP) == "torch":
        if (plan.num_nodes >= _GATHER_MIN_NODES and plan.total_keys > 0
                and plan.batch_size * plan.max_node_len <= 2 * plan.key_row_pairs):
            return _prefix_torch_gathered(query, key, value, plan, scale=scale, softcap=softcap)
        return shared_prefix_attention_ref(
            query, key, value, row_node, plan.node_starts, scale=scale, softcap=softcap,
            rows_by_node=plan.rows_by_node,
        )
    return _prefix_triton(query, key, value, plan, scale=scale, softcap=softcap)


def _prefix_torch_gathered(query: Tensor, key: Tensor, value: Tensor, plan: PrefixPlan, *, scale: float,
                           softcap: float | None) -> tuple[Tensor, Tensor]:
    """:func:`shared_prefix_attention_ref`'s result for a level of many short nodes, every row at once: each row's
    node keys gathered (``[B, Hkv, max_node_len, D]``, padding masked), one batched attention (fp32 math)."""
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    index, valid = plan.gather_index
    q = query.float().reshape(B, Hkv, Hq // Hkv * Lq, D)  # GQA folded into M, as the reference does
    k = key[:, index].float().transpose(0, 1)  # [B, Hkv, max_node_len, D]
    v = value[:, index].float().transpose(0, 1)
    scores = _scores(q, k, scale, softcap).masked_fill(~valid[:, None, None, :], _NEG_INF)
    out, lse = _softmax_attend(scores, v)
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


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


def _prefix_config(D: int, m_node: int, device: torch.device, *, fused: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``m_node`` query rows on the largest node.

    BLOCK_M covers the node's rows x group x positions up to 128 (tensor-core M; 64 and 128 use
    Hopper's wgmma with 4 / 8 warps). ``fused`` (prefix programs sharing a launch with the suffix
    programs): at most 64 rows and 4 warps, so that two programs fit on one SM. Measured on an H100
    (benchmarks/NOTES.md): BLOCK_N 64 with 3 stages is best or within 3% at every decode shape.
    """
    block_d = padded_head_dim(D)
    if device.type != "cuda":
        return 32, 64, 4, 1  # interpreter: small tiles keep numpy work per step low
    block_m = min(64 if fused else 128, max(16, 1 << max(m_node - 1, 0).bit_length()))
    if block_d >= 256:
        return min(block_m, 64), 32, 4 if block_m <= 16 or fused else 8, 2
    if block_m >= 128:
        return 128, 64, 8, 3
    return block_m, 64, 4, 3


def _num_splits(plan: PrefixPlan, tiles: int, hkv: int, block_n: int, device: torch.device) -> int:
    """KV splits: about one program per SM (measured best: 128 programs on the H100's 132 SMs, from
    B=1 to B=256), each split at least ``_MIN_KEYS_PER_SPLIT`` keys."""
    return _num_splits_for(plan.max_node_len, tiles, hkv, block_n, device)


def _num_splits_for(keys: int, tiles: int, hkv: int, block_n: int, device: torch.device) -> int:
    """:func:`_num_splits` for a node of ``keys`` keys (trailing splits of shorter nodes are empty)."""
    by_len = max(1, -(-keys // max(_MIN_KEYS_PER_SPLIT, block_n)))
    want = max(1, num_programs_target(device) // max(1, tiles * hkv))
    return max(1, min(by_len, want))


def _prefix_launch_config(query: Tensor, key: Tensor, plan: PrefixPlan, num_splits: int | None,
                          block_m: int | None, block_n: int | None, fused: bool = False):
    """(schedule, splits, BLOCK_M, BLOCK_N, num_warps, num_stages); cached per call shape."""
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    G = Hq // Hkv
    cfg_key = (G, Lq, D, Hkv, num_splits, block_m, block_n, fused)
    cached = plan._tiles.get(cfg_key)
    if cached is None:
        m_node = max(plan.rows_per_node, default=0) * G * Lq
        cfg_m, cfg_n, num_warps, num_stages = _prefix_config(D, m_node, query.device, fused=fused)
        bm, bn = block_m or cfg_m, block_n or cfg_n
        sched = plan.schedule(G * Lq, bm)
        splits = num_splits or _num_splits(plan, sched.num_tiles, Hkv, bn, query.device)
        cached = plan._tiles[cfg_key] = (sched, splits, bm, bn, num_warps, num_stages)
    return cached


def launch_prefix(query: Tensor, key: Tensor, value: Tensor, plan: PrefixPlan, config, o: Tensor,
                  lse: Tensor, o_strides, lse_strides, slot0: int, *, scale: float,
                  softcap: float | None, lower: Tensor | None = None) -> None:
    """One prefix-kernel launch writing every (row, head, position) state into o / lse.

    ``o_strides`` = (slot, b, kvh, group, q) element strides of ``o`` (head_dim stride 1),
    ``lse_strides`` the same for ``lse``; split s goes to slot ``slot0 + s``. ``lower``: None, or int64 ``[B, Lq]``,
    each query's first visible column of ``key`` (sliding windows, chunks).
    """
    from . import _prefix_kernel as kernels  # lazy: triton is optional

    sched, splits, block_m, block_n, num_warps, num_stages = config
    Hkv = key.shape[0]
    B, Hq, Lq, D = query.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    Dv = value.shape[-1]
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    kernels._prefix_fwd_kernel[(sched.num_tiles, Hkv, splits)](
        query, key, value, o, lse,
        sched.rows, sched.row_start, sched.node_starts, sched.tile_node, sched.tile_m0,
        sched.rows if lower is None else lower,
        Lq, Hq // Hkv, D, Dv, splits, slot0,
        float(scale), float(softcap) if softcap is not None else 1.0,
        *query.stride(), *key.stride()[:2], *value.stride()[:2],
        *((0, 0) if lower is None else lower.stride()),
        *o_strides, *lse_strides,
        HAS_SOFTCAP=softcap is not None,
        HAS_LOWER=lower is not None,
        EVEN_D=block_d == D, EVEN_DV=block_dv == Dv,
        INPUT_PRECISION=dot_precision(query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=num_warps, num_stages=num_stages,
    )


def partial_strides(part_out: Tensor, part_lse: Tensor, Lq: int, G: int, D: int):
    """(slot, b, kvh, group, q) strides of split partials [slots, Hkv, B*Lq*G, D] / [..., B*Lq*G]."""
    return ((part_out.stride(0), Lq * G * D, part_out.stride(1), D, G * D),
            (part_lse.stride(0), Lq * G, part_lse.stride(1), 1, G))


def _prefix_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: PrefixPlan,
    *,
    scale: float,
    softcap: float | None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton launch. ``num_splits`` / ``block_m`` / ``block_n`` override the heuristics (tests)."""
    B, Hq, Lq, _ = query.shape
    Hkv, D = key.shape[0], value.shape[-1]  # D: the values' head_dim (the output's)
    G = Hq // Hkv
    dev = query.device
    out = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=dev)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    config = _prefix_launch_config(query, key, plan, num_splits, block_m, block_n)
    splits = config[1]
    if splits == 1:  # states go straight to out / lse
        launch_prefix(query, key, value, plan, config, out, lse,
                      (0, out.stride(0), G * out.stride(1), out.stride(1), out.stride(2)),
                      (0, lse.stride(0), G * lse.stride(1), lse.stride(1), lse.stride(2)),
                      0, scale=scale, softcap=softcap)
        return out, lse
    m_total = B * Lq * G
    part_out = torch.empty((splits, Hkv, m_total, D), dtype=torch.float32, device=dev)
    part_lse = torch.empty((splits, Hkv, m_total), dtype=torch.float32, device=dev)
    launch_prefix(query, key, value, plan, config, part_out, part_lse,
                  *partial_strides(part_out, part_lse, Lq, G, D), 0, scale=scale, softcap=softcap)
    launch_combine(out, lse, part_out, part_lse, G)
    return out, lse


def launch_combine(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, G: int, *,
                   block_m: int | None = None, slots_per_step: int | None = None,
                   num_warps: int | None = None) -> None:
    """Merge every slot of the fp32 states [slots, Hkv, B*Lq*G, D] into out [B, Hq, Lq, D] / lse.
    ``block_m`` (rows per program), ``slots_per_step`` (state loads in flight together), ``num_warps``: override
    the launch choice (tuning)."""
    from . import _prefix_kernel as kernels  # lazy: triton is optional

    B, Hq, Lq, D = out.shape
    slots, Hkv, m_total = part_lse.shape
    block_d = padded_head_dim(D)
    if block_m:
        block_c = block_m
    elif out.device.type != "cuda":
        block_c = 16
    else:  # the largest row block that still gives a program per SM: a few state loads per program, all in flight
        # (H100, B=32 decode, 9 slots: 8 rows 3.5 us, 16 rows 4.1 us; probe_decode_attention.py --sweep)
        sms = num_programs_target(out.device)
        block_c = next((bc for bc in (32, 16) if -(-m_total // bc) * Hkv >= sms), 8)
    kernels._state_combine_kernel[(-(-m_total // block_c), Hkv)](
        out, lse, part_out, part_lse,
        m_total, Lq, G, D, slots,
        *out.stride()[:3], *lse.stride(),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        EVEN_D=block_d == D, BLOCK_M=block_c, BLOCK_D=block_d, SLOTS_PER_STEP=slots_per_step or 2,
        num_warps=num_warps or 4,
    )
