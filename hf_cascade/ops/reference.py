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
    "merge_states_ref",
    "shared_prefix_attention_ref",
    "suffix_attention_ref",
    "write_suffix_kv_ref",
]

_NEG_INF = float("-inf")


def _empty_guard(lse: Tensor) -> Tensor:
    """+inf (FlashAttention-2's empty rows) and NaN mean "no keys": map them to -inf."""
    return torch.where(torch.isnan(lse) | (lse == float("inf")), _NEG_INF, lse)


def merge_states_ref(outs: Tensor, lses: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Exact N-way merge of attention states over disjoint key sets, stacked along ``dim`` (fp32 math).

    ``m = max lse``, ``w = exp(lse - m)``, ``out = sum w out / sum w``, ``lse = m + log sum w``: every weight is
    at most 1, so nothing overflows; empty states (lse -inf, +inf or NaN, see :func:`_empty_guard`) get weight 0
    and their ``out`` is ignored (it may hold garbage or NaN). The one merge of the package: the 2-way merge, the
    context-parallel combines and their references all reduce to it.

    Args:
        outs: ``[..., N, ..., D]`` states' outputs (any float dtype), stacked along ``dim``.
        lses: ``outs.shape[:-1]`` natural-log LSEs.
    Returns:
        ``(out [..., D] float32, lse [...] float32)`` with ``dim`` reduced. All empty: out 0, lse -inf.
    """
    dim = dim % lses.dim()
    lses = _empty_guard(lses.float())
    m = lses.amax(dim=dim, keepdim=True)
    weighted, w = scale_states(outs, lses, m)
    return normalize_states(weighted.sum(dim=dim), w.sum(dim=dim), m.squeeze(dim))


# The merge in two halves, so that a distributed combine can reduce the weighted sums between them.
def scale_states(outs: Tensor, lses: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """``(w * out fp32 [..., D], w fp32 [...])`` with ``w = exp(lse - m)``; ``lses`` already guarded, ``m`` their
    max, broadcastable to them (-inf where all are empty: taken as 0 there, so every weight is 0, not NaN)."""
    m = torch.where(m == _NEG_INF, 0.0, m)
    w = torch.exp(lses - m)  # 0 for empty states
    # where(), not multiply: an empty state may hold NaN garbage; 0 * NaN must stay 0.
    weighted = torch.where(w.unsqueeze(-1) > 0, outs.float() * w.unsqueeze(-1), 0.0)
    return weighted, w


def normalize_states(weighted: Tensor, total: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum w out / sum w, m + log sum w)`` from the sums; all empty (``total == 0``): out 0, lse -inf."""
    out = weighted / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return out, torch.where(m == _NEG_INF, 0.0, m) + torch.log(total)  # log(0) = -inf


def merge_attention_states_ref(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Exact merge of two attention states over disjoint key sets (fp32 math): :func:`merge_states_ref` of two.

    Args:
        out_a, out_b: [..., D] any float dtype, same shape.
        lse_a, lse_b: [...] natural-log LSE (fp32), ``out_a.shape[:-1]``. -inf, +inf or NaN mean
            "no keys"; that side's ``out`` is ignored (it may hold garbage or NaN).

    Returns:
        (out [..., D] float32, lse [...] float32). Both sides empty -> out 0, lse -inf.
    """
    return merge_states_ref(torch.stack([out_a.float(), out_b.float()]), torch.stack([lse_a, lse_b]), dim=0)


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
        key, value: [Hkv, T, D] / [Hkv, T, Dv] float; node n owns ``key[:, node_starts[n]:node_starts[n+1]]``.
        row_node: int64 [B]; node of each row, -1 for none (out 0, lse -inf).
        node_starts: int64 [N+1], nondecreasing, 0 .. T (or a host sequence of ints: no sync).
        rows_by_node: optional precomputed ``[rows of node n as int64 index tensor or None]``
            (``PrefixPlan`` holds it) to avoid a host sync per call.

    Returns:
        (out [B, Hq, Lq, Dv] float32, lse [B, Hq, Lq] float32).
    """
    B, Hq, Lq, D = query.shape
    Hkv, Dv = key.shape[0], value.shape[-1]
    g = Hq // Hkv
    out = query.new_zeros((B, Hq, Lq, Dv), dtype=torch.float32)
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
        o = o.view(Hkv, r, g * Lq, Dv).transpose(0, 1).reshape(r, Hq, Lq, Dv)
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
        key, value: [B, Hkv, S, D] / [B, Hkv, S, Dv] float (S may be 0).
        mask: None or bool [B, Lq, S] / [B, 1, Lq, S] (True = attend; batch dim may be 1).
        causal: without a mask, True = causal aligned bottom-right, False = full attention.
        prefix_out: optional [B, Hq, Lq, Dv] float; prefix_lse: optional fp32 [B, Hq, Lq].

    Returns:
        (out [B, Hq, Lq, Dv] float32, lse [B, Hq, Lq] float32; merged when a prefix is given).
    """
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    g = Hq // Hkv
    if mask is not None and mask.dim() == 4:
        mask = mask.squeeze(1)
    if S == 0:
        out = query.new_zeros((B, Hq, Lq, Dv), dtype=torch.float32)
        lse = query.new_full((B, Hq, Lq), _NEG_INF, dtype=torch.float32)
    else:
        # Fold GQA: [B, Hkv, g*Lq, D] against [B, Hkv, S, D].
        q = query.float().reshape(B, Hkv, g * Lq, D)
        s = _scores(q, key.float(), scale, softcap).view(B, Hkv, g, Lq, S)
        visible = suffix_visibility(B, Lq, S, mask, causal, query.device)
        if visible is not None:
            s = s.masked_fill(~visible.view(B, 1, 1, Lq, S), _NEG_INF)
        out, lse = _softmax_attend(s.view(B, Hkv, g * Lq, S), value.float())
        out = out.view(B, Hq, Lq, Dv)
        lse = lse.view(B, Hq, Lq)
    if prefix_out is not None:
        out, lse = merge_attention_states_ref(prefix_out, prefix_lse, out, lse)
    return out, lse


def write_suffix_kv_ref(key: Tensor, value: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                        length: Tensor) -> None:
    """``keys[:, :, positions] = key``, ``values[:, :, positions] = value``, ``length += Q`` (in place; see
    :func:`hf_cascade.ops.kv_write.write_suffix_kv`)."""
    keys.index_copy_(2, positions, key)
    values.index_copy_(2, positions, value)
    length.add_(key.shape[2])


def fused_attention_ref(query: Tensor, key: Tensor, value: Tensor, *, scale: float,
                        causal: bool) -> tuple[Tensor, Tensor]:
    """The PyTorch reference of :func:`fused_attention` (fp32 math; top-left causal)."""
    Lq, Lk = query.shape[2], key.shape[2]
    mask = None
    if causal:
        mask = (torch.arange(Lk, device=query.device)[None, :] <= torch.arange(Lq, device=query.device)[:, None])
        mask = mask[None].expand(query.shape[0], Lq, Lk)
    out, lse = suffix_attention_ref(query, key, value, scale=scale, mask=mask, causal=False)
    return out.to(query.dtype), lse
