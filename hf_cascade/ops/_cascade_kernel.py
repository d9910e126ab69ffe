"""Triton kernel running one prefix level's pass and the suffix pass side by side (one launch).

Programs ``[0, n_prefix)`` are the shared-prefix programs (``_prefix_kernel._prefix_tile``: tile
fastest, then KV head, then KV split); programs ``[n_prefix, n_prefix + B * Hkv * s_mtiles)`` are
the suffix programs (``_suffix_kernel._suffix_tile``), which write their normalised state to slot
``suffix_slot`` of the same fp32 state buffer [slots, Hkv, B*Lq*G, D]. Every slot is then merged into
the output: by ``_state_combine_kernel`` (a second launch), or with ``MERGE`` by this launch itself,
the last program to write an entry's state merging it (:func:`_arrive_and_merge`). Why one launch: at decode the prefix programs are tensor-core bound for
large B * G while the suffix programs only stream per-row KV; sized to fit two programs per SM,
the prefix programs (launched first, about one per SM) overlap with the suffix programs instead
of running one kernel after the other.
"""

import triton
import triton.language as tl

from ._prefix_kernel import _merge_states, _prefix_tile
from ._suffix_kernel import _suffix_tile
from ._backend import share_compiler_kernel_cache

share_compiler_kernel_cache()  # before the first kernel is built


@triton.jit
def _arrive_and_merge(cnt_ptr, kvh, m_idx, valid, arrivals, M_total, num_slots,
                      part_out_ptr, part_lse_ptr, stride_ps, stride_ph, stride_pls, stride_plh,
                      out_ptr, lse_ptr, o_off, l_off, D,
                      EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Count this program's states in and merge the entries whose last state it wrote.

    ``m_idx`` [BLOCK]: the state entries (``m = (b * Lq + q) * G + group``) this program wrote, ``valid`` which are
    real; ``cnt_ptr``: int32 [Hkv, M_total] arrival counters, zero before the launch. Each entry receives
    ``arrivals`` states in this launch (one per KV split of the fused level, one from the suffix); the program whose
    arrival is the last one merges all ``num_slots`` slots of that entry (earlier levels' slots were written by
    launches before this one) into ``out`` / ``lse`` at ``o_off`` / ``l_off`` and sets its counter back to zero, so
    the buffer is ready for the next launch with no memset. Ordering: the barrier puts every thread's state stores
    before the release of the counter increment; the last arriver's acquire and barrier put the other programs'
    stores before its loads, which read L2 (".cg": another program of this launch may have left a stale line in
    this SM's L1).
    """
    tl.debug_barrier()
    c_ptrs = cnt_ptr + kvh.to(tl.int64) * M_total + m_idx
    old = tl.atomic_add(c_ptrs, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (old == arrivals - 1)
    if tl.max(last.to(tl.int32), 0) > 0:
        tl.debug_barrier()
        tl.store(c_ptrs, 0, mask=last)
        d = tl.arange(0, BLOCK_D)
        if EVEN_D:
            o_mask = last[:, None]
        else:
            o_mask = last[:, None] & (d[None, :] < D)
        o, lse = _merge_states(part_out_ptr + kvh.to(tl.int64) * stride_ph + m_idx[:, None] * D + d[None, :],
                               part_lse_ptr + kvh.to(tl.int64) * stride_plh + m_idx,
                               stride_ps, stride_pls, num_slots, last, o_mask, 2, ".cg")
        tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + l_off, lse, mask=last)


# Sizes that differ between batch layouts are not specialised: Triton would build a variant per pattern of
# them (== 1, divisible by 16), several per new sharing tree (seconds each, in a stream of layouts).
@triton.jit(do_not_specialize=["S", "num_splits", "slot0", "suffix_slot", "n_prefix", "tiles", "s_mtiles",
                               "stride_mb", "stride_mq", "M_total", "num_slots"])
def _cascade_fwd_kernel(
    q_ptr,
    pk_ptr, pv_ptr,  # prefix level KV [Hkv, T, D]
    rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr,  # its schedule
    sk_ptr, sv_ptr, mask_ptr, key_len_ptr,  # suffix KV [B, Hkv, S, D], bool mask as uint8 (MASK_MODE 2), written
    so_ptr, sl_ptr,  # fp32 state slots [slots, Hkv, B*Lq*G, D] / [slots, Hkv, B*Lq*G]
    Lq, S, G, D, Hkv, num_splits, slot0, suffix_slot, n_prefix, tiles, s_mtiles,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_pkh, stride_pkt, stride_pvh, stride_pvt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ms,
    o_s, o_b, o_kvh, o_g, o_l,
    l_s, l_b, l_kvh, l_g, l_l,
    out_ptr, lse_ptr, cnt_ptr,  # MERGE: final [B, Hq, Lq, D] / [B, Hq, Lq] fp32, int32 counters [Hkv, M_total]
    M_total, num_slots,
    stride_ob, stride_oh, stride_ol,
    stride_lb, stride_lh, stride_ll,
    MASK_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,  # key_len_ptr: int64 count of written suffix keys (the rest are never visible)
    EVEN_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_MP: tl.constexpr,  # prefix tile rows
    BLOCK_MS: tl.constexpr,  # suffix tile rows
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE: tl.constexpr,  # the last program to write an entry's state merges every slot (no combine launch)
    SUFFIX_FIRST: tl.constexpr = False,  # tests: the suffix programs take the lowest ids (the interpreter runs
    # programs in id order, so the prefix programs then arrive last and merge)
):
    pid = tl.program_id(0)
    if SUFFIX_FIRST:
        pid = (pid + n_prefix) % tl.num_programs(0)
    if pid < n_prefix:
        rest = pid // tiles
        kvh = rest % Hkv
        row, group, pos, valid = _prefix_tile(q_ptr, pk_ptr, pv_ptr, so_ptr, sl_ptr,
                     rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr,
                     pid % tiles, kvh, rest // Hkv,
                     Lq, G, D, num_splits, slot0, sm_scale, softcap,
                     stride_qb, stride_qh, stride_ql, stride_qd, stride_pkh, stride_pkt, stride_pvh, stride_pvt,
                     o_s, o_b, o_kvh, o_g, o_l, l_s, l_b, l_kvh, l_g, l_l,
                     HAS_SOFTCAP, EVEN_D, INPUT_PRECISION, BLOCK_MP, BLOCK_N, BLOCK_D)
        if MERGE:
            pos64 = pos.to(tl.int64)
            head = (kvh * G + group).to(tl.int64)
            _arrive_and_merge(cnt_ptr, kvh, (row * Lq + pos64) * G + group, valid, num_splits + 1, M_total,
                              num_slots, so_ptr, sl_ptr, o_s, o_kvh, l_s, l_kvh, out_ptr, lse_ptr,
                              row * stride_ob + head * stride_oh + pos64 * stride_ol,
                              row * stride_lb + head * stride_lh + pos64 * stride_ll, D, EVEN_D, BLOCK_D)
    else:
        sp = pid - n_prefix
        rest = sp // s_mtiles
        kvh = rest % Hkv
        b = (rest // Hkv).to(tl.int64)
        slot = tl.zeros([], dtype=tl.int64) + suffix_slot  # int64 even when suffix_slot is specialised to 1
        m, valid = _suffix_tile(q_ptr, sk_ptr, sv_ptr, mask_ptr, key_len_ptr, so_ptr, sl_ptr,
                     so_ptr + slot * o_s, sl_ptr + slot * l_s,
                     sp % s_mtiles, kvh, b,
                     Lq, S, G, D, 0, sm_scale, softcap,
                     stride_qb, stride_qh, stride_ql, stride_qd,
                     stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     stride_mb, stride_mq, stride_ms,
                     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # no prefix states to seed
                     o_b, o_kvh, o_g, o_l, 1, l_b, l_kvh, l_g, l_l,
                     MASK_MODE, HAS_SOFTCAP, False, HAS_KEY_LEN, EVEN_D, INPUT_PRECISION, BLOCK_MS, BLOCK_N,
                     BLOCK_D)
        if MERGE:
            pos64 = (m // G).to(tl.int64)
            group = m % G
            head = (kvh * G + group).to(tl.int64)
            _arrive_and_merge(cnt_ptr, kvh, b * Lq * G + m, valid, num_splits + 1, M_total, num_slots,
                              so_ptr, sl_ptr, o_s, o_kvh, l_s, l_kvh, out_ptr, lse_ptr,
                              b * stride_ob + head * stride_oh + pos64 * stride_ol,
                              b * stride_lb + head * stride_lh + pos64 * stride_ll, D, EVEN_D, BLOCK_D)
