"""Exact combine of per-rank partial attention states (decode with the KV sharded over ranks).

Every rank attends the same queries to its own slice of the keys and holds a partial state
``(out_r, lse_r)``: ``out_r = softmax(S_r) V_r`` and ``lse_r = logsumexp(S_r)`` (natural log, fp32; ``-inf``
for a rank whose slice is empty or fully masked). The exact answer over all keys is

    m = max_r lse_r,   w_r = exp(lse_r - m),   out = sum_r w_r out_r / sum_r w_r,   lse = m + log(sum_r w_r).

Every combine ends in the same local N-way merge (:func:`combine_local`, or its two halves around the tree's
all-reduce), so all of them are exact and every rank ends with the same full result. Across ranks:

* ``"all_gather"`` (default): each rank packs its state into ONE contiguous fp32 buffer ``[out_r | lse_r]``
  (``B*H*Lq*D + B*H*Lq`` floats), ONE all-gather (``all_gather_single``, formerly ``all_gather_into_tensor``;
  works on NCCL and gloo) collects all ranks' buffers, and every rank merges the ``N`` states locally. One
  collective per layer; each rank sends ``4 * (D + 1)`` bytes per (row, head, query) and receives ``N - 1``
  times that: independent of the sequence length.
* ``"tree"`` (Tree Attention, Shyam et al.): one all-reduce(MAX) of the LSE, then ONE all-reduce(SUM) of a
  packed fp32 buffer ``[w_r * out_r | w_r]`` (``[..., D + 1]``). Two collectives, log(p)-deep in NCCL's tree
  algorithm, the same message size as ``"all_gather"`` sends; fewer bytes received at large ``N``.
* ``"all_to_all"`` (vLLM DCP a2a / Helix): heads are split into ``N`` groups; one all-to-all sends head group
  ``j`` of ``[out_r | lse_r]`` to rank ``j``, which combines its heads from all ranks locally; one all-gather
  puts the heads back together (vLLM stops before the gather because tensor parallelism follows; we have no TP).

``"all_gather_kv"`` is not a combine but the naive baseline the benchmark compares against: gather every
rank's KV slice (message size grows with the context) and attend locally (see :func:`all_gather_kv`).

Inside ``torch.compile`` (the fixed-buffer decode step, see ``context_parallel_inputs(..., max_new_tokens=N)``)
the three state combines use functional collectives (``torch.distributed._functional_collectives``: traceable,
no graph break); eagerly they use the ``torch.distributed`` calls above. Same messages, same merge.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from hf_cascade.ops.merge_states import merge_states
from hf_cascade.ops.reference import _empty_guard, merge_states_ref, normalize_states, scale_states
from hf_cascade.parallel._group import GroupInfo

STATE_COMBINES = ("all_gather", "tree", "all_to_all")  # exact combines of per-rank partial states
COMBINES = (*STATE_COMBINES, "all_gather_kv")  # + the benchmark baseline
_NEG_INF = float("-inf")


def _traced_group(info: GroupInfo):
    """The group as functional collectives take it (they need a ProcessGroup, not None)."""
    return dist.group.WORLD if info.group is None else info.group


def _all_gathered(tensor: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """All-gather of ``tensor`` (any shape): ``[world_size * tensor.numel()]`` flat, rank order. Inside
    ``torch.compile`` a functional collective (traceable); eagerly ``torch.distributed``."""
    flat = tensor.contiguous().view(-1)
    if torch.compiler.is_compiling():
        return fc.wait_tensor(fc.all_gather_tensor(flat, 0, _traced_group(info)))
    output = flat.new_empty(info.world_size * flat.numel())
    _all_gather_flat(output, flat, info)
    return output


def _all_reduced(tensor: torch.Tensor, op: str, info: GroupInfo) -> torch.Tensor:
    """All-reduce (``op``: ``"max"`` or ``"sum"``): eagerly in place on ``tensor`` (returned); inside
    ``torch.compile`` a functional collective returning a new tensor."""
    if torch.compiler.is_compiling():
        return fc.wait_tensor(fc.all_reduce(tensor.contiguous(), op, _traced_group(info)))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=info.group)
    return tensor


def check_combine(combine: str) -> str:
    """Validate the ``combine`` option; returns it."""
    if combine not in COMBINES:
        raise ValueError(
            f"`combine` must be one of {COMBINES} ('all_gather', the default, is one all-gather per layer; "
            f"'all_gather_kv' is a benchmark baseline); got {combine!r}."
        )
    return combine


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
    """Exact N-way merge of partial states stacked along ``dim`` (no communication): the package's one merge,
    :func:`hf_cascade.ops.reference.merge_states_ref` (shapes, dtypes and empty-state rules there)."""
    return merge_states_ref(outs, lses, dim)


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
    lse = _empty_guard(lse)
    if info.world_size == 1:
        return out, lse
    m = _all_reduced(lse.clone(), "max", info)
    weighted, w = scale_states(out, lse, m)
    D = out.shape[-1]
    packed = torch.empty((*out.shape[:-1], D + 1), dtype=torch.float32, device=out.device)
    packed[..., :D] = weighted
    packed[..., D] = w
    packed = _all_reduced(packed, "sum", info)
    result, lse = normalize_states(packed[..., :D], packed[..., D], m)
    return result.to(out.dtype), lse


def _all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, info: GroupInfo) -> None:
    """All-gather ``tensor`` into the flat ``output`` (``world_size * tensor.numel()`` elements, rank order)."""
    fn = getattr(dist, "all_gather_single", None)  # torch >= 2.13 name
    if fn is None:
        fn = dist.all_gather_into_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # gloo wants 1-D input and output (it rejects the stacked [N, ...] output form); NCCL takes either. On gloo
        # (torch 2.13, 2 ranks, 16 KB) this is ~20% faster than the list form dist.all_gather.
        fn(output.view(-1), tensor.contiguous().view(-1), group=info.group)


def combine_all_gather(out: torch.Tensor, lse: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather combine: ONE all-gather of every rank's packed state, then the exact N-way merge locally.

    Args:
        out: ``[B, H, Lq, D]`` (or any ``[..., D]``) this rank's partial output, any float dtype, same shape on
            every rank.
        lse: ``out.shape[:-1]`` float32 natural-log LSE (-inf = no keys on this rank).
        info: the process group.
    Returns:
        ``(out [..., D] in out.dtype, lse [...] float32)`` over the keys of all ranks; bitwise identical on every
        rank (the same gathered bytes merged by the same code).

    Example:
        >>> o, lse = suffix_attention(q, k_shard, v_shard, scale=s, mask=m)   # this rank's keys only
        >>> o, lse = combine_all_gather(o, lse, resolve_group())           # all keys, on every rank
    """
    _check_state(out, lse, "combine_all_gather")
    n = info.world_size
    if n == 1:
        return out, _empty_guard(lse)
    numel_out, numel_lse = out.numel(), lse.numel()
    # One contiguous fp32 buffer per rank: [out (B*H*Lq*D) | lse (B*H*Lq)]; the gather stacks them in rank order.
    send = torch.empty(numel_out + numel_lse, dtype=torch.float32, device=out.device)
    send[:numel_out].view(out.shape).copy_(out)
    send[numel_out:].view(lse.shape).copy_(lse)
    recv = _all_gathered(send, info).view(n, numel_out + numel_lse)
    outs = recv[:, :numel_out].view(n, *out.shape)
    lses = recv[:, numel_out:].view(n, *lse.shape)
    if torch.compiler.is_compiling():  # traced: the reference's ops, which the compiler fuses
        result, lse = combine_local(outs, lses, dim=0)
        return result.to(out.dtype), lse
    return merge_states(outs, lses, out_dtype=out.dtype)  # one launch on CUDA (Triton), the reference elsewhere


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
    lse = _empty_guard(lse)
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
    if torch.compiler.is_compiling():
        recv = fc.wait_tensor(fc.all_to_all_single(send, None, None, _traced_group(info)))
    else:
        recv = torch.empty_like(send)  # [n (source rank), h, B, Lq, D + 1] once viewed
        dist.all_to_all_single(recv, send, group=info.group)
    recv = recv.view(n, h, B, Lq, D + 1)
    mine_out, mine_lse = combine_local(recv[..., :D], recv[..., D], dim=0)  # [h, B, Lq, D], [h, B, Lq]
    local = torch.cat([mine_out, mine_lse.unsqueeze(-1)], dim=-1)
    gathered = _all_gathered(local, info).view(n * h, B, Lq, D + 1)
    gathered = gathered[:H].transpose(0, 1)  # [B, H, Lq, D + 1]
    return gathered[..., :D].to(out.dtype), gathered[..., D].contiguous()


_STATE_COMBINE_FNS = {"all_gather": combine_all_gather, "tree": combine_tree, "all_to_all": combine_all_to_all}


def combine_states(
    out: torch.Tensor, lse: torch.Tensor, info: GroupInfo, combine: str = "all_gather"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to :func:`combine_all_gather`, :func:`combine_tree` or :func:`combine_all_to_all`.

    ``out [B, H, Lq, D]`` any float dtype, ``lse [B, H, Lq]`` float32; returns them combined over all ranks.
    """
    fn = _STATE_COMBINE_FNS.get(combine)
    if fn is None:
        raise ValueError(f"combine_states: `combine` must be one of {STATE_COMBINES}; got {combine!r}.")
    return fn(out, lse, info)


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
    gathered = _all_gathered(packed, info).view(n, 2, B, Hkv, s_max, D)
    cols = columns.new_full((s_max,), -1)
    cols[:S] = columns
    all_cols = _all_gathered(cols, info).view(n, s_max)
    keep = torch.cat([torch.arange(r * s_max, r * s_max + lengths[r], device=key.device) for r in range(n)])
    kv = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, B, Hkv, n * s_max, D).index_select(3, keep)
    return kv[0], kv[1], all_cols.view(-1).index_select(0, keep)
