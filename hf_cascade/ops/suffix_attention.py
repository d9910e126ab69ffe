"""Per-row suffix pass of cascade attention, optionally merged with a prefix state."""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import check_float_dtype, check_lse, dot_precision, padded_head_dim, resolve_backend
from .reference import _empty_guard, suffix_attention_ref, suffix_visibility

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
    return _suffix_triton(query, key, value, scale=scale, mask=mask, causal=causal,
                          softcap=softcap, prefix_out=prefix_out, prefix_lse=prefix_lse)


def check_key_length(key_length: Tensor | None, key: Tensor, op: str) -> None:
    """``key_length`` must be None or an integer tensor of one element on ``key``'s device (a count of written
    suffix keys, read by the kernels on the device)."""
    if key_length is None:
        return
    if (not isinstance(key_length, Tensor) or key_length.numel() != 1 or key_length.dtype.is_floating_point
            or key_length.dtype == torch.bool or key_length.device != key.device):
        shape = tuple(key_length.shape) if isinstance(key_length, Tensor) else type(key_length).__name__
        raise ValueError(
            f"{op}: `key_length` must be an integer tensor of one element on the keys' device ({key.device}), the "
            f"number of suffix keys written; got {shape}"
            f"{f' {key_length.dtype} on {key_length.device}' if isinstance(key_length, Tensor) else ''}."
        )


def mask_with_key_length(mask: Tensor | None, key_length: Tensor | None, Lq: int, S: int, causal: bool,
                         device) -> Tensor | None:
    """The bool mask ``[B or 1, Lq, S]`` that ``mask`` / ``causal`` and ``key_length`` describe together (the
    reference's reading of ``key_length``: keys at or after it are not visible)."""
    if key_length is None:
        return mask
    written = (torch.arange(S, device=device) < key_length.reshape(())).expand(1, Lq, S)
    visible = suffix_visibility(1 if mask is None else mask.shape[0], Lq, S, mask, causal, device)
    return written if visible is None else visible & written


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


def _suffix_config(D: int, m_total: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a suffix launch with ``m_total = G * Lq`` rows."""
    block_m = min(64, max(16, 1 << max(m_total - 1, 0).bit_length()))  # decode: M = G is small
    if device.type != "cuda":
        return min(block_m, 32), 32, 4, 1  # interpreter: small tiles keep numpy work per step low
    if padded_head_dim(D) >= 256:
        return block_m, 32, 4 if block_m <= 16 else 8, 2
    if block_m >= 64:
        # Many queries per row (a prefill's window): 32-key blocks. H100, generate()'s first forward of the shared
        # workload (B=32 rows x 64 queries, GQA 32/8, d=128, 128 suffix columns, one prefix state per query;
        # benchmarks/probe_decode_attention.py --sweep-prefill): 73 us against 172 us with 64-key blocks, which
        # need 255 registers and spill.
        return block_m, 32, 4, 3
    return block_m, 64, 4, 3


def _suffix_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    mask: Tensor | None,
    causal: bool,
    softcap: float | None,
    prefix_out: Tensor | None,
    prefix_lse: Tensor | None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton launch. ``block_m`` / ``block_n`` override the heuristics (tests)."""
    B, Hq, Lq, _ = query.shape
    S, D = key.shape[2], value.shape[-1]
    G = Hq // key.shape[1]
    if prefix_out is None:
        states = None
    elif S == 0:  # no suffix keys: the result is the prefix state, bit for bit
        out = torch.empty((B, Lq, Hq, D), dtype=query.dtype, device=query.device).transpose(1, 2)
        pl = _empty_guard(prefix_lse)
        out.copy_(torch.where((pl > float("-inf")).unsqueeze(-1), prefix_out, 0.0))
        return out, pl
    else:  # one merged prefix state [B, Hq, Lq, D] seen as a single state slot
        po, pl = prefix_out, prefix_lse
        states = (po, pl, 1,
                  (0, po.stride(0), G * po.stride(1), po.stride(1), po.stride(2), po.stride(3)),
                  (0, pl.stride(0), G * pl.stride(1), pl.stride(1), pl.stride(2)))
    return launch_suffix(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                         states=states, block_m=block_m, block_n=block_n)


def launch_suffix(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float,
    mask: Tensor | None,
    causal: bool,
    softcap: float | None,
    states: tuple | None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_length: Tensor | None = None,
    lower: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the suffix kernel (inputs already validated); ``states`` seeds it with prefix states;
    ``key_length``: int64 device scalar, the keys from it on unwritten (the kernel stops reading there);
    ``lower``: int64 ``[B, Lq]``, each query's first visible key column (sliding windows, chunks), or None.

    ``states = (out fp32, lse fp32, num_states, out strides (slot, b, kvh, group, q, d),
    lse strides (slot, b, kvh, group, q))``: every state slot is merged exactly into the result.
    ``block_m`` / ``block_n`` / ``num_warps`` / ``num_stages`` override the heuristics (tests, tuning).
    """
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    dev = query.device
    # [B, Lq, Hq, Dv] memory so that transformers' out.transpose(1, 2) is free.
    out = torch.empty((B, Lq, Hq, Dv), dtype=query.dtype, device=dev).transpose(1, 2)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    if S == 0 and states is None:  # no keys at all
        return out.zero_(), lse.fill_(float("-inf"))

    from . import _suffix_kernel as kernels  # lazy: triton is optional

    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    cfg_m, cfg_n, cfg_warps, cfg_stages = _suffix_config(max(D, Dv), G * Lq, dev)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_warps
    num_stages = num_stages or cfg_stages
    if mask is not None:
        mask_arg = mask.expand(B, Lq, S).view(torch.uint8)  # no copy; stride 0 if broadcast
        mask_strides = mask_arg.stride()
        mode = kernels.MASK_TENSOR.value
    else:
        mask_arg, mask_strides = key, (0, 0, 0)  # unused placeholder pointer
        mode = (kernels.MASK_CAUSAL if causal else kernels.MASK_FULL).value
    if states is None:
        po, pl, n_states, po_strides, pl_strides = out, lse, 0, (0,) * 6, (0,) * 5
    else:
        po, pl, n_states, po_strides, pl_strides = states
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    grid = (-(-(G * Lq) // block_m), Hkv, B)
    kernels._suffix_fwd_kernel[grid](
        query, key, value, mask_arg, key if key_length is None else key_length, key if lower is None else lower,
        po, pl, out, lse,
        Lq, S, G, D, Dv, n_states,
        float(scale), float(softcap) if softcap is not None else 1.0,
        *query.stride(), *key.stride()[:3], *value.stride()[:3], *mask_strides,
        *((0, 0) if lower is None else lower.stride()),
        *po_strides, *pl_strides, *out.stride(), *lse.stride(),
        MASK_MODE=mode,
        HAS_SOFTCAP=softcap is not None,
        HAS_PREFIX=states is not None,
        HAS_KEY_LEN=key_length is not None,
        HAS_LOWER=lower is not None,
        EVEN_D=block_d == D, EVEN_DV=block_dv == Dv,
        INPUT_PRECISION=dot_precision(query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse
