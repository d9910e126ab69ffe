"""Exact LSE merge of two attention states computed over disjoint key sets."""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import check_float_dtype, check_lse, padded_head_dim, resolve_backend
from .reference import merge_attention_states_ref

__all__ = ["merge_attention_states"]

_OP = "merge_attention_states"


def merge_attention_states(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Exact LSE merge of two attention states over disjoint key sets.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))``,
    ``lse = log(exp(lse_a) + exp(lse_b))``, computed stably in fp32.

    Args:
        out_a, out_b: [..., D] same shape and device, float32/float16/bfloat16 (dtypes may differ).
        lse_a, lse_b: [...] float32 natural-log LSE, shape ``out_a.shape[:-1]``.
            lse = -inf means "no keys" (that side's out is ignored and may be NaN garbage);
            +inf and NaN are treated as empty too (FlashAttention-2 returns +inf for empty rows).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".

    Returns:
        (out [..., D] in ``out_a.dtype``, lse [...] float32). Both sides empty: out 0, lse -inf.

    Example:
        >>> o, l = merge_attention_states(o_prefix, lse_prefix, o_suffix, lse_suffix)
    """
    _validate(out_a, lse_a, out_b, lse_b)
    if resolve_backend(backend, out_a.device, _OP) == "torch":
        out, lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
        return out.to(out_a.dtype), lse
    return _merge_triton(out_a, lse_a, out_b, lse_b)


def _validate(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    if out_a.dim() < 1 or out_a.shape != out_b.shape:
        raise ValueError(
            f"{_OP}: out_a and out_b must have the same shape [..., D]; got {tuple(out_a.shape)} "
            f"and {tuple(out_b.shape)}. Both states must cover the same queries and heads."
        )
    check_float_dtype("out_a", out_a, _OP)
    check_float_dtype("out_b", out_b, _OP)
    lead = tuple(out_a.shape[:-1])
    check_lse("lse_a", lse_a, lead, _OP)
    check_lse("lse_b", lse_b, lead, _OP)
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"{_OP}: all inputs must be on one device; got {sorted(map(str, devices))}.")


def _merge_triton(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    from . import _merge_kernel as kernels  # lazy: triton is optional

    shape = out_a.shape
    D = shape[-1]
    out = torch.empty(shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        return out, lse
    # 2-D row views; reshape copies only when the input cannot be viewed that way.
    a = out_a.reshape(-1, D)
    b = out_b.reshape(-1, D)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    la = lse_a.reshape(-1).contiguous()
    lb = lse_b.reshape(-1).contiguous()
    rows = a.shape[0]
    block_d = padded_head_dim(D)
    block_r = max(1, min(64, 4096 // block_d))  # ~4K elements per program
    grid = ((rows + block_r - 1) // block_r,)
    kernels._merge_attention_states_kernel[grid](
        out.view(-1, D), lse.view(-1), a, la, b, lb,
        rows, D,
        D, a.stride(0), b.stride(0),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
    return out, lse
