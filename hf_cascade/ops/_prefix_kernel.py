"""Triton kernels for the shared-prefix pass. Imported only when Triton runs.

Work decomposition (built on the host by ``PrefixPlan``):
  * rows of one node are gathered by index (``rows``, sorted by node; ``node_row_start`` [N+1]);
  * the query rows of node n, heads of one KV head's group and positions are folded into one
    M axis, ``m = ((r_local * Lq) + q) * G + group`` with ``M_n = rows_n * Lq * G``;
  * ``tile_node`` / ``tile_m0`` list the BLOCK_M tiles of every node;
  * grid = (tiles, Hkv, kv_splits): every split reads a contiguous chunk of its node's keys once
    for the whole tile (the prefix is stored once and read once per tile, never per row).
With more than one split each program writes a normalised partial (out, lse) in tile order and
``_prefix_combine_kernel`` reduces the splits (flash-decoding).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in base 2 inside the loop
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): back to natural-log LSE on the way out


@triton.jit
def _tile_rows(rows_ptr, node_row_start_ptr, tile_node_ptr, tile_m0_ptr, tile, Lq, G,
               BLOCK_M: tl.constexpr):
    """Decode one tile's M axis into (batch row, q head offset in group, q position, valid)."""
    node = tl.load(tile_node_ptr + tile)
    m = tl.load(tile_m0_ptr + tile) + tl.arange(0, BLOCK_M)
    r_start = tl.load(node_row_start_ptr + node)
    n_rows = tl.load(node_row_start_ptr + node + 1) - r_start
    valid = m < n_rows * Lq * G
    group = m % G
    pos = (m // G) % Lq
    r_local = m // (G * Lq)
    row = tl.load(rows_ptr + r_start + r_local, mask=valid, other=0).to(tl.int64)
    return node, row, group, pos, valid


@triton.jit
def _prefix_fwd_kernel(
    q_ptr, k_ptr, v_ptr,
    out_ptr, lse_ptr,  # final [B, Hq, Lq, D] fp32 / [B, Hq, Lq] fp32 (NUM_SPLITS == 1)
    part_out_ptr, part_lse_ptr,  # partials [splits, Hkv, tiles*BLOCK_M, D] / [..., tiles*BLOCK_M]
    rows_ptr, node_row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr,
    Lq, G, D, num_splits,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ol,
    stride_lb, stride_lh, stride_ll,
    stride_ps, stride_ph, stride_pm,
    stride_pls, stride_plh,
    HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    node, row, group, pos, valid = _tile_rows(
        rows_ptr, node_row_start_ptr, tile_node_ptr, tile_m0_ptr, tile, Lq, G, BLOCK_M)
    head = kvh * G + group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    # Gather the tile's queries: rows of a node need not be contiguous in the batch.
    q_off = row * stride_qb + head.to(tl.int64) * stride_qh + pos.to(tl.int64) * stride_ql
    q = tl.load(q_ptr + q_off[:, None] + d[None, :] * stride_qd,
                mask=valid[:, None] & d_ok[None, :], other=0.0)

    # This split's chunk of the node's keys (chunk rounded to BLOCK_N; trailing splits may be empty).
    k_start = tl.load(node_starts_ptr + node)
    k_end = tl.load(node_starts_ptr + node + 1)
    chunk = tl.cdiv(tl.cdiv(k_end - k_start, num_splits), BLOCK_N) * BLOCK_N
    lo = k_start + split * chunk
    hi = tl.minimum(k_end, lo + chunk)

    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kt = tl.load(k_base + n[None, :].to(tl.int64) * stride_kt + d[:, None] * stride_kd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        # Scores in base 2: s2 = log2(e) * (softcapped) scale * q.k
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION)
        if HAS_SOFTCAP:
            x = s * (sm_scale / softcap)
            s = (softcap * LOG2E) * (2.0 * tl.sigmoid(2.0 * x) - 1.0)  # tanh(x), Triton-3.6 safe
        else:
            s = s * (sm_scale * LOG2E)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        # Online softmax (every block has >= 1 valid key, so m_new is finite).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vt + d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # Normalise; an empty key range leaves l_i == 0: out 0, lse -inf.
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    if SPLIT:
        mt = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        po = (part_out_ptr + split.to(tl.int64) * stride_ps + kvh.to(tl.int64) * stride_ph
              + mt[:, None].to(tl.int64) * stride_pm + d[None, :])
        tl.store(po, o, mask=valid[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + split.to(tl.int64) * stride_pls + kvh * stride_plh + mt, lse,
                 mask=valid)
    else:
        o_off = row * stride_ob + head.to(tl.int64) * stride_oh + pos.to(tl.int64) * stride_ol
        tl.store(out_ptr + o_off[:, None] + d[None, :], o, mask=valid[:, None] & d_ok[None, :])
        l_off = row * stride_lb + head.to(tl.int64) * stride_lh + pos.to(tl.int64) * stride_ll
        tl.store(lse_ptr + l_off, lse, mask=valid)


@triton.jit
def _prefix_combine_kernel(
    out_ptr, lse_ptr,  # final [B, Hq, Lq, D] fp32 / [B, Hq, Lq] fp32
    part_out_ptr, part_lse_ptr,  # [splits, Hkv, tiles*BLOCK_M, D] / [splits, Hkv, tiles*BLOCK_M]
    rows_ptr, node_row_start_ptr, tile_node_ptr, tile_m0_ptr,
    Lq, G, D, num_splits,
    stride_ob, stride_oh, stride_ol,
    stride_lb, stride_lh, stride_ll,
    stride_ps, stride_ph, stride_pm,
    stride_pls, stride_plh,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    node, row, group, pos, valid = _tile_rows(
        rows_ptr, node_row_start_ptr, tile_node_ptr, tile_m0_ptr, tile, Lq, G, BLOCK_M)
    head = kvh * G + group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    mt = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pl_base = part_lse_ptr + kvh * stride_plh + mt
    po_base = part_out_ptr + kvh.to(tl.int64) * stride_ph + mt[:, None] * stride_pm + d[None, :]

    # Pass 1: the largest split LSE (-inf when every split was empty).
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(pl_base + s * stride_pls, mask=valid, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: LSE-weighted sum of the normalised partial outputs.
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, num_splits):
        w = tl.exp(tl.load(pl_base + s * stride_pls, mask=valid, other=float("-inf")) - m)
        o = tl.load(po_base + s * stride_ps, mask=(valid & (w > 0))[:, None] & d_ok[None, :],
                    other=0.0)
        acc += o * w[:, None]
        total += w
    has_keys = total > 0
    total = tl.where(has_keys, total, 1.0)
    o = acc / total[:, None]
    lse = tl.where(has_keys, m + tl.log(total), float("-inf"))
    o_off = row * stride_ob + head.to(tl.int64) * stride_oh + pos.to(tl.int64) * stride_ol
    tl.store(out_ptr + o_off[:, None] + d[None, :], o, mask=valid[:, None] & d_ok[None, :])
    l_off = row * stride_lb + head.to(tl.int64) * stride_lh + pos.to(tl.int64) * stride_ll
    tl.store(lse_ptr + l_off, lse, mask=valid)
