"""fp32 pure-PyTorch references for every attention op.

They define the semantics that the Triton kernels must match, and they are the ``backend="torch"``
path (CPU inference with small fp32 models), so they use batched matmuls, fold GQA by reshaping the
query (never ``repeat_kv``), and never copy the shared prefix per row.

All references compute in float32 and return float32 outputs (callers cast). LSE is the natural
log, float32. An attention state with no keys has ``lse = -inf`` and ``out = 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "merge_attention_states_ref",
    "shared_prefix_attention_ref",
    "suffix_attention_ref",
]

_NEG_INF = float("-inf")


def _empty_guard(lse: Tensor) -> Tensor:
    """+inf (FlashAttention-2's empty rows) and NaN mean "no keys": map them to -inf."""
    return torch.where(torch.isnan(lse) | (lse == float("inf")), _NEG_INF, lse)


def merge_attention_states_ref(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Exact merge of two attention states over disjoint key sets (fp32 math).

    Args:
        out_a, out_b: [..., D] any float dtype, same shape.
        lse_a, lse_b: [...] natural-log LSE (fp32), ``out_a.shape[:-1]``. -inf, +inf or NaN mean
            "no keys"; that side's ``out`` is ignored (it may hold garbage or NaN).

    Returns:
        (out [..., D] float32, lse [...] float32). Both sides empty -> out 0, lse -inf.
    """
    la = _empty_guard(lse_a.float())
    lb = _empty_guard(lse_b.float())
    m = torch.maximum(la, lb)
    m = torch.where(m == _NEG_INF, 0.0, m)
    wa = torch.exp(la - m)
    wb = torch.exp(lb - m)
    total = wa + wb
    lse = m + torch.log(total)  # log(0) = -inf: both empty
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    wa = (wa * inv).unsqueeze(-1)
    wb = (wb * inv).unsqueeze(-1)
    # where(), not multiply: 0 * NaN garbage from an empty side must stay 0.
    out = torch.where(wa > 0, out_a.float() * wa, 0.0) + torch.where(wb > 0, out_b.float() * wb, 0.0)
    return out, lse


def _softmax_attend(scores: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(scores) @ value with -inf-safe LSE. scores [..., M, N] fp32, value [..., N, D] fp32."""
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with every key masked
    lse_safe = torch.where(lse == _NEG_INF, 0.0, lse)
    probs = torch.exp(scores - lse_safe.unsqueeze(-1))  # exp(-inf) = 0 for masked keys
    return probs @ value, lse


def _scores(q: Tensor, k: Tensor, scale: float, softcap: float | None) -> Tensor:
    """scale * q @ k^T, then Gemma-2 soft-capping ``softcap * tanh(s / softcap)`` when given."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return s


def shared_prefix_attention_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    row_node: Tensor,
    node_starts: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    rows_by_node: list[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """All batch rows against the shared prefix KV of their node (fp32 math, no mask).

    Args:
        query: [B, Hq, Lq, D] float.
        key, value: [Hkv, T, D] float; node n owns ``key[:, node_starts[n]:node_starts[n+1]]``.
        row_node: int64 [B]; node of each row, -1 for none (out 0, lse -inf).
        node_starts: int64 [N+1], nondecreasing, 0 .. T (or a host sequence of ints: no sync).
        rows_by_node: optional precomputed ``[rows of node n as int64 index tensor or None]``
            (``PrefixPlan`` holds it) to avoid a host sync per call.

    Returns:
        (out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32).
    """
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    g = Hq // Hkv
    out = query.new_zeros((B, Hq, Lq, D), dtype=torch.float32)
    lse = query.new_full((B, Hq, Lq), _NEG_INF, dtype=torch.float32)
    starts = [int(x) for x in (node_starts.tolist() if isinstance(node_starts, Tensor) else node_starts)]
    if rows_by_node is None:
        row_node = row_node.to(query.device)
        rows_by_node = []
        for n in range(len(starts) - 1):
            rows = torch.nonzero(row_node == n).flatten()
            rows_by_node.append(rows if rows.numel() else None)
    for n, rows in enumerate(rows_by_node):
        lo, hi = starts[n], starts[n + 1]
        if rows is None or hi == lo:
            continue
        r = rows.numel()
        # Fold (row, group, position) into M: [r, Hkv, g, Lq, D] -> [Hkv, r*g*Lq, D].
        q = query.index_select(0, rows).float().view(r, Hkv, g * Lq, D).transpose(0, 1)
        q = q.reshape(Hkv, r * g * Lq, D)
        k = key[:, lo:hi].float()
        v = value[:, lo:hi].float()
        o, l = _softmax_attend(_scores(q, k, scale, softcap), v)
        o = o.view(Hkv, r, g * Lq, D).transpose(0, 1).reshape(r, Hq, Lq, D)
        l = l.view(Hkv, r, g * Lq).transpose(0, 1).reshape(r, Hq, Lq)
        out.index_copy_(0, rows, o)
        lse.index_copy_(0, rows, l)
    return out, lse


def suffix_visibility(
    batch: int, lq: int, s: int, mask: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Bool [B, Lq, S] (True = attend) for the suffix pass, or None for full attention.

    ``mask`` given: used as is (``causal`` ignored). Otherwise ``causal`` aligns bottom-right:
    query i sees key j iff ``j <= S - Lq + i``.
    """
    if mask is not None:
        return mask.expand(batch, lq, s)
    if not causal:
        return None
    i = torch.arange(lq, device=device).unsqueeze(1)
    j = torch.arange(s, device=device).unsqueeze(0)
    return (j <= s - lq + i).unsqueeze(0).expand(batch, lq, s)


def suffix_attention_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    prefix_out: Tensor | None = None,
    prefix_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Each row against its own KV, optionally merged with a prefix state (fp32 math).

    Args:
        query: [B, Hq, Lq, D] float.
        key, value: [B, Hkv, S, D] float (S may be 0).
        mask: None or bool [B, Lq, S] / [B, 1, Lq, S] (True = attend; batch dim may be 1).
        causal: without a mask, True = causal aligned bottom-right, False = full attention.
        prefix_out: optional [B, Hq, Lq, D] float; prefix_lse: optional fp32 [B, Hq, Lq].

    Returns:
        (out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32; merged when a prefix is given).
    """
    B, Hq, Lq, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    g = Hq // Hkv
    if mask is not None and mask.dim() == 4:
        mask = mask.squeeze(1)
    if S == 0:
        out = query.new_zeros((B, Hq, Lq, D), dtype=torch.float32)
        lse = query.new_full((B, Hq, Lq), _NEG_INF, dtype=torch.float32)
    else:
        # Fold GQA: [B, Hkv, g*Lq, D] against [B, Hkv, S, D].
        q = query.float().reshape(B, Hkv, g * Lq, D)
        s = _scores(q, key.float(), scale, softcap).view(B, Hkv, g, Lq, S)
        visible = suffix_visibility(B, Lq, S, mask, causal, query.device)
        if visible is not None:
            s = s.masked_fill(~visible.view(B, 1, 1, Lq, S), _NEG_INF)
        out, lse = _softmax_attend(s.view(B, Hkv, g * Lq, S), value.float())
        out = out.view(B, Hq, Lq, D)
        lse = lse.view(B, Hq, Lq)
    if prefix_out is not None:
        out, lse = merge_attention_states_ref(prefix_out, prefix_lse, out, lse)
    return out, lse
