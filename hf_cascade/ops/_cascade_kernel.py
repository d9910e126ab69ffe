"""Triton kernel running one prefix level's pass and the suffix pass side by side (one launch).

Programs ``[0, n_prefix)`` are the shared-prefix programs (``_prefix_kernel._prefix_tile``: tile
fastest, then KV head, then KV split); programs ``[n_prefix, n_prefix + B * Hkv * s_mtiles)`` are
the suffix programs (``_suffix_kernel._suffix_tile``), which write their normalised state to slot
``suffix_slot`` of the same fp32 state buffer [slots, Hkv, B*Lq*G, D]. ``_state_combine_kernel``
then merges every slot. Why one launch: at decode the prefix programs are tensor-core bound for
large B * G while the suffix programs only stream per-row KV; sized to fit two programs per SM,
the prefix programs (launched first, about one per SM) overlap with the suffix programs instead
of running one kernel after the other.
"""

import triton
import triton.language as tl

from ._jit import jit_options, settle_cache_keys
from ._prefix_kernel import _prefix_tile
from ._suffix_kernel import _suffix_tile
from ._backend import before_first_kernel

before_first_kernel()  # the kernel cache shared, Triton's key ready: before the first kernel is built


# Sizes that differ between batch layouts are not specialised: Triton would build a variant per pattern of
# them (== 1, divisible by 16), several per new sharing tree (seconds each, in a stream of layouts).
@triton.jit(**jit_options(not_specialised=["S", "num_splits", "slot0", "suffix_slot", "n_prefix", "tiles", "s_mtiles",
                                            "stride_mb", "stride_mq"],
                          not_aligned=["Lq", "plw_b", "slw_b", "l_s", "l_b", "l_kvh"]))
def _cascade_fwd_kernel(
    q_ptr,
    pk_ptr, pv_ptr,  # prefix level KV [Hkv, T, D]
    rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr,  # its schedule
    plower_ptr, slower_ptr,  # int64 [B, Lq]: first visible column of the level / of the suffix (HAS_LOWER)
    sk_ptr, sv_ptr, mask_ptr, key_len_ptr,  # suffix KV [B, Hkv, S, D], bool mask as uint8 (MASK_MODE 2), written
    so_ptr, sl_ptr,  # fp32 state slots [slots, Hkv, B*Lq*G, D] / [slots, Hkv, B*Lq*G]
    Lq, S, G, D, DV, Hkv, num_splits, slot0, suffix_slot, n_prefix, tiles, s_mtiles,
    sm_scale, softcap,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_pkh, stride_pkt, stride_pvh, stride_pvt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ms,
    plw_b, plw_l, slw_b, slw_l,
    o_s, o_b, o_kvh, o_g, o_l,
    l_s, l_b, l_kvh, l_g, l_l,
    MASK_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,  # key_len_ptr: int64 count of written suffix keys (the rest are never visible)
    HAS_LOWER: tl.constexpr,  # per-query lower bounds on the visible key columns (sliding windows, chunks)
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_MP: tl.constexpr,  # prefix tile rows
    BLOCK_MS: tl.constexpr,  # suffix tile rows
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,  # the values' head_dim, padded (DV: K/V head sizes may differ)
):
    pid = tl.program_id(0)
    if pid < n_prefix:
        rest = pid // tiles
        _prefix_tile(q_ptr, pk_ptr, pv_ptr, so_ptr, sl_ptr,
                     rows_ptr, row_start_ptr, node_starts_ptr, tile_node_ptr, tile_m0_ptr, plower_ptr,
                     pid % tiles, rest % Hkv, rest // Hkv,
                     Lq, G, D, DV, num_splits, slot0, sm_scale, softcap,
                     stride_qb, stride_qh, stride_ql, stride_qd, stride_pkh, stride_pkt, stride_pvh, stride_pvt,
                     plw_b, plw_l,
                     o_s, o_b, o_kvh, o_g, o_l, l_s, l_b, l_kvh, l_g, l_l,
                     HAS_SOFTCAP, HAS_LOWER, EVEN_D, EVEN_DV, INPUT_PRECISION, BLOCK_MP, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        sp = pid - n_prefix
        rest = sp // s_mtiles
        slot = tl.zeros([], dtype=tl.int64) + suffix_slot  # int64 even when suffix_slot is specialised to 1
        _suffix_tile(q_ptr, sk_ptr, sv_ptr, mask_ptr, key_len_ptr, slower_ptr, so_ptr, sl_ptr,
                     so_ptr + slot * o_s, sl_ptr + slot * l_s,
                     sp % s_mtiles, rest % Hkv, rest // Hkv,
                     Lq, S, G, D, DV, 0, sm_scale, softcap,
                     stride_qb, stride_qh, stride_ql, stride_qd,
                     stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     stride_mb, stride_mq, stride_ms, slw_b, slw_l,
                     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # no prefix states to seed
                     o_b, o_kvh, o_g, o_l, 1, l_b, l_kvh, l_g, l_l,
                     MASK_MODE, HAS_SOFTCAP, False, HAS_KEY_LEN, HAS_LOWER, EVEN_D, EVEN_DV, INPUT_PRECISION, BLOCK_MS, BLOCK_N,
                     BLOCK_D, BLOCK_DV)


settle_cache_keys(globals())  # the same keys in every process, whichever kernel it launches first
