"""Cascade attention on kernels that need no compilation: PyTorch's own FlashAttention-2 and matmuls.

Why. hf_cascade's Triton kernels are faster, but a process whose Triton cache is empty builds each one the first
time it runs (about a second each, several per call: ``benchmarks/results/first_call.jsonl``). A user's first
generate() call must not wait for a compiler (issue 32), so until the Triton kernels are ready
(:mod:`hf_cascade.tiers`) the cache attends with this path: every kernel in it ships compiled inside PyTorch.

How. Per prefix level, each node's rows attend to the node's keys through FlashAttention-2: a level of several
nodes in one variable-length call (every node a packed query sequence of its rows' queries against its span of keys;
one launch instead of one per node: a level of 16 nodes x 8 rows 24 us per decode step of 28 layers against 315 us,
64 nodes 38 against 1007, H200, ``benchmarks/results/probe_builtin_varlen.jsonl``), a single node by ``fused_attention``
(the rows' queries as one query sequence, non-causal, keys split over the SMs for short query sequences), where it
applies (CUDA, fp16/bf16, ``D == Dv``, head dim <= 256 and a multiple of 8, no soft-capping); elsewhere (fp32,
soft-capping, MLA head sizes, CPU) by matmuls in fp32 over the node's keys. The suffix pass (each row against its
own columns, under the cache's bool mask; a shared node's own causal forward runs FlashAttention-2) is matmuls:
scores in the input dtype as transformers' ``eager`` attention computes them, softmax in fp32, with each prefix
level's state as one more softmax column (logit: its log-sum-exp; value: its output), which is their exact LSE merge
in the suffix softmax's own kernels. Work is bounded: the suffix pass runs in query chunks of at
most :data:`CHUNK_ELEMENTS` scores.

Nodes are read from the plan's host layout, so a CUDA graph that records this path holds one layout: the
recorded decode step keys its graphs on the layout when this path runs (``CascadeCache.static_layout_key``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hf_cascade.transformers_compat import text_config

from .fused_attention import flash_takes, fused_attention, fused_attention_applies
from .reference import merge_states_ref

__all__ = ["CHUNK_ELEMENTS", "builtin_cascade_attention", "levels_in_one_call"]

# Most fp32 scores one matmul of the suffix pass (or of a node's fp32 prefix pass) materialises: 256 MB.
CHUNK_ELEMENTS = 1 << 26


def builtin_cascade_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefixes: Sequence[tuple[Tensor, Tensor, object]],
    *,
    scale: float,
    mask: Tensor | None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every row over its shared-prefix levels and its own suffix, merged exactly.

    Args:
        query: ``[B, Hq, Lq, D]`` float32/float16/bfloat16.
        key, value: the rows' suffix KV ``[B, Hkv, S, D]`` / ``[B, Hkv, S, Dv]`` (S may be 0).
        prefixes: per level ``(prefix_key [Hkv, T, D], prefix_value [Hkv, T, Dv], PrefixPlan)``
            (:func:`~hf_cascade.ops.plan.plan_shared_prefix`: its host ``node_starts``, ``row_node``
            and ``rows_by_node`` are read).
        scale: softmax scale. softcap: Gemma-2 soft-capping of the scores, or None.
        mask: bool ``[B or 1, Lq, S]`` (True = visible) over the suffix keys, or None: causal, aligned
            bottom-right (query ``i`` sees suffix keys ``j <= S - Lq + i``).
    Returns:
        ``(out [B, Lq, Hq, Dv] contiguous in query.dtype, lse [B, Hq, Lq] float32 natural log; -inf where a
        query sees no key)``.
    """
    B, Hq, Lq, _ = query.shape
    out = query.new_empty((B, Lq, Hq, value.shape[-1]))
    levels = [_prefix_level(query, k_pre, v_pre, plan, scale, softcap) for k_pre, v_pre, plan in prefixes]
    lse = _suffix_state(query, key, value, scale, mask, softcap, levels, out.transpose(1, 2))
    return out, lse


def levels_in_one_call(model) -> bool:
    """Whether ``model``'s prefix levels run as one variable-length flash call per level on this path (CUDA,
    fp16/bf16, one head size <= 256 and a multiple of 8, no soft-capping), so that a level's nodes cost one launch
    (the cost model then charges a level, not each node: :class:`~hf_cascade.cost_model.CascadeCostModel`)."""
    text = text_config(model.config)
    heads = getattr(text, "num_attention_heads", None) or 1
    head = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
    same_v = getattr(text, "v_head_dim", None) in (None, head)
    return (model.device.type == "cuda" and flash_takes(model.dtype, head) and same_v
            and getattr(text, "attn_logit_softcapping", None) is None)


def _prefix_level(query: Tensor, k_pre: Tensor, v_pre: Tensor, plan, scale: float, softcap: float | None):
    """One level's state ``(out [B, Hq, Lq, Dv] fp32 or query.dtype, any strides; lse [B, Hq, Lq] fp32)``: each
    node's rows against its keys; all nodes in one variable-length FlashAttention-2 call where it applies
    (:func:`_varlen_applies`), else node by node."""
    if _varlen_applies(query, k_pre, v_pre, plan, softcap):
        return _prefix_level_varlen(query, k_pre, v_pre, plan, scale)
    B, Hq, Lq, _ = query.shape
    Dv = v_pre.shape[-1]
    out = query.new_zeros((B, Hq, Lq, Dv), dtype=torch.float32)
    lse = query.new_full((B, Hq, Lq), float("-inf"), dtype=torch.float32)
    starts = plan.node_starts
    for node, rows in enumerate(plan.node_row_ranges):
        a, b = starts[node], starts[node + 1]
        if b == a or rows == (0, 0):
            continue
        if rows is not None:  # consecutive rows (a prompt's samples, a group): a slice
            first, last = rows
            o, l = _node_attention(query[first:last], k_pre[:, a:b], v_pre[:, a:b], scale, softcap)
            if last - first == B:
                out, lse = o, l
            else:
                out[first:last], lse[first:last] = o, l
            continue
        index = plan.rows_by_node[node]  # (a recorded step keeps the plan alive: CascadeCache.static_step_keepalive)
        o, l = _node_attention(query.index_select(0, index), k_pre[:, a:b], v_pre[:, a:b], scale, softcap)
        out.index_copy_(0, index, o.to(out.dtype))
        lse.index_copy_(0, index, l)
    return out, lse


def _varlen_applies(query: Tensor, k_pre: Tensor, v_pre: Tensor, plan, softcap: float | None) -> bool:
    """Whether a level runs as one varlen flash call: several nodes (one node is one plain call, ~30% faster),
    CUDA, FlashAttention-2's dtypes and head sizes, no soft-capping, every node with rows has keys, and the packed
    layout already on the device (it is not built while a CUDA graph records: that step runs node by node)."""
    if plan.num_nodes < 2 or query.device.type != "cuda" or v_pre.shape[-1] != query.shape[-1]:
        return False
    if not fused_attention_applies(query, k_pre[None], softcap=softcap):
        return False
    if "varlen_layout" not in vars(plan) and torch.cuda.is_current_stream_capturing():
        return False
    return plan.varlen_layout[-1]


def _prefix_level_varlen(query: Tensor, k_pre: Tensor, v_pre: Tensor, plan, scale: float):
    """One level by one call of ``aten._flash_attention_forward`` over packed sequences: node ``n``'s query sequence
    is its rows' queries (``rows x Lq`` tokens, rows in the plan's node order: gathered, unless the batch is in that
    order already), its key sequence its span of the
    level's keys (nodes are consecutive spans: the offsets are ``node_starts``). Rows without a node get
    ``(0, -inf)``. Returns ``(out [B, Hq, Lq, Dv] query.dtype, lse [B, Hq, Lq] fp32)``, views where no row moved."""
    B, Hq, Lq, D = query.shape
    order, row_offsets, key_offsets, max_rows, max_keys, _ = plan.varlen_layout
    rows = B if order is None else order.shape[0]
    q = (query if order is None else query.index_select(0, order)).transpose(1, 2).reshape(rows * Lq, Hq, D)
    q = q.contiguous()  # (a no-op where the query's rows are already packed, as a decode step's are)
    k, v = k_pre.transpose(0, 1), v_pre.transpose(0, 1)  # [T, Hkv, D] views, last dim contiguous
    q_offsets = row_offsets if Lq == 1 else row_offsets * Lq
    o, lse = _varlen_flash(q, k, v, q_offsets, key_offsets, max_rows * Lq, max_keys, scale)
    if lse.dim() == 3:  # an older layout: [N, Hq, max_q] padded per node; as [Hq, total_q]
        node = torch.repeat_interleave(torch.arange(plan.num_nodes, device=q.device), q_offsets.diff().long(),
                                       output_size=rows * Lq)
        lse = lse[node, :, torch.arange(rows * Lq, device=q.device) - q_offsets[node].long()].transpose(0, 1)
    o = o.reshape(rows, Lq, Hq, D).transpose(1, 2)  # views: the suffix pass reads them as they lie
    lse = lse.reshape(Hq, rows, Lq).transpose(0, 1)
    if order is None:  # every row, in batch order
        return o, lse
    out = o.new_zeros((B, Hq, Lq, D))
    full = query.new_full((B, Hq, Lq), float("-inf"), dtype=torch.float32)
    return out.index_copy_(0, order, o), full.index_copy_(0, order, lse)


def _varlen_flash(q, k, v, q_offsets, key_offsets, max_q: int, max_k: int, scale: float):
    """FlashAttention-2 over packed sequences, non-causal: ``q [total_q, Hq, D]``, ``k, v [T, Hkv, D]``, int32
    offsets ``[N+1]``. Returns ``(out [total_q, Hq, D], lse fp32 [Hq, total_q] or [N, Hq, max_q])``."""
    return torch.ops.aten._flash_attention_forward(q, k, v, q_offsets, key_offsets, max_q, max_k, 0.0, False, False,
                                                   scale=scale)[:2]


def _node_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None):
    """``R`` rows' queries ``[R, Hq, Lq, D]`` against one node's keys ``[Hkv, T, D]`` (every key visible).
    Returns ``(out [R, Hq, Lq, Dv] fp32, or query.dtype from FlashAttention-2; lse [R, Hq, Lq] fp32)``."""
    R, Hq, Lq, D = q.shape
    Hkv, T, Dv = k.shape[0], k.shape[1], v.shape[-1]
    G = Hq // Hkv
    # The rows' queries as one sequence per head: [1, Hq, R * Lq, D].
    seq = q.permute(1, 0, 2, 3).reshape(1, Hq, R * Lq, D)
    if Dv == D and fused_attention_applies(seq, k[None], softcap=softcap):
        o, l = fused_attention(seq, k[None], v[None], scale=scale, causal=False)
        o = o.reshape(Hq, R, Lq, Dv).permute(1, 0, 2, 3)
        return o, l.reshape(Hq, R, Lq).permute(1, 0, 2)
    # fp32 matmuls, grouped by KV head (GQA folded into the query rows), in chunks of query rows.
    qf = q.float().reshape(R, Hkv, G * Lq, D).transpose(0, 1).reshape(Hkv, R * G * Lq, D)
    kf, vf = k.float(), v.float()
    rows = max(1, CHUNK_ELEMENTS // max(Hkv * T, 1))
    outs, lses = [], []
    for i in range(0, qf.shape[1], rows):
        s = torch.matmul(qf[:, i:i + rows], kf.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        l = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - l.unsqueeze(-1)), vf))
        lses.append(l)
    o = torch.cat(outs, dim=1).reshape(Hkv, R, G * Lq, Dv).transpose(0, 1).reshape(R, Hq, Lq, Dv)
    l = torch.cat(lses, dim=1).reshape(Hkv, R, G * Lq).transpose(0, 1).reshape(R, Hq, Lq)
    return o, l


def _suffix_state(query: Tensor, key: Tensor, value: Tensor, scale: float, mask: Tensor | None,
                  softcap: float | None, levels: Sequence[tuple[Tensor, Tensor]], out: Tensor) -> Tensor:
    """Each row's queries against its own suffix keys under ``mask``, merged with the prefix ``levels`` (each
    ``(out [B, Hq, Lq, Dv] any float dtype and strides, lse [B, Hq, Lq] fp32, -inf for a row without a node)``),
    written to ``out [B, Hq, Lq, Dv]`` (query.dtype, any strides). Returns ``lse [B, Hq, Lq] fp32``.

    Scores in the input dtype (as ``eager`` attention), softmax in fp32, in chunks of queries. Each level joins the
    softmax as one more column whose logit is its LSE and whose value is its output: exactly the LSE merge of every
    state, in the few kernels of the suffix's own softmax (on a CUDA graph's decode step every kernel is a launch:
    2 levels of a decode step take 17 besides their flash calls, against ~50 with the merges apart)."""
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    if S == 0 or (mask is None and Lq == S and Dv == D and fused_attention_applies(query, key, softcap=softcap)):
        # No suffix keys, or a node's own forward (causal, no padding: FlashAttention-2): an N-way merge.
        states = list(levels)
        if S:
            states.append(fused_attention(query, key, value, scale=scale, causal=True))
        if not states:
            out.zero_()
            return query.new_full((B, Hq, Lq), float("-inf"), dtype=torch.float32)
        merged = states[0] if len(states) == 1 else merge_states_ref(
            torch.stack([o.float() for o, _ in states]), torch.stack([l for _, l in states]))
        out.copy_(merged[0])
        return merged[1]
    if mask is None:  # causal, bottom-right
        columns = torch.arange(S, device=query.device)
        last = S - Lq + torch.arange(Lq, device=query.device)
        mask = (columns[None, :] <= last[:, None])[None]
    step = max(1, CHUNK_ELEMENTS // max(B * Hq * (S + len(levels)), 1))
    lses = []
    q_all = query * scale
    for i in range(0, Lq, step):
        q = q_all[:, :, i:i + step]
        n = q.shape[2]
        # [B, Hkv, G * n, D] x [B, Hkv, D, S]: the KV heads are never repeated.
        s = torch.matmul(q.reshape(B, Hkv, G * n, D), key.transpose(-1, -2)).view(B, Hkv, G, n, S)
        if softcap is not None:
            s = softcap * torch.tanh(s.float() / softcap)
        s = torch.where(mask[:, None, None, i:i + step], s, float("-inf"))
        if levels:  # their LSEs as columns S, S + 1, ... (cat promotes the scores to fp32)
            s = torch.cat([s, *(l[:, :, i:i + step].reshape(B, Hkv, G, n, 1) for _, l in levels)], dim=-1)
        s = s.float()
        top = torch.nan_to_num(s.amax(dim=-1, keepdim=True), neginf=0.0)  # 0 where no key is visible
        p = torch.exp(s - top)
        total = p.sum(dim=-1, keepdim=True)  # >= 1 (the top column's exp(0)), or 0 where no key is visible
        lses.append((top + total.log()).view(B, Hq, n))  # -inf where no key is visible
        p = p / total.clamp(min=1.0)
        o = torch.matmul(p[..., :S].to(value.dtype).reshape(B, Hkv, G * n, S), value).view(B, Hq, n, Dv)
        target = out[:, :, i:i + step]
        if not levels:
            target.copy_(o)
        for j, (level_out, _) in enumerate(levels):  # o + p_j * out_j, in fp32; the last one stored in out's dtype
            weight = p[..., S + j:S + j + 1].reshape(B, Hq, n, 1)
            last = j == len(levels) - 1
            o = torch.addcmul(o, weight, level_out[:, :, i:i + step], out=target if last else None)
    return lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
