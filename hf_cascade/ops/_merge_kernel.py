"""Triton kernel for the LSE merge of two attention states. Imported only when Triton runs."""

import triton
import triton.language as tl

from ._backend import before_first_kernel
from ._jit import settle_cache_keys

before_first_kernel()  # the kernel cache shared, Triton's key ready: before the first kernel is built


@triton.jit(do_not_specialize=["R"])  # rows: a size of the batch layout, not specialised
def _merge_attention_states_kernel(
    out_ptr, lse_out_ptr,  # [R, D] out dtype, [R] fp32
    a_ptr, lse_a_ptr,  # [R, D], [R] fp32
    b_ptr, lse_b_ptr,  # [R, D], [R] fp32
    R, D,
    stride_or, stride_ar, stride_br,  # row strides; the D stride is 1
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program merges BLOCK_R rows, each a whole (padded) head_dim vector.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    la = tl.load(lse_a_ptr + rows, mask=row_ok, other=float("-inf"))
    lb = tl.load(lse_b_ptr + rows, mask=row_ok, other=float("-inf"))
    # Empty-segment guard: +inf (FlashAttention-2's empty rows) and NaN mean "no keys".
    la = tl.where((la == float("inf")) | (la != la), float("-inf"), la)
    lb = tl.where((lb == float("inf")) | (lb != lb), float("-inf"), lb)
    # Weights relative to the larger LSE; a both-empty row gets weights 0 and LSE -inf.
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    nonempty = total > 0
    safe_total = tl.where(nonempty, total, 1.0)  # where() evaluates both sides: keep log/div finite
    lse = tl.where(nonempty, m + tl.log(safe_total), float("-inf"))
    inv = tl.where(nonempty, 1.0 / safe_total, 0.0)
    wa = wa * inv
    wb = wb * inv
    # Load a side only where its weight is nonzero: an empty side's out may be NaN garbage.
    rows64 = rows.to(tl.int64)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    a = tl.load(a_ptr + rows64[:, None] * stride_ar + cols[None, :],
                mask=tile_ok & (wa > 0)[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows64[:, None] * stride_br + cols[None, :],
                mask=tile_ok & (wb > 0)[:, None], other=0.0).to(tl.float32)
    out = a * wa[:, None] + b * wb[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_or + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_out_ptr + rows, lse, mask=row_ok)



@triton.jit(do_not_specialize=["R", "N"])
def _merge_states_kernel(
    out_ptr, lse_out_ptr,  # [R, D] out dtype, [R] fp32
    outs_ptr, lses_ptr,  # [N, R, D], [N, R] fp32 (any state stride: e.g. the rows of an all-gather buffer)
    N, R, D,
    stride_on, stride_or,  # outs' state and row strides (the D stride is 1)
    stride_ln,  # lses' state stride (the row stride is 1)
    stride_out_r,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program merges the N states of BLOCK_R rows: the max LSE first, then the weighted sum.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    tile_ok = row_ok[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for n in range(N):
        lse = tl.load(lses_ptr + n * stride_ln + rows, mask=row_ok, other=float("-inf"))
        lse = tl.where((lse == float("inf")) | (lse != lse), float("-inf"), lse)
        m = tl.maximum(m, lse)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for n in range(N):
        lse = tl.load(lses_ptr + n * stride_ln + rows, mask=row_ok, other=float("-inf"))
        lse = tl.where((lse == float("inf")) | (lse != lse), float("-inf"), lse)
        w = tl.exp(lse - m)
        # A state without keys (weight 0) is not read: its out may be NaN garbage.
        o = tl.load(outs_ptr + n * stride_on + rows64[:, None] * stride_or + cols[None, :],
                    mask=tile_ok & (w > 0)[:, None], other=0.0).to(tl.float32)
        acc += o * w[:, None]
        total += w
    nonempty = total > 0
    safe_total = tl.where(nonempty, total, 1.0)
    out = acc * tl.where(nonempty, 1.0 / safe_total, 0.0)[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_out_r + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=tile_ok)
    tl.store(lse_out_ptr + rows, tl.where(nonempty, m + tl.log(safe_total), float("-inf")), mask=row_ok)


settle_cache_keys(globals())  # the same keys in every process, whichever kernel it launches first
