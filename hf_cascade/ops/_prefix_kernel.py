"""Triton kernels for the shared-prefix pass. Imported only when Triton runs.

Work decomposition (built once on the host by ``PrefixPlan.schedule``):
  * the rows of one node are gathered by index (``rows``: covered rows sorted by node, then the rows
    without keys at this level as a last pseudo-node with an empty key range; ``row_start`` [N+2]);
  * the query rows of node n, the G query heads of one KV head and the Lq positions are folded into
    one M axis, ``m = (r_local * Lq + q) * G + group`` with ``M_n = rows_n * Lq * G``, so one
    ``tl.dot`` multiplies every query of the node that reads a KV tile (tensor cores, M large);
  * ``tile_node`` / ``tile_m0`` list the BLOCK_M tiles of every node (pseudo-node included);
  * programs = (tile, KV head, kv split), tile fastest: the M tiles of one (KV head, split) run side
    by side, so a KV tile comes from HBM once and from L2 for the other M tiles.
Every program writes a normalised state (out, natural-log lse) for its rows and split slot; the
pseudo-node's programs read no keys and write out 0 / lse -inf, so every output element is written
and the wrapper needs no zero-fill launch. Outputs are addressed as
``o + slot*o_s + row*o_b + kvh*o_kvh + group*o_g + q*o_l + d`` (same for lse without d): the final
[B, Hq, Lq, DV] tensor when there is one split, else fp32 partials [slots, Hkv, B*Lq*G, DV] in batch
row order, reduced by ``_state_combine_kernel`` or by the suffix kernel's prologue (flash-decoding).
"""

import triton
import triton.language as tl

from ._backend import before_first_kernel
from ._jit import jit_options, settle_cache_keys

before_first_kernel()  # the kernel cache shared, Triton's key ready: before the first kernel is built

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in base 2 inside the loop
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): back to natural-log LSE on the way out


@triton.jit
def _prefix_block(q, k_ptrs, v_ptrs, start, hi, m_i, l_i, acc, qk_scale, sm_scale, softcap,
                  stride_kt, stride_vt, D, DV,
                  MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    """One KV block of the online softmax; MASKED only for the last, partial block of a node. Keys are D wide,
    values DV wide (MLA-style K/V head sizes may differ)."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n_ok = start + offs_n < hi
    if EVEN_D:
        if MASKED:
            k = tl.load(k_ptrs + start * stride_kt, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + start * stride_kt)
    else:
        k = tl.load(k_ptrs + start * stride_kt, mask=n_ok[:, None] & (d[None, :] < D), other=0.0)
    if EVEN_DV:
        if MASKED:
            v = tl.load(v_ptrs + start * stride_vt, mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs + start * stride_vt)
    else:
        v = tl.load(v_ptrs + start * stride_vt, mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if HAS_SOFTCAP:
        x = qk * (sm_scale / softcap)
        qk = (softcap * LOG2E) * (2.0 * tl.sigmoid(2.0 * x) - 1.0)  # tanh(x), Triton-3.6 safe
        scale = 1.0
    else:
        scale = qk_scale  # log2(e) * scale, folded into the exp2 argument (one FMA)
    if MASKED:
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
    # Online softmax in base 2 (every block has >= 1 valid key, so m_new is finite).
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    p = tl.exp2(qk * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefix_block_bounded(q, k_ptrs, v_ptrs, start, hi, bound, m_i, l_i, acc, qk_scale, sm_scale, softcap,
                          stride_kt, stride_vt, D, DV,
                          HAS_SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
    """:func:`_prefix_block` where query row m sees only the key columns >= ``bound[m]`` (sliding windows, chunks):
    a row may see nothing in a block, so its running max may stay -inf (shift 0 then)."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n_ok = n < hi
    if EVEN_D:
        k = tl.load(k_ptrs + start * stride_kt, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start * stride_kt, mask=n_ok[:, None] & (d[None, :] < D), other=0.0)
    if EVEN_DV:
        v = tl.load(v_ptrs + start * stride_vt, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs + start * stride_vt, mask=n_ok[:, None] & (dv[None, :] < DV), other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if HAS_SOFTCAP:
        x = qk * (sm_scale / softcap)
        qk = (softcap * LOG2E) * (2.0 * tl.sigmoid(2.0 * x) - 1.0)  # tanh(x), Triton-3.6 safe
    else:
        qk = qk * qk_scale
    qk = tl.where(n_ok[None, :] & (n[None, :] >= bound[:, None]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefix_tile(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,
    rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr, lower_ptr,
    tile, kvh, split,
    Lq, G, D, DV, num_splits, slot0,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kt,
    stride_vh, stride_vt,
    lw_b, lw_l,
    o_s, o_b, o_kvh, o_g, o_l,
    l_s, l_b, l_kvh, l_g, l_l,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program of the prefix pass: BLOCK_M folded query rows of one node x one KV split. ``HAS_LOWER``: query
    (row, q) sees only the level's key columns from ``lower[row, q]`` (int64) on (sliding windows, chunks)."""
    # Decode this tile's M axis into (batch row, group, position).
    node = tl.load(tile_node_ptr + tile)
    m = tl.load(tile_m0_ptr + tile) + tl.arange(0, BLOCK_M)
    r_start = tl.load(row_start_ptr + node)
    n_rows = tl.load(row_start_ptr + node + 1) - r_start
    valid = m < n_rows * Lq * G
    group = m % G
    pos = (m // G) % Lq
    row = tl.load(rows_ptr + r_start + m // (G * Lq), mask=valid, other=0).to(tl.int64)
    head = (kvh * G + group).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    if EVEN_D:
        q_mask = valid[:, None]
    else:
        q_mask = valid[:, None] & (d[None, :] < D)
    if EVEN_DV:
        o_mask = valid[:, None]
    else:
        o_mask = valid[:, None] & (dv[None, :] < DV)

    # Gather the tile's queries: the rows of a node need not be contiguous in the batch.
    q = tl.load(q_ptr + (row * stride_qb + head * stride_qh + pos.to(tl.int64) * stride_ql)[:, None]
                + d[None, :] * stride_qd, mask=q_mask, other=0.0)

    # This split's chunk of the node's keys (rounded to BLOCK_N; trailing splits may be empty).
    k_start = tl.load(node_starts_ptr + node)
    k_end = tl.load(node_starts_ptr + node + 1)
    chunk = tl.cdiv(tl.cdiv(k_end - k_start, num_splits), BLOCK_N) * BLOCK_N
    lo = k_start + split * chunk
    hi = tl.minimum(k_end, lo + chunk)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # end of the unmasked blocks

    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + kvh.to(tl.int64) * stride_kh + (offs_n * stride_kt)[:, None] + d[None, :]
    v_ptrs = v_ptr + kvh.to(tl.int64) * stride_vh + (offs_n * stride_vt)[:, None] + dv[None, :]
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_LOWER:
        bound = tl.load(lower_ptr + row * lw_b + pos.to(tl.int64) * lw_l, mask=valid, other=0)
        first = tl.maximum(lo, tl.min(tl.where(valid, bound, hi), 0))  # blocks below every row's bound: skipped
        # From the tile's largest bound on every row sees every key: the bounded (masked) blocks stop at the block
        # holding it, the rest run as the unbounded kernel's (no bound mask, unmasked loads but the last block).
        top = tl.max(tl.where(valid, bound, lo), 0)
        mid = tl.minimum(hi, first + tl.cdiv(tl.maximum(top - first, 0), BLOCK_N) * BLOCK_N)
        for start in range(first, mid, BLOCK_N):
            m_i, l_i, acc = _prefix_block_bounded(q, k_ptrs, v_ptrs, start, hi, bound, m_i, l_i, acc, qk_scale,
                                                  sm_scale, softcap, stride_kt, stride_vt, D, DV, HAS_SOFTCAP,
                                                  EVEN_D, EVEN_DV, INPUT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
        mid = tl.maximum(mid, first)  # (first > hi: nothing at all)
        free_hi = mid + tl.maximum(hi - mid, 0) // BLOCK_N * BLOCK_N
        for start in range(mid, free_hi, BLOCK_N):
            m_i, l_i, acc = _prefix_block(q, k_ptrs, v_ptrs, start, hi, m_i, l_i, acc, qk_scale, sm_scale, softcap,
                                          stride_kt, stride_vt, D, DV, False, HAS_SOFTCAP, EVEN_D, EVEN_DV,
                                          INPUT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
        if free_hi < hi:  # the last, partial block
            m_i, l_i, acc = _prefix_block(q, k_ptrs, v_ptrs, free_hi, hi, m_i, l_i, acc, qk_scale, sm_scale,
                                          softcap, stride_kt, stride_vt, D, DV, True, HAS_SOFTCAP, EVEN_D, EVEN_DV,
                                          INPUT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        for start in range(lo, full_hi, BLOCK_N):
            m_i, l_i, acc = _prefix_block(q, k_ptrs, v_ptrs, start, hi, m_i, l_i, acc, qk_scale, sm_scale, softcap,
                                          stride_kt, stride_vt, D, DV, False, HAS_SOFTCAP, EVEN_D, EVEN_DV,
                                          INPUT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)
        if full_hi < hi:  # the node's last, partial block
            m_i, l_i, acc = _prefix_block(q, k_ptrs, v_ptrs, full_hi, hi, m_i, l_i, acc, qk_scale, sm_scale,
                                          softcap, stride_kt, stride_vt, D, DV, True, HAS_SOFTCAP, EVEN_D, EVEN_DV,
                                          INPUT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV)

    # Normalise; an empty key range leaves l_i == 0: out 0, lse -inf.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    slot = (slot0 + split).to(tl.int64)
    o_off = slot * o_s + row * o_b + kvh.to(tl.int64) * o_kvh + group.to(tl.int64) * o_g + pos.to(tl.int64) * o_l
    tl.store(o_ptr + o_off[:, None] + dv[None, :], o, mask=o_mask)
    l_off = slot * l_s + row * l_b + kvh.to(tl.int64) * l_kvh + group.to(tl.int64) * l_g + pos.to(tl.int64) * l_l
    tl.store(l_ptr + l_off, lse, mask=valid)


# Sizes that differ between batch layouts are not specialised: Triton would build a variant per pattern of
# them (== 1, divisible by 16), several per new sharing tree (seconds each, in a stream of layouts).
@triton.jit(**jit_options(not_specialised=["num_splits", "slot0"], not_aligned=["Lq", "lw_b", "l_s", "l_b", "l_kvh"]))
def _prefix_fwd_kernel(
    q_ptr, k_ptr, v_ptr,
    o_ptr, l_ptr,  # outputs (final or partials, see module docstring), fp32
    rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr,
    lower_ptr,  # int64 [B, Lq]: each query's first visible key column of this level (HAS_LOWER)
    Lq, G, D, DV, num_splits, slot0,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kt,
    stride_vh, stride_vt,
    lw_b, lw_l,
    o_s, o_b, o_kvh, o_g, o_l,
    l_s, l_b, l_kvh, l_g, l_l,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no head_dim mask (queries, keys)
    EVEN_DV: tl.constexpr,  # DV == BLOCK_DV: no mask over the values' head_dim
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid = (tiles, Hkv, kv splits)
    _prefix_tile(q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,
                 rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr, lower_ptr,
                 tl.program_id(0), tl.program_id(1), tl.program_id(2),
                 Lq, G, D, DV, num_splits, slot0, sm_scale, softcap,
                 stride_qb, stride_qh, stride_ql, stride_qd, stride_kh, stride_kt, stride_vh, stride_vt, lw_b, lw_l,
                 o_s, o_b, o_kvh, o_g, o_l, l_s, l_b, l_kvh, l_g, l_l,
                 HAS_SOFTCAP, HAS_LOWER, EVEN_D, EVEN_DV, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)


@triton.jit
def _merge_states(po_ptrs, pl_ptrs, stride_ps, stride_pls, num_slots, valid, o_mask,
                  SLOTS_PER_STEP: tl.constexpr):
    """Exact LSE-weighted merge of ``num_slots`` normalised fp32 states (out, natural-log lse) per entry.

    ``po_ptrs`` [BLOCK_M, BLOCK_D] / ``pl_ptrs`` [BLOCK_M]: the entries' out / lse in slot 0; slot s is
    ``stride_ps`` / ``stride_pls`` elements further. ``valid`` [BLOCK_M] / ``o_mask`` [BLOCK_M, BLOCK_D]
    (may broadcast over BLOCK_D): what to read. An lse of -inf is an empty state (its out is ignored).
    ``SLOTS_PER_STEP`` slots per step, their out loads independent of their lse, all in flight at once: the
    loop is bound by memory latency, not bandwidth.

    Returns (out fp32 [BLOCK_M, BLOCK_D], lse fp32 [BLOCK_M]): out 0 / lse -inf where every state is empty.
    """
    mx = tl.full(pl_ptrs.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(pl_ptrs.shape, dtype=tl.float32)
    acc = tl.zeros(po_ptrs.shape, dtype=tl.float32)
    for first in range(0, num_slots, SLOTS_PER_STEP):
        for j in tl.static_range(SLOTS_PER_STEP):
            s = first + j
            in_range = s + tl.zeros(pl_ptrs.shape, dtype=tl.int32) < num_slots  # a block: the interpreter's masks
            ls = tl.load(pl_ptrs + s * stride_pls, mask=valid & in_range, other=float("-inf"))
            o = tl.load(po_ptrs + s * stride_ps, mask=o_mask & in_range[:, None], other=0.0)
            m_new = tl.maximum(mx, ls)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(mx - m_safe)
            w = tl.exp(ls - m_safe)
            acc = acc * alpha[:, None] + tl.where((w > 0)[:, None], o * w[:, None], 0.0)
            total = total * alpha + w
            mx = m_new
    has_keys = total > 0
    t_safe = tl.where(has_keys, total, 1.0)
    return acc / t_safe[:, None], tl.where(has_keys, mx + tl.log(t_safe), float("-inf"))


@triton.jit(**jit_options(not_specialised=["M_total", "num_slots"],  # layout sizes, see _prefix_fwd_kernel
                          not_aligned=["Lq", "stride_lb", "stride_lh", "stride_pls", "stride_plh"]))
def _state_combine_kernel(
    out_ptr, lse_ptr,  # final [B, Hq, Lq, D] (any float dtype, d stride 1) / [B, Hq, Lq] fp32
    part_out_ptr, part_lse_ptr,  # fp32 [slots, Hkv, B*Lq*G, D] / [slots, Hkv, B*Lq*G], batch-row order
    M_total, Lq, G, D, num_slots,
    stride_ob, stride_oh, stride_ol,
    stride_lb, stride_lh, stride_ll,
    stride_ps, stride_ph, stride_pls, stride_plh,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS_PER_STEP: tl.constexpr,
):
    """Exact LSE-weighted merge of every slot's normalised state (KV splits, levels, the suffix)."""
    kvh = tl.program_id(1)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # m = (b * Lq + q) * G + group
    valid = m < M_total
    group = m % G
    pos = (m // G) % Lq
    row = (m // (G * Lq)).to(tl.int64)
    head = (kvh * G + group).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        o_mask = valid[:, None]
    else:
        o_mask = valid[:, None] & (d[None, :] < D)
    m64 = m.to(tl.int64)
    o, lse = _merge_states(part_out_ptr + kvh.to(tl.int64) * stride_ph + m64[:, None] * D + d[None, :],
                           part_lse_ptr + kvh.to(tl.int64) * stride_plh + m64,
                           stride_ps, stride_pls, num_slots, valid, o_mask, SLOTS_PER_STEP)
    o_off = row * stride_ob + head * stride_oh + pos.to(tl.int64) * stride_ol
    tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    l_off = row * stride_lb + head * stride_lh + pos.to(tl.int64) * stride_ll
    tl.store(lse_ptr + l_off, lse, mask=valid)


settle_cache_keys(globals())  # the same keys in every process, whichever kernel it launches first
