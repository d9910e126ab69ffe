"""Shared-prefix pass of cascade attention: all queries of a batch against prefix KV stored once."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._backend import (
    check_float_dtype,
    dot_precision,
    num_programs_target,
    padded_head_dim,
    resolve_backend,
)
from .reference import shared_prefix_attention_ref

__all__ = ["PrefixPlan", "plan_shared_prefix", "shared_prefix_attention"]

_OP = "shared_prefix_attention"
_MIN_KEYS_PER_SPLIT = 256  # below this a KV split costs more (partials + combine) than it saves


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
        node_row_start: int32 [N+1]; rows of node n are ``rows[node_row_start[n]:node_row_start[n+1]]``.
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
    node_row_start: Tensor
    node_starts_dev: Tensor
    rows_by_node: list[Tensor | None]
    rows_per_node: tuple[int, ...]
    _tiles: dict = field(default_factory=dict, repr=False)

    @property
    def has_rows_without_node(self) -> bool:
        return any(n < 0 for n in self.row_node)

    @functools.cached_property
    def covered_rows(self) -> int:
        """Rows on a non-empty node; the others keep out 0 / lse -inf."""
        return sum(r for n, r in enumerate(self.rows_per_node)
                   if self.node_starts[n + 1] > self.node_starts[n])

    @functools.cached_property
    def max_node_len(self) -> int:
        return max((b - a for a, b in zip(self.node_starts, self.node_starts[1:])), default=0)

    def tiles(self, m_per_row: int, block_m: int) -> tuple[Tensor, Tensor]:
        """(tile_node int32 [tiles], tile_m0 int32 [tiles]): BLOCK_M tiles over every node's M axis."""
        key = (m_per_row, block_m)
        if key not in self._tiles:
            tile_node, tile_m0 = [], []
            for n, r in enumerate(self.rows_per_node):
                if self.node_starts[n + 1] == self.node_starts[n]:
                    continue  # empty node: its rows keep out 0, lse -inf
                for m0 in range(0, r * m_per_row, block_m):
                    tile_node.append(n)
                    tile_m0.append(m0)
            self._tiles[key] = (
                torch.tensor(tile_node, dtype=torch.int32, device=self.device),
                torch.tensor(tile_m0, dtype=torch.int32, device=self.device),
            )
        return self._tiles[key]


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
        rows_by_node.append(torch.tensor(sel, dtype=torch.int64, device=device) if sel else None)
    return PrefixPlan(
        batch_size=len(nodes),
        num_nodes=num_nodes,
        total_keys=starts[-1],
        node_starts=starts,
        row_node=nodes,
        device=device,
        rows=torch.tensor(rows_host, dtype=torch.int32, device=device),
        node_row_start=torch.tensor(row_start, dtype=torch.int32, device=device),
        node_starts_dev=torch.tensor(starts, dtype=torch.int64, device=device),
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
        key, value: [Hkv, T, D], query's dtype and device: the packed KV of all N nodes of one
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
        (out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32 natural log). out is fp32 on purpose:
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
        return shared_prefix_attention_ref(
            query, key, value, row_node, plan.node_starts, scale=scale, softcap=softcap,
            rows_by_node=plan.rows_by_node,
        )
    return _prefix_triton(query, key, value, plan, scale=scale, softcap=softcap)


def _validate(query: Tensor, key: Tensor, value: Tensor, scale: float, softcap: float | None) -> None:
    if query.dim() != 4:
        raise ValueError(f"{_OP}: query must be [B, Hq, Lq, D]; got shape {tuple(query.shape)}.")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"{_OP}: key and value must both be [Hkv, T, D] (the packed prefix KV, no batch dim); got "
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


def _prefix_config(D: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Untuned first cut; the GPU pass replaces it with autotuning."""
    block_d = padded_head_dim(D)
    if device.type != "cuda":
        return 32, 64, 4  # interpreter: small tiles keep numpy work per step low
    if block_d >= 256:
        return 64, 32, 8  # 256-wide tiles: keep q + k + v + acc in shared memory / registers
    return 64, 64, 4


def _num_splits(plan: PrefixPlan, tiles: int, hkv: int, block_n: int, device: torch.device) -> int:
    """KV splits so that tiles * Hkv * splits roughly fills the device, each split >= 256 keys."""
    by_len = max(1, -(-plan.max_node_len // max(_MIN_KEYS_PER_SPLIT, block_n)))
    want = -(-num_programs_target(device) // max(1, tiles * hkv))
    return max(1, min(by_len, want))


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
    from . import _prefix_kernel as kernels  # lazy: triton is optional

    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    G = Hq // Hkv
    dev = query.device
    cfg_m, cfg_n, num_warps = _prefix_config(D, dev)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    block_d = padded_head_dim(D)
    tile_node, tile_m0 = plan.tiles(G * Lq, block_m)
    tiles = tile_node.numel()
    # Rows without a node, or on an empty node, are not covered by any tile.
    if plan.covered_rows == B:
        out = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=dev)
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    else:
        out = torch.zeros((B, Hq, Lq, D), dtype=torch.float32, device=dev)
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float32, device=dev)
    if tiles == 0 or out.numel() == 0:
        return out, lse
    splits = num_splits or _num_splits(plan, tiles, Hkv, block_n, dev)
    if splits > 1:
        part_out = torch.empty((splits, Hkv, tiles * block_m, D), dtype=torch.float32, device=dev)
        part_lse = torch.empty((splits, Hkv, tiles * block_m), dtype=torch.float32, device=dev)
    else:
        part_out, part_lse = out, lse  # unused placeholders
    common = (plan.rows, plan.node_row_start)
    kernels._prefix_fwd_kernel[(tiles, Hkv, splits)](
        query, key, value, out, lse, part_out, part_lse,
        *common, plan.node_starts_dev, tile_node, tile_m0,
        Lq, G, D, splits,
        float(scale), float(softcap) if softcap is not None else 1.0,
        *query.stride(), *key.stride(), *value.stride(),
        *out.stride()[:3], *lse.stride(),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        HAS_SOFTCAP=softcap is not None,
        SPLIT=splits > 1,
        INPUT_PRECISION=dot_precision(query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=2,
    )
    if splits > 1:
        kernels._prefix_combine_kernel[(tiles, Hkv)](
            out, lse, part_out, part_lse,
            *common, tile_node, tile_m0,
            Lq, G, D, splits,
            *out.stride()[:3], *lse.stride(),
            *part_out.stride()[:3], *part_lse.stride()[:2],
            BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
        )
    return out, lse
