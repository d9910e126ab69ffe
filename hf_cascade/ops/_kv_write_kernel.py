"""Triton kernel writing new keys and values into fixed suffix buffers. Imported only when Triton runs."""

import triton
import triton.language as tl

from ._backend import before_first_kernel
from ._jit import settle_cache_keys

before_first_kernel()  # the kernel cache shared, Triton's key ready: before the first kernel is built


@triton.jit(do_not_specialize=["H", "Q"])
def _write_suffix_kv_kernel(
    key_ptr, value_ptr,  # new [B, H, Q, D] / [B, H, Q, DV], any strides (the last stride is 1)
    keys_ptr, values_ptr,  # buffers [B, H, S, D] / [B, H, S, DV] (the last stride is 1)
    positions_ptr,  # [Q] int64: the buffer column of each new token
    length_ptr,  # [] int64: the written length, advanced by Q
    H, Q, D, DV,
    s_kb, s_kh, s_kq, s_vb, s_vh, s_vq,  # new keys / values
    s_Kb, s_Kh, s_Ks, s_Vb, s_Vh, s_Vs,  # buffers
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,  # the values' head_dim, padded (K/V head sizes may differ)
):
    # One program per (row, head, new token): one head_dim vector of K and of V.
    bh = tl.program_id(0)
    q = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    cols_v = tl.arange(0, BLOCK_DV)
    ok_v = cols_v < DV
    column = tl.load(positions_ptr + q)
    k = tl.load(key_ptr + b * s_kb + h * s_kh + q * s_kq + cols, mask=ok)
    v = tl.load(value_ptr + b * s_vb + h * s_vh + q * s_vq + cols_v, mask=ok_v)
    tl.store(keys_ptr + b * s_Kb + h * s_Kh + column * s_Ks + cols, k, mask=ok)
    tl.store(values_ptr + b * s_Vb + h * s_Vh + column * s_Vs + cols_v, v, mask=ok_v)
    if (bh == 0) & (q == 0):  # no program reads the length: the positions were computed before the launch
        tl.store(length_ptr, tl.load(length_ptr) + Q)


settle_cache_keys(globals())  # the same keys in every process, whichever kernel it launches first
