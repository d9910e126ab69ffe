"""Triton kernel for the per-row suffix pass, with the prefix merge fused into its prologue.

Programs = (M tiles, Hkv, B). For one batch row and KV head, the query positions and the G query
heads sharing that KV head are folded into one M axis, ``m = q * G + group`` (M = Lq * G), so a
KV block is loaded once for the whole group (no repeat_kv). Consecutive m share a position, so a
tile covers a contiguous position range and the causal bound is tight.

Prefix states (``NUM_PREFIX`` > 0 of them: a merged prefix state, or the un-combined split
partials of the shared-prefix kernel) seed the online softmax: a normalised state (o, lse) is the
running state (m = lse, l = 1, acc = o). So the split combine and the prefix/suffix merge cost no
launch of their own and no fp32 round trip through memory. State s of query (b, head, q) lives at
``p + s*p_s + b*p_b + kvh*p_kvh + group*p_g + q*p_l + d*p_d``.
"""

import triton
import triton.language as tl

from ._backend import before_first_kernel
from ._jit import jit_options, settle_cache_keys

before_first_kernel()  # the kernel cache shared, Triton's key ready: before the first kernel is built

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

MASK_FULL = tl.constexpr(0)  # every query sees every key
MASK_CAUSAL = tl.constexpr(1)  # bottom-right aligned: query i sees key j iff j <= S - Lq + i
MASK_TENSOR = tl.constexpr(2)  # bool mask [B, Lq, S] (read as uint8), True = attend


@triton.jit
def _suffix_tile(
    q_ptr, k_ptr, v_ptr, mask_ptr, key_len_ptr, lower_ptr,
    po_ptr, pl_ptr,  # prefix states, fp32 (see module docstring); unused when HAS_PREFIX is False
    out_ptr, lse_ptr,  # output state (query dtype or fp32) / lse (fp32), already offset to its slot
    pid_m, kvh, b,
    Lq, S, G, D, DV, num_prefix,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ms,
    lw_b, lw_l,  # strides of the lower bounds [B, Lq] (HAS_LOWER)
    po_s, po_b, po_kvh, po_g, po_l, po_d,
    pl_s, pl_b, pl_kvh, pl_g, pl_l,
    o_b, o_kvh, o_g, o_l, o_d,  # output strides of (b, kvh, group, q, d)
    ls_b, ls_kvh, ls_g, ls_l,
    MASK_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program of the suffix pass: BLOCK_M folded (position, group) rows of batch row b, KV head kvh.
    ``HAS_KEY_LEN``: the keys from ``*key_len_ptr`` (int64) on are unwritten (invisible): the loop stops there.
    ``HAS_LOWER``: query (b, q) sees only the keys from column ``lower[b, q]`` (int64; sliding windows, chunks) on:
    the loop starts at the tile's smallest bound."""
    b = b.to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = m < Lq * G
    pos = m // G
    group = m % G
    head = (kvh * G + group).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    if EVEN_D:
        q_ok = valid[:, None]
    else:
        q_ok = valid[:, None] & (d[None, :] < D)
    if EVEN_DV:
        tile_ok = valid[:, None]
    else:
        tile_ok = valid[:, None] & (dv[None, :] < DV)

    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_ql
                + d[None, :] * stride_qd, mask=q_ok, other=0.0)

    # Running state in base 2, seeded with the prefix states (split combine + merge, fused).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_PREFIX:
        kvh64 = kvh.to(tl.int64)
        pl_base = pl_ptr + b * pl_b + kvh64 * pl_kvh + group * pl_g + pos * pl_l
        po_base = (po_ptr + b * po_b + kvh64 * po_kvh + (group * po_g + pos * po_l)[:, None]
                   + dv[None, :] * po_d)
        for slot in range(0, num_prefix):
            ls = tl.load(pl_base + slot * pl_s, mask=valid, other=float("-inf"))
            # Empty guard: +inf (FlashAttention-2's empty rows) and NaN mean "no keys".
            ls = tl.where((ls == float("inf")) | (ls != ls), float("-inf"), ls) * LOG2E
            m_new = tl.maximum(m_i, ls)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            w = tl.exp2(ls - m_safe)
            # An empty state's out may be NaN garbage: load it only where its weight is nonzero.
            o = tl.load(po_base + slot * po_s, mask=tile_ok & (w > 0)[:, None], other=0.0)
            acc = acc * alpha[:, None] + o * w[:, None]
            l_i = l_i * alpha + w
            m_i = m_new

    # Keys this tile can see: causal stops after the last visible key of its last position.
    hi = S
    if MASK_MODE == 1:
        last_pos = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Lq * G - 1) // G
        hi = tl.maximum(tl.minimum(S, S - Lq + last_pos + 1), 0)
    if HAS_KEY_LEN:
        written = tl.load(key_len_ptr).to(tl.int32)
        hi = tl.minimum(hi, written)

    lo = 0
    if HAS_LOWER:
        bound = tl.load(lower_ptr + b * lw_b + pos * lw_l, mask=valid, other=0)
        lo = tl.maximum(tl.min(tl.where(valid, bound, S), 0), 0).to(tl.int32) // BLOCK_N * BLOCK_N

    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + b * stride_kb + kvh.to(tl.int64) * stride_kh + (offs_n * stride_ks)[:, None] + d[None, :]
    v_ptrs = v_ptr + b * stride_vb + kvh.to(tl.int64) * stride_vh + (offs_n * stride_vs)[:, None] + dv[None, :]
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < S
        if HAS_KEY_LEN:
            n_ok = n_ok & (n < written)
        if EVEN_D:
            k_mask = n_ok[:, None]
        else:
            k_mask = n_ok[:, None] & (d[None, :] < D)
        if EVEN_DV:
            v_mask = n_ok[:, None]
        else:
            v_mask = n_ok[:, None] & (dv[None, :] < DV)
        k = tl.load(k_ptrs + start * stride_ks, mask=k_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        # Scores in base 2: s2 = log2(e) * (softcapped) scale * q.k
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if HAS_SOFTCAP:
            x = s * (sm_scale / softcap)
            s = (softcap * LOG2E) * (2.0 * tl.sigmoid(2.0 * x) - 1.0)  # tanh(x), Triton-3.6 safe
        else:
            s = s * (sm_scale * LOG2E)
        # Visibility: in range, then causal or the bool mask.
        see = n_ok[None, :] & valid[:, None]
        if MASK_MODE == 1:
            see = see & (n[None, :] <= (S - Lq + pos)[:, None])
        if MASK_MODE == 2:
            mk = tl.load(mask_ptr + b * stride_mb + pos[:, None] * stride_mq + n[None, :] * stride_ms,
                         mask=see, other=0)
            see = see & (mk != 0)
        if HAS_LOWER:
            see = see & (n[None, :] >= bound[:, None])
        s = tl.where(see, s, float("-inf"))
        # Online softmax; a row with nothing visible so far keeps m = -inf (use 0 as its shift).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start * stride_vs, mask=v_mask, other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # No visible key and no prefix: l_i == 0 -> LSE -inf, out 0.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)  # where() evaluates both sides: keep log/div finite
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    o_off = b * o_b + kvh.to(tl.int64) * o_kvh + (group * o_g + pos * o_l).to(tl.int64)
    tl.store(out_ptr + o_off[:, None] + dv[None, :] * o_d, o.to(out_ptr.dtype.element_ty), mask=tile_ok)
    l_off = b * ls_b + kvh.to(tl.int64) * ls_kvh + (group * ls_g + pos * ls_l).to(tl.int64)
    tl.store(lse_ptr + l_off, lse2 * LN2, mask=valid)


# Sizes that differ between batch layouts are not specialised: Triton would build a variant per pattern of
# them (== 1, divisible by 16), several per new sharing tree (seconds each, in a stream of layouts).
@triton.jit(**jit_options(not_specialised=["S", "num_prefix", "stride_mb", "stride_mq"],
                          not_aligned=["Lq", "lw_b", "pl_s", "pl_b", "pl_kvh", "stride_lb", "stride_lh"]))
def _suffix_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, key_len_ptr, lower_ptr,
    po_ptr, pl_ptr,  # prefix states, fp32 (see module docstring); unused when NUM_PREFIX == 0
    out_ptr, lse_ptr,  # [B, Hq, Lq, DV] query dtype / [B, Hq, Lq] fp32
    Lq, S, G, D, DV, num_prefix,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ms,
    lw_b, lw_l,
    po_s, po_b, po_kvh, po_g, po_l, po_d,
    pl_s, pl_b, pl_kvh, pl_g, pl_l,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_lb, stride_lh, stride_ll,
    MASK_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,  # key_len_ptr: int64 count of written keys (the rest are never visible)
    HAS_LOWER: tl.constexpr,  # lower_ptr: int64 [B, Lq], each query's first visible key column
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no head_dim mask (queries, keys)
    EVEN_DV: tl.constexpr,  # DV == BLOCK_DV: no mask over the values' head_dim
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # grid = (M tiles, Hkv, B)
    _suffix_tile(q_ptr, k_ptr, v_ptr, mask_ptr, key_len_ptr, lower_ptr, po_ptr, pl_ptr, out_ptr, lse_ptr,
                 tl.program_id(0), tl.program_id(1), tl.program_id(2),
                 Lq, S, G, D, DV, num_prefix, sm_scale, softcap,
                 stride_qb, stride_qh, stride_ql, stride_qd,
                 stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                 stride_mb, stride_mq, stride_ms, lw_b, lw_l,
                 po_s, po_b, po_kvh, po_g, po_l, po_d, pl_s, pl_b, pl_kvh, pl_g, pl_l,
                 stride_ob, G * stride_oh, stride_oh, stride_ol, stride_od,
                 stride_lb, G * stride_lh, stride_lh, stride_ll,
                 MASK_MODE, HAS_SOFTCAP, HAS_PREFIX, HAS_KEY_LEN, HAS_LOWER, EVEN_D, EVEN_DV, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                 BLOCK_D, BLOCK_DV)


settle_cache_keys(globals())  # the same keys in every process, whichever kernel it launches first
