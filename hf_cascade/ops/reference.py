"""The one fp32 PyTorch reference of cascade attention, and of each of its parts.

It defines the semantics that the Triton kernels must match, and it is every ``backend="torch"`` path (CPU inference
with small fp32 models; the PyTorch path of compiled and recorded steps): :func:`cascade_attention_ref` is the whole
cascade (shared-prefix levels + each row's suffix, optional soft cap, suffix mask, written length and per-query
lower bounds for sliding windows), and :func:`shared_prefix_attention_ref` / :func:`suffix_attention_ref` /
:func:`merge_attention_states_ref` the single ops. They use batched matmuls, fold GQA by reshaping the query (never
``repeat_kv``), and never copy the shared prefix per row.

All references compute in float32 and return float32 outputs (callers cast). LSE is the natural log, float32. An
attention state with no keys has ``lse = -inf`` and ``out = 0``.

**The cascade in one softmax.** Composing the single ops (per level the prefix pass, then one merge per level, then
the suffix merging the prefix state) is ~200 small ops per layer on CPU: per node an index_select, a few reshapes
and a softmax, per merge two stacks and a dozen elementwise ops. At one query per row every one of them is a few
microseconds of dispatch, and on a busy CPU each one run in parallel waits for OpenMP's other threads (issue 35: a
decode step 20x sdpa's). :func:`cascade_attention_ref` reads, per layer, in fp32:

* a level every row reads at most a small multiple of (a shared prompt, or a few nodes; see
  :attr:`~hf_cascade.ops.plan.PrefixPlan.torch_way`), and every level given by device index tensors or with lower
  bounds, as one matmul of all the rows' queries against all the level's keys, ``[Hkv, B * G * Lq, D] x [Hkv, D,
  T]`` (the keys stored once, never per row), the columns a query does not see (other nodes', below its bound)
  hidden by one mask (and their values kept out of ``P @ V``, where 0 x NaN would be NaN: :func:`_values_product`);
* a level of many short nodes by gathering each row's node keys (``[B, Hkv, max_node_len, D]``);
* any other level (a few long nodes read by few rows) node by node (:func:`shared_prefix_attention_ref`), joining as
  an attention state;
* the suffix: one batched matmul, its mask applied by one ``where``.

Their scores share one softmax: one max over the parts, then per part ``exp``, a sum and ``P @ V``; the sums and
products add up. Measured (SmolLM2-135M, the demo's 2-level tree, one layer's attention in a decode step): 86 ops
dispatched, views included, instead of 205. The result is the same attention as the composition (every key of the
row's nodes and its visible suffix keys), computed in another order (fp32 rounding differs).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "cascade_attention_ref",
    "eager_attention_ref",
    "merge_attention_states_ref",
    "merge_states_ref",
    "shared_prefix_attention_ref",
    "suffix_attention_ref",
    "write_suffix_kv_ref",
]

_NEG_INF = float("-inf")
_F32_MIN = torch.finfo(torch.float32).min


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
    """Each row against its own KV, optionally merged with a prefix state (fp32 math): :func:`cascade_attention_ref`
    without prefix levels.

    Args:
        query: [B, Hq, Lq, D] float.
        key, value: [B, Hkv, S, D] / [B, Hkv, S, Dv] float (S may be 0).
        mask: None or bool [B, Lq, S] / [B, 1, Lq, S] (True = attend; batch dim may be 1).
        causal: without a mask, True = causal aligned bottom-right, False = full attention.
        prefix_out: optional [B, Hq, Lq, Dv] float; prefix_lse: optional fp32 [B, Hq, Lq] (-inf, +inf or NaN:
            no keys, ``prefix_out`` ignored there).

    Returns:
        (out [B, Hq, Lq, Dv] float32, lse [B, Hq, Lq] float32; merged when a prefix is given).
    """
    prior = None if prefix_out is None else (prefix_out, prefix_lse)
    return cascade_attention_ref(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                                 prior=prior)


def cascade_attention_ref(
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    levels=(),
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    key_length: Tensor | None = None,
    key_lower=None,
    suffix_lower: Tensor | None = None,
    prior: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every row over its shared-prefix levels and its own suffix, in one softmax (fp32 math; see the
    module docstring). Inputs are not validated (the ops do that).

    Args:
        query: ``[B, Hq, Lq, D]``.
        key, value: the rows' suffix KV ``[B, Hkv, S, D]`` / ``[B, Hkv, S, Dv]`` (S may be 0), or None: no suffix.
        levels: per level ``(prefix_key [Hkv, T, D], prefix_value [Hkv, T, Dv], layout)``; ``layout`` a
            :class:`~hf_cascade.ops.plan.PrefixPlan` (host data: the level is read its fastest way), or ``(node_starts,
            row_node)``, int64 device tensors ``[N + 1 or more]`` / ``[B]`` (no host data, no sync: a compiled step's
            layout; every row against all the level's keys, other nodes' columns hidden).
        mask: bool ``[B or 1, Lq, S]`` / ``[B or 1, 1, Lq, S]`` over the suffix (True = visible), or None: ``causal``
            True is causal aligned bottom-right, False full attention.
        key_length: None, or an int64 tensor of one element: suffix columns from it on are not visible (unwritten).
        key_lower, suffix_lower: None, or per level and for the suffix int64 ``[B, Lq]``: the first column of that
            level's packed keys / of the suffix keys each query sees (sliding windows, chunks).
        prior: an attention state ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])`` merged in (-inf, +inf, NaN: empty).
    Returns:
        ``(out [B, Hq, Lq, Dv] float32, laid out [B, Lq, Hq, Dv]; lse [B, Hq, Lq] float32)``, lse -inf (out 0) where
        a query sees no key.
    """
    B, Hq, Lq, D = query.shape
    Hkv, Dv = (key.shape[1], value.shape[-1]) if key is not None else (levels[0][0].shape[0], levels[0][1].shape[-1])
    M = Hq // Hkv * Lq
    # Queries batch-major [B * Hkv, M, D] (the suffix's layout) and, for levels read through one matmul, head-major
    # [Hkv, B * M, D] (GQA folded into M).
    q = query.float().reshape(B * Hkv, M, D)
    q_heads = None
    parts = []  # per part: ("rows", e [B, Hkv, M, N] scores then weights, values [B * Hkv, N, Dv], hidden)
    #                       ("heads", scores [Hkv, B * M, T], values [Hkv, T, Dv], hidden)
    #                       ("state", out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M], None)
    # hidden: None, or the columns masked in the scores that hold other nodes' values (see _values_product)
    lowers = [None] * len(levels) if key_lower is None else key_lower
    for (k_pre, v_pre, layout), lower in zip(levels, lowers):
        way = "dense" if isinstance(layout, tuple) else layout.torch_way
        if way == "empty" or B == 0:
            continue
        if way == "dense" or lower is not None:
            if q_heads is None:
                q_heads = q.view(B, Hkv, M, D).transpose(0, 1).reshape(Hkv, B * M, D)
            s = _scores3(q_heads, k_pre.float(), scale, softcap)  # [Hkv, B * M, T]
            hide = _level_hidden(layout, k_pre.shape[1], lower, query.device)
            if hide is not None:
                s.view(Hkv, B, Hq // Hkv, Lq, -1).masked_fill_(hide[None, :, None], _NEG_INF)
            parts.append(("heads", s, v_pre.float(), hide))
        elif way == "gather":
            index, valid = layout.gather_index  # [B, L] each row's node columns, left-aligned
            k = k_pre[:, index].float().transpose(0, 1).reshape(B * Hkv, -1, D)  # [B * Hkv, L, D]
            v = v_pre[:, index].float().transpose(0, 1).reshape(B * Hkv, -1, Dv)
            s = _scores3(q, k, scale, softcap).view(B, Hkv, M, -1)
            padding = None if layout.gather_all_valid else ~valid  # (pointing at column 0: another node's)
            if padding is not None:
                s.masked_fill_(padding[:, None, None, :], _NEG_INF)
            parts.append(("rows", s, v, padding))
        else:  # a few long nodes read by few rows: node by node (no keys copied per row)
            o, lse = shared_prefix_attention_ref(query, k_pre, v_pre, None, layout.node_starts, scale=scale,
                                                 softcap=softcap, rows_by_node=layout.rows_by_node)
            parts.append(("state", o.view(B, Hkv, M, Dv), _empty_guard(lse).view(B, Hkv, M), None))
    if prior is not None:
        parts.append(("state", prior[0].float().reshape(B, Hkv, M, Dv), _empty_guard(prior[1]).reshape(B, Hkv, M),
                      None))
    S = 0 if key is None else key.shape[2]
    if S and B:
        s = _scores3(q, key.float().reshape(B * Hkv, S, D), scale, softcap).view(B, Hkv, Hq // Hkv, Lq, S)
        visible = _suffix_visible(mask, causal, key_length, suffix_lower, Lq, S, query.device)
        if visible is not None:
            s = torch.where(visible[:, None, None], s, _NEG_INF)
        parts.append(("rows", s.view(B, Hkv, M, S), value.float().reshape(B * Hkv, S, Dv), None))
    return _joint_softmax(parts, query, Hkv, Dv)


def _level_hidden(layout, T: int, lower: Tensor | None, device) -> Tensor | None:
    """bool ``[B, Lq or 1, T]``: True at the level's columns a query does not see (not its row's node's, or below
    ``lower`` ``[B, Lq]``); None where every query sees every column."""
    if isinstance(layout, tuple):  # device index tensors
        node_starts, row_node = layout
        has_node = row_node >= 0
        node = row_node.clamp(min=0)
        start = torch.where(has_node, node_starts[node], 0)
        end = torch.where(has_node, node_starts[(node + 1).clamp(max=node_starts.numel() - 1)], 0)
        columns = torch.arange(T, device=device)
        hide = ((columns < start[:, None]) | (columns >= end[:, None]))[:, None, :]
    else:
        hide = layout.dense_hide
    if lower is not None:
        below = torch.arange(T, device=device) < lower[:, :, None]  # [B, Lq, T]
        hide = below if hide is None else hide | below
    return hide


def _suffix_visible(mask: Tensor | None, causal: bool, key_length: Tensor | None, lower: Tensor | None, Lq: int,
                    S: int, device) -> Tensor | None:
    """bool ``[B or 1, Lq or 1, S]`` (True = visible) of the suffix keys, or None: all visible. ``mask`` given: used
    as is (``causal`` ignored); else ``causal`` aligns bottom-right (query i sees key j iff ``j <= S - Lq + i``).
    Then the written length (``key_length``) and each query's first column (``lower`` ``[B, Lq]``) cut it."""
    visible = mask.squeeze(1) if mask is not None and mask.dim() == 4 else mask
    if visible is None and causal and Lq > 1:
        visible = _causal(Lq, S, device)
    columns = torch.arange(S, device=device) if key_length is not None or lower is not None else None
    if key_length is not None:
        written = (columns < key_length.reshape(()))[None, None, :]
        visible = written if visible is None else visible & written
    if lower is not None:
        above = columns >= lower[:, :, None]
        visible = above if visible is None else visible & above
    return visible


def _joint_softmax(parts: list, query: Tensor, Hkv: int, Dv: int) -> tuple[Tensor, Tensor]:
    """One softmax over the scores of every part, each part's ``P @ V`` summed: ``(out [B, Hq, Lq, Dv] float32,
    laid out [B, Lq, Hq, Dv]; lse [B, Hq, Lq] float32)``. Parts (their scores are overwritten):
    ``("heads", scores [Hkv, B * M, T], values [Hkv, T, Dv], hidden)`` (a level read by one matmul),
    ``("rows", scores [B, Hkv, M, N], values [B * Hkv, N, Dv], hidden)`` (per-row keys), or
    ``("state", out [B, Hkv, M, Dv] fp32, lse [B, Hkv, M], None)`` (an attention state, -inf where empty);
    ``hidden``: see :func:`_values_product`."""
    B, Hq, Lq, _ = query.shape
    G = Hq // Hkv
    M = G * Lq
    # One softmax over every part: the max over all of them (a row with no key: -inf, taken as the float32 minimum,
    # so that exp() gives 0 and not NaN).
    m = None
    for kind, a, b, _ in parts:
        if kind == "heads":
            part_max = a.amax(dim=-1).view(Hkv, B, M).transpose(0, 1)
        elif kind == "rows":
            part_max = a.amax(dim=-1)
        else:  # the state's lse
            part_max = b
        m = part_max if m is None else torch.maximum(m, part_max)
    if m is None:  # no key at all
        out = query.new_zeros((B, Lq, Hq, Dv), dtype=torch.float32).transpose(1, 2)
        return out, query.new_full((B, Hq, Lq), _NEG_INF, dtype=torch.float32)
    m = m.clamp(min=_F32_MIN)  # [B, Hkv, M]
    total = num = None
    for kind, a, b, hidden in parts:
        if kind == "heads":
            a.view(Hkv, B, M, -1).sub_(m.transpose(0, 1).unsqueeze(-1)).exp_()
            part_sum = a.sum(dim=-1).view(Hkv, B, M).transpose(0, 1)
            part_num = _values_product(a, b, hidden, B).view(Hkv, B, M, Dv).transpose(0, 1)
        elif kind == "rows":
            a.sub_(m.unsqueeze(-1)).exp_()
            part_sum = a.sum(dim=-1)
            part_num = _values_product(a.view(B * Hkv, M, -1), b, hidden, B).view(B, Hkv, M, Dv)
        else:
            part_sum = torch.exp(b - m)  # 0 for an empty state
            # where(), not multiply: an empty state's out may hold NaN garbage; 0 * NaN must stay 0.
            part_num = torch.where(part_sum.unsqueeze(-1) > 0, a * part_sum.unsqueeze(-1), 0.0)
        total = part_sum if total is None else total + part_sum
        num = part_num if num is None else num.add_(part_num) if num.is_contiguous() else num + part_num
    # total >= 1 where a row has a key (its largest score gives exp(0)); 0 where it has none (then num is 0 too).
    lse = (m + torch.log(total)).reshape(B, Hq, Lq)  # log(0) = -inf: no key
    out = torch.empty((B, Lq, Hkv, G, Dv), dtype=torch.float32, device=query.device)
    torch.div(num.reshape(B, Hkv, G, Lq, Dv), total.clamp(min=1.0).reshape(B, Hkv, G, Lq, 1),
              out=out.permute(0, 2, 3, 1, 4))
    return out.view(B, Lq, Hq, Dv).transpose(1, 2), lse


def _values_product(p: Tensor, v: Tensor, hidden: Tensor | None, B: int) -> Tensor:
    """``p @ v`` (bmm) of one part's weights and values, where a column masked for a query adds nothing to it even
    when its value is NaN or inf. A masked column's weight is 0, and 0 x NaN is NaN: a NaN (or an fp16 overflow) in
    one node's KV would reach every row of the level, read or not, where sdpa keeps another row's KV out.

    Args:
        p: ``[Hkv, B * M, T]`` (a level read by one matmul, ``M = G * Lq``; ``v`` ``[Hkv, T, Dv]`` shared by the
            rows) or ``[B * Hkv, M, L]`` (node columns gathered per row; ``v`` ``[B * Hkv, L, Dv]``).
        hidden: None (no masked column holds another node's value), or bool ``[B, Lq or 1, T]`` (True: the column
            is not the query's) resp. ``[B, L]`` (True: a padding entry).
    Returns:
        ``p @ v`` ``[Hkv, B * M, Dv]`` resp. ``[B * Hkv, M, Dv]``, fp32. On the CPU outside ``torch.compile`` the
        plain product when it is finite (the common case: no pass over the values); else the product over finite
        values only, NaN for the queries that read a non-finite value (sdpa's are NaN or inf there).
    """
    if hidden is None:
        return torch.bmm(p, v)
    if p.device.type == "cpu" and not torch.compiler.is_compiling():
        out = torch.bmm(p, v)
        if bool(torch.isfinite(out).all()):
            return out
    if hidden.dim() == 2:  # gathered: a row's padding entries zeroed, its own node's values kept as they are
        return torch.bmm(p, v.masked_fill(hidden.repeat_interleave(v.shape[0] // B, dim=0)[:, :, None], 0.0))
    return _finite_columns_product(p, v, hidden, B)


def _finite_columns_product(p: Tensor, v: Tensor, hidden: Tensor, B: int) -> Tensor:
    """``p @ v`` of a level read by one matmul (``p`` ``[Hkv, B * G * Lq, T]``, ``v`` ``[Hkv, T, Dv]``) over its
    finite value columns only; NaN for the queries that see (``hidden`` ``[B, Lq or 1, T]`` False) a column holding a
    non-finite value. Returns ``[Hkv, B * G * Lq, Dv]`` fp32."""
    bad = ~torch.isfinite(v).all(dim=-1)  # [Hkv, T]
    out = torch.bmm(p, v.masked_fill(bad[:, :, None], 0.0))
    seen = torch.einsum("blt,ht->hbl", (~hidden).float(), bad.float()) > 0  # [Hkv, B, Lq or 1]
    Hkv, Lq = v.shape[0], hidden.shape[1]
    return out.view(Hkv, B, -1, Lq, v.shape[-1]).masked_fill(seen[:, :, None, :, None], float("nan")).view_as(out)


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


def eager_attention_ref(query: Tensor, key: Tensor, value: Tensor, *, scale: float, mask: Tensor | None,
                        softcap: float | None = None, sinks: Tensor | None = None, dropout: float = 0.0,
                        training: bool = False) -> Tensor:
    """transformers' ``eager`` attention as the soft-capped (Gemma 2) and sink (GPT-OSS) families compute it, and
    differentiable: the path of a forward that needs gradients or dropout (the kernels and the fused reference are
    inference-only). Scores in the input dtype, soft-capped, the dtype's minimum added to the masked ones, softmax in
    fp32 (with sinks, GPT-OSS's: one more column per head, the row max taken out, the softmax in the scores' dtype,
    the sink dropped after), dropout, then ``P @ V`` in the values' dtype. A query
    that sees no key gets eager's answer: without sinks a uniform softmax, the mean of every value.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: ``[B, Hkv, S, D]`` / ``[B, Hkv, S, Dv]``; any float dtype.
        mask: bool ``[B or 1, Lq, S]`` (True = visible) or None (causal, bottom-right).
        softcap: the scores' soft cap or None. sinks: ``[Hq]`` sink logits (GPT-OSS's ``module.sinks``) or None.
    Returns:
        ``[B, Lq, Hq, Dv]`` contiguous, in ``value.dtype``.
    """
    B, Hq, Lq, _ = query.shape
    groups = Hq // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = mask if mask is not None else _causal(Lq, key.shape[2], query.device)
    # Added, as eager adds its mask: a query that sees no key then passes gradients to every score, as eager's does.
    additive = torch.zeros(visible.shape, dtype=scores.dtype, device=scores.device)
    scores = scores + additive.masked_fill_(~visible, torch.finfo(scores.dtype).min)[:, None]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # (GPT-OSS's own order: the row max taken out, the softmax in the scores' dtype, the sink dropped)
        sink = sinks.to(scores.dtype).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=training).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


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
