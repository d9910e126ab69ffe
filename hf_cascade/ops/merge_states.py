"""Exact N-way LSE merge of attention states stacked along a leading dim (the context-parallel combine's merge)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import check_float_dtype, padded_head_dim, resolve_backend
from .reference import merge_states_ref

__all__ = ["merge_states"]

_OP = "merge_states"


def merge_states(outs: Tensor, lses: Tensor, *, out_dtype: torch.dtype | None = None,
                 backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Merge ``N`` states over disjoint key sets: ``m = max lse``, ``out = sum exp(lse - m) out / sum exp(lse - m)``.

    One Triton launch on CUDA (the reference: :func:`~hf_cascade.ops.reference.merge_states_ref`, a dozen small
    ops). The inputs may be strided views, e.g. the ``N`` rank rows of an all-gather buffer
    ``[N, R * D + R]`` viewed as ``outs [N, ..., D]`` and ``lses [N, ...]``: nothing is copied.

    Args:
        outs: ``[N, ..., D]`` float32/float16/bfloat16, the states' outputs (the D stride 1; each state's rows
            laid out with one stride, as a view of a contiguous ``[..., D]`` is).
        lses: ``[N, ...]`` float32 natural-log LSEs (``outs.shape[:-1]``; -inf, +inf or NaN = no keys).
        out_dtype: dtype of the merged ``out`` (default ``outs.dtype``).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".
    Returns:
        ``(out [..., D] in out_dtype, lse [...] float32)``. All states empty: out 0, lse -inf.
    """
    if outs.dim() < 2 or tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"{_OP}: outs must be [N, ..., D] and lses [N, ...] = outs.shape[:-1]; got "
                         f"{tuple(outs.shape)} and {tuple(lses.shape)}.")
    check_float_dtype("outs", outs, _OP)
    if lses.dtype != torch.float32:
        raise ValueError(f"{_OP}: lses must be float32 (natural-log LSE); got {lses.dtype}.")
    out_dtype = outs.dtype if out_dtype is None else out_dtype
    if resolve_backend(backend, outs.device, _OP) == "torch":
        out, lse = merge_states_ref(outs, lses, dim=0)
        return out.to(out_dtype), lse
    from . import _merge_kernel as kernels  # lazy: triton is optional

    N, D = outs.shape[0], outs.shape[-1]
    rows = lses[0].numel()
    o = _rows_view(outs, (N, rows, D))
    ls = _rows_view(lses, (N, rows))
    out = torch.empty((*outs.shape[1:],), dtype=out_dtype, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    if rows == 0 or D == 0:
        return out, lse
    block_d = padded_head_dim(D)
    block_r = max(1, min(16, 2048 // block_d))
    kernels._merge_states_kernel[(-(-rows // block_r),)](
        out.view(rows, D), lse.view(rows), o, ls, N, rows, D, o.stride(0), o.stride(1), ls.stride(0), D,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
    return out, lse


def _rows_view(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` as ``shape`` (states, rows[, D]) without a copy where its strides allow, else a contiguous copy."""
    try:
        view = t.view(shape)
    except RuntimeError:
        view = t.contiguous().view(shape)
    if view.stride(-1) != 1:
        view = view.contiguous()
    return view
