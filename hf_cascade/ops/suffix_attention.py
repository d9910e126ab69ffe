"""Per-row suffix pass of cascade attention, optionally merged with a prefix state."""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import check_float_dtype, check_lse, resolve_backend
from ._launch import suffix_triton
from .reference import suffix_attention_ref

__all__ = ["suffix_attention"]

_OP = "suffix_attention"


def suffix_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    prefix_out: Tensor | None = None,
    prefix_lse: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Each row against its own KV (the per-row suffix), optionally merged with a prefix state.

    Args:
        query: [B, Hq, Lq, D] float32/float16/bfloat16 (any strides).
        key, value: [B, Hkv, S, D] / [B, Hkv, S, Dv] (Dv may differ from D), query's dtype and device; S may
            be 0. Hq = Hkv * G.
        scale: softmax scale.
        mask: None, or bool [B, Lq, S] / [B, 1, Lq, S] (True = attend; a batch dim of 1
            broadcasts). When given, ``causal`` is ignored.
        causal: with ``mask=None``: True = causal aligned bottom-right (query i sees keys
            ``j <= S - Lq + i``), False = full attention.
        softcap: if given, ``scores = softcap * tanh(scale * q.k / softcap)`` (Gemma 2).
        prefix_out: optional float32 [B, Hq, Lq, Dv]; prefix_lse: optional float32 [B, Hq, Lq]
            (both or neither). Merged exactly into the result (fused in the Triton epilogue).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".

    Returns:
        (out [B, Hq, Lq, Dv] in query.dtype, lse [B, Hq, Lq] float32 natural log; the merged LSE
        when a prefix state is given). A query row that sees no key (fully masked, or S == 0) has
        suffix LSE -inf. The Triton path allocates ``out`` with memory laid out [B, Lq, Hq, D], so
        ``out.transpose(1, 2)`` (the layout transformers wants) is contiguous; do not assume
        ``out.is_contiguous()``.

    Example:
        >>> o, lse = suffix_attention(q, k_row, v_row, scale=q.shape[-1] ** -0.5,
        ...                           prefix_out=o_pre, prefix_lse=lse_pre)
    """
    mask = _validate(query, key, value, scale, mask, softcap, prefix_out, prefix_lse)
    if resolve_backend(backend, query.device, _OP) == "torch":
        out, lse = suffix_attention_ref(
            query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
            prefix_out=prefix_out, prefix_lse=prefix_lse,
        )
        return out.to(query.dtype), lse
    return suffix_triton(query, key, value, scale=scale, mask=mask, causal=causal,
                         softcap=softcap, prefix_out=prefix_out, prefix_lse=prefix_lse)


def _validate(query, key, value, scale, mask, softcap, prefix_out, prefix_lse) -> Tensor | None:
    """Check shapes, dtypes and devices; return the mask as bool [B or 1, Lq, S] (or None)."""
    if query.dim() != 4:
        raise ValueError(f"{_OP}: query must be [B, Hq, Lq, D]; got shape {tuple(query.shape)}.")
    if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"{_OP}: key and value must be [B, Hkv, S, D] and [B, Hkv, S, Dv] (Dv may differ from D); got "
            f"{tuple(key.shape)} and {tuple(value.shape)}."
        )
    check_float_dtype("query", query, _OP)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"{_OP}: key/value dtype ({key.dtype}/{value.dtype}) must match query ({query.dtype})."
        )
    B, Hq, Lq, D = query.shape
    Bk, Hkv, S, Dk = key.shape
    if Bk != B or Dk != D:
        raise ValueError(
            f"{_OP}: key {tuple(key.shape)} must be [B={B}, Hkv, S, D={D}] to match query "
            f"{tuple(query.shape)}."
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"{_OP}: query heads ({Hq}) must be a multiple of key heads ({Hkv}); query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}. Pass the un-repeated KV heads."
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"{_OP}: query, key, value must share a device; got {query.device}, {key.device}.")
    if not scale > 0:
        raise ValueError(f"{_OP}: scale must be > 0; got {scale}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{_OP}: softcap must be None or > 0; got {softcap}.")
    if mask is not None:
        if mask.dim() == 4 and mask.shape[1] == 1:
            mask = mask.squeeze(1)
        if mask.dtype != torch.bool or mask.dim() != 3 or mask.shape[0] not in (1, B) or tuple(mask.shape[1:]) != (Lq, S):
            raise ValueError(
                f"{_OP}: mask must be bool [B, Lq, S] = [{B}, {Lq}, {S}] (or [B, 1, Lq, S]); got "
                f"{mask.dtype} with shape {tuple(mask.shape)}. Convert an additive float mask with "
                "`mask == 0`; slice it to the suffix keys."
            )
        if mask.device != query.device:
            raise ValueError(f"{_OP}: mask is on {mask.device}, query on {query.device}; move it.")
    if (prefix_out is None) != (prefix_lse is None):
        raise ValueError(f"{_OP}: pass both prefix_out and prefix_lse, or neither.")
    if prefix_out is not None:
        Dv = value.shape[-1]
        if tuple(prefix_out.shape) != (B, Hq, Lq, Dv) or prefix_out.dtype != torch.float32:
            raise ValueError(
                f"{_OP}: prefix_out must be float32 [B, Hq, Lq, Dv] = {(B, Hq, Lq, Dv)}; got "
                f"{prefix_out.dtype} with shape {tuple(prefix_out.shape)} (use shared_prefix_attention's out)."
            )
        check_lse("prefix_lse", prefix_lse, (B, Hq, Lq), _OP)
        if prefix_out.device != query.device or prefix_lse.device != query.device:
            raise ValueError(f"{_OP}: prefix_out/prefix_lse must be on {query.device}.")
    return mask
