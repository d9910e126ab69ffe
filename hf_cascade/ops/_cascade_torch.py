"""The PyTorch (CPU) path of ``cascade_attention``: every level and the suffix in one softmax, a few ops per part.

The composition of the public ops (per level :func:`shared_prefix_attention`, then one merge per level, then
:func:`suffix_attention` merging the prefix state) is ~200 small ops per layer on CPU: per node an index_select, a
few reshapes and a softmax, per merge two stacks and a dozen elementwise ops. At one query per row every one of
them is a few microseconds of dispatch, and on a busy CPU each one run in parallel waits for OpenMP's other
threads (issue 35: a decode step 20x sdpa's). Here, per layer, in fp32:

* a level every row reads at most a small multiple of (``_DENSE_WASTE``: a shared prompt, or a few nodes) is one
  matmul of all the rows' queries against all the level's keys, ``[Hkv, B * G * Lq, D] x [Hkv, D, T]`` (the keys
  stored once, never per row), the other nodes' columns hidden by one cached mask (none for a single node every row
  reads);
* a level of many short nodes gathers each row's node keys (``[B, Hkv, max_node_len, D]``);
* any other level (a few long nodes read by few rows) runs node by node (:func:`shared_prefix_attention_ref`) and
  joins as an attention state;
* the suffix: one batched matmul, the mask applied by one ``where``.

Their scores share one softmax: one max over the parts, then per part ``exp``, a sum and ``P @ V``; the sums and
products add up. Measured (SmolLM2-135M, the demo's 2-level tree, one layer's attention in a decode step): 86 ops
dispatched, views included, instead of 205. The result is the same attention (every key of the row's nodes and its
visible suffix keys), computed in another order (fp32 rounding differs from the composition's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import _NEG_INF, _empty_guard, shared_prefix_attention_ref

_F32_MIN = torch.finfo(torch.float32).min


def cascade_attention_torch(query: Tensor, key: Tensor, value: Tensor, prefixes, *, scale: float,
                            mask: Tensor | None, causal: bool, softcap: float | None) -> tuple[Tensor, Tensor]:
    """:func:`~hf_cascade.ops.cascade_attention`'s result on the PyTorch path (inputs validated, ``key_length``
    already folded into ``mask``). ``prefixes``: per level ``(prefix_key [Hkv, T, D], prefix_value, PrefixPlan)``.

    Returns ``(out [B, Hq, Lq, Dv] in query.dtype, laid out [B, Lq, Hq, Dv]; lse [B, Hq, Lq] float32)``."""
    B, Hq, Lq, D = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    G = Hq // Hkv
    M = G * Lq
    # Queries batch-major [B * Hkv, M, D] (the suffix's layout) and, for levels read through one matmul, head-major
    # [Hkv, B * M, D] (GQA folded into M, as the reference does).
    q = query.float().reshape(B * Hkv, M, D)
    q_heads = None
    parts = []  # per part: ("rows", e [B, Hkv, M, N] scores then weights, values [B * Hkv, N, Dv])
    #                       ("heads", scores [Hkv, B * M, T], values [Hkv, T, Dv])
    #                       ("state", out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M])
    for k_pre, v_pre, plan in prefixes:
        way = plan.torch_way
        if way == "empty" or B == 0:
            continue
        if way == "dense":
            if q_heads is None:
                q_heads = heads_major(q, B, Hkv)
            parts.append(dense_part(q_heads, k_pre, v_pre, plan.dense_hide, scale, softcap))
        elif way == "gather":
            index, valid = plan.gather_index  # [B, L] each row's node columns, left-aligned
            k = k_pre[:, index].float().transpose(0, 1).reshape(B * Hkv, -1, D)  # [B * Hkv, L, D]
            v = v_pre[:, index].float().transpose(0, 1).reshape(B * Hkv, -1, Dv)
            s = _scores3(q, k, scale, softcap).view(B, Hkv, M, -1)
            if not plan.gather_all_valid:
                s.masked_fill_(~valid[:, None, None, :], _NEG_INF)
            parts.append(("rows", s, v))
        else:  # a few long nodes read by few rows: node by node (no keys copied per row)
            o, lse = shared_prefix_attention_ref(query, k_pre, v_pre, None, plan.node_starts, scale=scale,
                                                 softcap=softcap, rows_by_node=plan.rows_by_node)
            parts.append(("state", o.view(B, Hkv, M, Dv), _empty_guard(lse).view(B, Hkv, M)))
    suffix_part(parts, q, query, key, value, mask, causal, scale, softcap)
    return joint_softmax(parts, query, Hkv, Dv)


def heads_major(q: Tensor, B: int, Hkv: int) -> Tensor:
    """Queries ``[B * Hkv, M, D]`` as ``[Hkv, B * M, D]``: every row's queries of a KV head against a level's keys."""
    M, D = q.shape[1], q.shape[2]
    return q.view(B, Hkv, M, D).transpose(0, 1).reshape(Hkv, B * M, D)


def dense_part(q_heads: Tensor, k_pre: Tensor, v_pre: Tensor, hide: Tensor | None, scale: float,
               softcap: float | None) -> tuple:
    """A level read by one matmul: every row's queries ``[Hkv, B * M, D]`` against all its keys ``[Hkv, T, D]``;
    ``hide``: None, or bool ``[1, B, 1, T]`` (True: a column the row does not read)."""
    s = _scores3(q_heads, k_pre.float(), scale, softcap)  # [Hkv, B * M, T]
    if hide is not None:
        s.view(s.shape[0], hide.shape[1], -1, s.shape[-1]).masked_fill_(hide, _NEG_INF)
    return ("heads", s, v_pre.float())


def suffix_part(parts: list, q: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                 causal: bool, scale: float, softcap: float | None) -> None:
    """Append the suffix's scores (its mask applied) to ``parts``; ``q``: the queries ``[B * Hkv, M, D]`` fp32."""
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if S == 0 or B == 0:
        return
    s = _scores3(q, key.float().reshape(B * Hkv, S, D), scale, softcap).view(B, Hkv, Hq // Hkv, Lq, S)
    visible = mask if mask is not None else (_causal(Lq, S, query.device) if causal and Lq > 1 else None)
    if visible is not None:
        if visible.dim() == 4:
            visible = visible.squeeze(1)
        s = torch.where(visible.view(-1, 1, 1, Lq, S), s, _NEG_INF)
    parts.append(("rows", s.view(B, Hkv, -1, S), value.float().reshape(B * Hkv, S, Dv)))


def joint_softmax(parts: list, query: Tensor, Hkv: int, Dv: int) -> tuple[Tensor, Tensor]:
    """One softmax over the scores of every part, each part's ``P @ V`` summed: ``(out [B, Hq, Lq, Dv] in
    query.dtype, laid out [B, Lq, Hq, Dv]; lse [B, Hq, Lq] float32)``. Parts (their scores are overwritten):
    ``("heads", scores [Hkv, B * M, T], values [Hkv, T, Dv])`` (a level read by one matmul),
    ``("rows", scores [B, Hkv, M, N], values [B * Hkv, N, Dv])`` (per-row keys), or
    ``("state", out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M])`` (an attention state, -inf where empty)."""
    B, Hq, Lq, _ = query.shape
    G = Hq // Hkv
    M = G * Lq
    # One softmax over every part: the max over all of them (a row with no key: -inf, taken as the float32 minimum,
    # so that exp() gives 0 and not NaN).
    m = None
    for kind, a, b in parts:
        if kind == "heads":
            part_max = a.amax(dim=-1).view(Hkv, B, M).transpose(0, 1)
        elif kind == "rows":
            part_max = a.amax(dim=-1)
        else:  # the state's lse
            part_max = b
        m = part_max if m is None else torch.maximum(m, part_max)
    if m is None:  # no key at all
        out = query.new_zeros((B, Lq, Hq, Dv)).transpose(1, 2)
        return out, query.new_full((B, Hq, Lq), _NEG_INF, dtype=torch.float32)
    m = m.clamp(min=_F32_MIN)  # [B, Hkv, M]
    total = num = None
    for kind, a, b in parts:
        if kind == "heads":
            a.view(Hkv, B, M, -1).sub_(m.transpose(0, 1).unsqueeze(-1)).exp_()
            part_sum = a.sum(dim=-1).view(Hkv, B, M).transpose(0, 1)
            part_num = torch.bmm(a, b).view(Hkv, B, M, Dv).transpose(0, 1)
        elif kind == "rows":
            a.sub_(m.unsqueeze(-1)).exp_()
            part_sum = a.sum(dim=-1)
            part_num = torch.bmm(a.view(B * Hkv, M, -1), b).view(B, Hkv, M, Dv)
        else:
            part_sum = torch.exp(b - m)  # 0 for an empty state
            part_num = a * part_sum.unsqueeze(-1)  # an empty state's out is 0 (the reference's)
        total = part_sum if total is None else total + part_sum
        num = part_num if num is None else num.add_(part_num) if num.is_contiguous() else num + part_num
    # total >= 1 where a row has a key (its largest score gives exp(0)); 0 where it has none (then num is 0 too).
    lse = (m + torch.log(total)).reshape(B, Hq, Lq)  # log(0) = -inf: no key
    out = torch.empty((B, Lq, Hkv, G, Dv), dtype=torch.float32, device=query.device)
    torch.div(num.reshape(B, Hkv, G, Lq, Dv), total.clamp(min=1.0).reshape(B, Hkv, G, Lq, 1),
              out=out.permute(0, 2, 3, 1, 4))
    out = out.view(B, Lq, Hq, Dv).transpose(1, 2)
    return (out if query.dtype == torch.float32 else out.to(query.dtype)), lse


def _scores3(q: Tensor, k: Tensor, scale: float, softcap: float | None) -> Tensor:
    """``scale * q @ k^T`` for 3-D ``q [b, m, d]`` and ``k [b, n, d]`` in one op, soft-capped when asked."""
    s = torch.baddbmm(_zero(q), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    return s


_ZEROS: dict = {}


def _zero(like: Tensor) -> Tensor:
    """A one-element tensor of ``like``'s dtype and device (baddbmm's ``input``, ignored with beta=0); kept for the
    CPU only (a GPU tensor made while a CUDA graph records would live in the graph's memory)."""
    if like.device.type != "cpu":
        return like.new_zeros((1, 1, 1))
    zero = _ZEROS.get(like.dtype)
    if zero is None:
        zero = _ZEROS[like.dtype] = torch.zeros((1, 1, 1), dtype=like.dtype)
    return zero


_CAUSAL: dict = {}


def _causal(Lq: int, S: int, device: torch.device) -> Tensor:
    """bool ``[1, Lq, S]``: query i sees key j iff ``j <= S - Lq + i`` (bottom-right), cached per shape on the CPU."""
    cpu = torch.device(device).type == "cpu"  # kept for the CPU only, as _zero
    visible = _CAUSAL.get((Lq, S)) if cpu else None
    if visible is None:
        i = torch.arange(Lq, device=device)[:, None]
        j = torch.arange(S, device=device)[None, :]
        visible = (j <= S - Lq + i)[None]
        if cpu:
            if len(_CAUSAL) > 64:
                _CAUSAL.clear()
            _CAUSAL[(Lq, S)] = visible
    return visible
