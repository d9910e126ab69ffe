"""Triton kernel for the per-row suffix pass, with the prefix merge fused into the epilogue.

Grid = (M tiles, Hkv, B). For one batch row and KV head, the query positions and the G query
heads sharing that KV head are folded into one M axis, ``m = q * G + group`` (M = Lq * G), so a
KV block is loaded once for the whole group (no repeat_kv). Consecutive m share a position, so a
tile covers a contiguous position range and the causal bound is tight.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

MASK_FULL = tl.constexpr(0)  # every query sees every key
MASK_CAUSAL = tl.constexpr(1)  # bottom-right aligned: query i sees key j iff j <= S - Lq + i
MASK_TENSOR = tl.constexpr(2)  # bool mask [B, Lq, S] (read as uint8), True = attend


@triton.jit
def _suffix_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr,
    prefix_out_ptr, prefix_lse_ptr,  # fp32 [B, Hq, Lq, D] / [B, Hq, Lq] (HAS_PREFIX)
    out_ptr, lse_ptr,  # [B, Hq, Lq, D] query dtype / [B, Hq, Lq] fp32
    Lq, S, G, D,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_mq, stride_ms,
    stride_pob, stride_poh, stride_pol, stride_pod,
    stride_plb, stride_plh, stride_pll,
    stride_ob, stride_oh, stride_ol, stride_od,
    stride_lb, stride_lh, stride_ll,
    MASK_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = m < Lq * G
    pos = m // G
    head = (kvh * G + m % G).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tile_ok = valid[:, None] & d_ok[None, :]

    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_ql
                + d[None, :] * stride_qd, mask=tile_ok, other=0.0)

    # Keys this tile can see: causal stops after the last visible key of its last position.
    hi = S
    if MASK_MODE == 1:
        last_pos = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Lq * G - 1) // G
        hi = tl.maximum(tl.minimum(S, S - Lq + last_pos + 1), 0)

    k_base = k_ptr + b * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b * stride_vb + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < S
        kt = tl.load(k_base + n[None, :] * stride_ks + d[:, None] * stride_kd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        # Scores in base 2: s2 = log2(e) * (softcapped) scale * q.k
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION)
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
        s = tl.where(see, s, float("-inf"))
        # Online softmax; a row with nothing visible so far keeps m = -inf (use 0 as its shift).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # Suffix state in base 2; no visible key: l_i == 0 -> LSE -inf, out 0.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)  # where() evaluates both sides: keep log/div finite
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    if HAS_PREFIX:
        # Fused exact merge with the prefix state (empty guard: +inf/NaN prefix LSE = no keys).
        pl = tl.load(prefix_lse_ptr + b * stride_plb + head * stride_plh + pos * stride_pll,
                     mask=valid, other=float("-inf"))
        pl = tl.where((pl == float("inf")) | (pl != pl), float("-inf"), pl) * LOG2E
        mm = tl.maximum(lse2, pl)
        mm = tl.where(mm == float("-inf"), 0.0, mm)
        ws = tl.exp2(lse2 - mm)
        wp = tl.exp2(pl - mm)
        total = ws + wp
        nonempty = total > 0
        total = tl.where(nonempty, total, 1.0)
        inv = tl.where(nonempty, 1.0 / total, 0.0)
        po = tl.load(prefix_out_ptr + b * stride_pob + head[:, None] * stride_poh
                     + pos[:, None] * stride_pol + d[None, :] * stride_pod,
                     mask=tile_ok & (wp > 0)[:, None], other=0.0)
        o = o * (ws * inv)[:, None] + po * (wp * inv)[:, None]
        lse2 = tl.where(nonempty, mm + tl.log2(total), float("-inf"))
    tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_ol
             + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + pos * stride_ll, lse2 * LN2, mask=valid)
