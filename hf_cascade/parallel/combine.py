"""Exact combine of per-rank partial attention states (decode with the KV sharded over ranks).

Every rank attends the same queries to its own slice of the keys and holds a partial state
``(out_r, lse_r)``: ``out_r = softmax(S_r) V_r`` and ``lse_r = logsumexp(S_r)`` (natural log, fp32; ``-inf``
for a rank whose slice is empty or fully masked). The exact answer over all keys is

    m = max_r lse_r,   w_r = exp(lse_r - m),   out = sum_r w_r out_r / sum_r w_r,   lse = m + log(sum_r w_r).

Two ways to compute it across ranks (both exact; every rank ends with the same full result):

* ``"tree"`` (Tree Attention, Shyam et al.): one all-reduce(MAX) of the LSE, then ONE all-reduce(SUM) of a
  packed fp32 buffer ``[w_r * out_r | w_r]`` (``[..., D + 1]``). Two collectives, log(p)-deep in NCCL's tree
  algorithm, message size ``4 * (D + 1)`` bytes per (row, head, query): independent of the sequence length.
* ``"all_to_all"`` (vLLM DCP a2a / Helix): heads are split into ``N`` groups; one all-to-all sends head group
  ``j`` of ``[out_r | lse_r]`` to rank ``j``, which combines its heads from all ranks locally; one all-gather
  puts the heads back together (vLLM stops before the gather because tensor parallelism follows; we have no TP).

``"all_gather_kv"`` is not a combine but the naive baseline the benchmark compares against: gather every
rank's KV slice and attend locally (see :func:`all_gather_kv`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from hf_cascade.parallel._group import GroupInfo

COMBINES = ("tree", "all_to_all", "all_gather_kv")
_NEG_INF = float("-inf")


def check_combine(combine: str) -> str:
    """Validate the ``combine`` option; returns it."""
    if combine not in COMBINES:
        raise ValueError(f"`combine` must be one of {COMBINES}; got {combine!r}.")
    return combine


def _sanitize(lse: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``lse`` with NaN / +inf (FlashAttention-2's empty rows) mapped to -inf ("no keys")."""
    lse = lse.float()
    return torch.where(torch.isnan(lse) | (lse == float("inf")), _NEG_INF, lse)


def _check_state(out: torch.Tensor, lse: torch.Tensor, caller: str) -> None:
    if out.dim() < 1 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(
            f"{caller}: lse must have shape out.shape[:-1]; got out {tuple(out.shape)} and lse {tuple(lse.shape)}."
        )
    if lse.dtype != torch.float32:
        raise ValueError(f"{caller}: lse must be float32 (natural-log LSE); got {lse.dtype}. Do not down-cast it.")
    if out.device != lse.device:
        raise ValueError(f"{caller}: out is on {out.device} but lse on {lse.device}.")


def combine_local(outs: torch.Tensor, lses: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial states stacked along ``dim`` (no communication).

    Args:
        outs: ``[..., N, ..., D]`` partial outputs (any float dtype), stacked along ``dim``.
        lses: ``outs.shape[:-1]`` natural-log LSEs (-inf = empty).
    Returns:
        ``(out [..., D] float32, lse [...] float32)`` with ``dim`` reduced. All empty: out 0, lse -inf.
    """
    dim = dim % lses.dim()
    lses = _sanitize(lses)
    m = lses.amax(dim=dim, keepdim=True)
    m = torch.where(m == _NEG_INF, 0.0, m)
    w = torch.exp(lses - m)  # 0 for empty partials
    total = w.sum(dim=dim)
    # where(), not multiply: an empty partial may hold NaN garbage; 0 * NaN must stay 0.
    weighted = torch.where(w.unsqueeze(-1) > 0, outs.float() * w.unsqueeze(-1), 0.0).sum(dim=dim)
    out = weighted / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = m.squeeze(dim) + torch.log(total)  # log(0) = -inf when every partial is empty
    return out, lse


def combine_tree(out: torch.Tensor, lse: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree combine: all-reduce(MAX) of the LSE, then one all-reduce(SUM) of ``[w * out | w]``.

    Args:
        out: ``[..., D]`` this rank's partial output (any float dtype; same shape on every rank).
        lse: ``out.shape[:-1]`` float32 natural-log LSE of this rank's partial (-inf = no keys here).
        info: the process group (:func:`hf_cascade.parallel._group.resolve_group`).
    Returns:
        ``(out [..., D] in out.dtype, lse [...] float32)`` over the keys of all ranks; identical on every rank.
    """
    _check_state(out, lse, "combine_tree")
    lse = _sanitize(lse)
    if info.world_size == 1:
        return out, lse
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=info.group)
    m = torch.where(m == _NEG_INF, 0.0, m)  # every rank empty: all weights 0
    w = torch.exp(lse - m).unsqueeze(-1)
    D = out.shape[-1]
    packed = torch.empty((*out.shape[:-1], D + 1), dtype=torch.float32, device=out.device)
    packed[..., :D] = torch.where(w > 0, out.float() * w, 0.0)
    packed[..., D:] = w
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=info.group)
    total = packed[..., D]
    result = packed[..., :D] / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return result.to(out.dtype), m + torch.log(total)


def _all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, info: GroupInfo) -> None:
    """All-gather ``tensor`` into the flat ``output`` (``world_size * tensor.numel()`` elements, rank order)."""
    fn = getattr(dist, "all_gather_single", None)  # torch >= 2.13 name
    if fn is None:
        fn = dist.all_gather_into_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # gloo accepts a flat output only, NCCL either.
        fn(output.view(-1), tensor.contiguous().view(-1), group=info.group)


def combine_all_to_all(out: torch.Tensor, lse: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """All-to-all combine (vLLM DCP / Helix): exchange head groups, combine locally, all-gather the heads.

    Args:
        out: ``[B, H, Lq, D]`` this rank's partial output (any float dtype), heads on dim 1.
        lse: ``[B, H, Lq]`` float32 natural-log LSE (-inf = no keys here).
        info: the process group.
    Returns:
        ``(out [B, H, Lq, D] in out.dtype, lse [B, H, Lq] float32)``; identical on every rank. ``H`` need not be
        a multiple of the world size (the head groups are padded).
    """
    _check_state(out, lse, "combine_all_to_all")
    if out.dim() != 4:
        raise ValueError(f"combine_all_to_all: out must be [B, H, Lq, D]; got shape {tuple(out.shape)}.")
    lse = _sanitize(lse)
    n = info.world_size
    if n == 1:
        return out, lse
    B, H, Lq, D = out.shape
    h = -(-H // n)  # heads per rank after padding to a multiple of n
    send = torch.empty((n * h, B, Lq, D + 1), dtype=torch.float32, device=out.device)
    send[:H, ..., :D] = out.float().transpose(0, 1)
    send[:H, ..., D] = lse.transpose(0, 1)
    if n * h > H:
        send[H:, ..., :D] = 0.0
        send[H:, ..., D] = _NEG_INF
    recv = torch.empty_like(send)  # [n (source rank), h, B, Lq, D + 1] once viewed
    dist.all_to_all_single(recv, send, group=info.group)
    recv = recv.view(n, h, B, Lq, D + 1)
    mine_out, mine_lse = combine_local(recv[..., :D], recv[..., D], dim=0)  # [h, B, Lq, D], [h, B, Lq]
    local = torch.cat([mine_out, mine_lse.unsqueeze(-1)], dim=-1)
    gathered = torch.empty((n * h, B, Lq, D + 1), dtype=torch.float32, device=out.device)
    _all_gather_flat(gathered, local, info)
    gathered = gathered[:H].transpose(0, 1)  # [B, H, Lq, D + 1]
    return gathered[..., :D].to(out.dtype), gathered[..., D].contiguous()


def combine_states(
    out: torch.Tensor, lse: torch.Tensor, info: GroupInfo, combine: str = "tree"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to :func:`combine_tree` or :func:`combine_all_to_all` (``out [B, H, Lq, D]``, ``lse [B, H, Lq]``)."""
    if combine == "tree":
        return combine_tree(out, lse, info)
    if combine == "all_to_all":
        return combine_all_to_all(out, lse, info)
    raise ValueError(f"combine_states: `combine` must be 'tree' or 'all_to_all'; got {combine!r}.")


def all_gather_kv(
    key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, lengths: list[int], info: GroupInfo
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Baseline: gather every rank's KV slice (the benchmark's "all-gather the KV" comparison point).

    Args:
        key, value: ``[B, Hkv, S_r, D]`` this rank's slice; ``columns``: int64 ``[S_r]`` their global columns.
        lengths: ``S_r`` of every rank (known everywhere; slices are padded to ``max(lengths)`` for the gather).
    Returns:
        ``(key [B, Hkv, sum S_r, D], value, columns [sum S_r])`` in rank order (not sorted by column).
    """
    n, s_max = info.world_size, max(lengths)
    B, Hkv, S, D = key.shape
    if S != lengths[info.rank] or columns.numel() != S:
        raise ValueError(
            f"all_gather_kv: this rank holds {S} keys and {columns.numel()} columns but lengths[{info.rank}] = "
            f"{lengths[info.rank]}."
        )
    if n == 1:
        return key, value, columns
    packed = key.new_zeros((2, B, Hkv, s_max, D))
    packed[0, :, :, :S] = key
    packed[1, :, :, :S] = value
    gathered = key.new_empty((n, 2, B, Hkv, s_max, D))
    _all_gather_flat(gathered, packed, info)
    cols = columns.new_full((s_max,), -1)
    cols[:S] = columns
    all_cols = columns.new_empty((n, s_max))
    _all_gather_flat(all_cols, cols, info)
    keep = torch.cat([torch.arange(r * s_max, r * s_max + lengths[r], device=key.device) for r in range(n)])
    kv = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, B, Hkv, n * s_max, D).index_select(3, keep)
    return kv[0], kv[1], all_cols.view(-1).index_select(0, keep)
