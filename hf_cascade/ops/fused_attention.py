"""Attention with its log-sum-exp through PyTorch's own fused kernels (FlashAttention-2 on CUDA, the flash kernel
for CPU), for the blocks of context parallelism: the ring prefill's blocks and a rank's decode partial.

Why. Context parallelism needs every block's LSE to merge the blocks exactly; ``F.scaled_dot_product_attention``
does not return it, but the aten ops under it do (``_scaled_dot_product_flash_attention`` on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` on CPU): nothing to install. On CUDA this is the flash kernel that
sdpa itself runs for a causal prompt (so a 1-GPU ring prefill runs at sdpa's speed), and for one query row it
splits the keys over the SMs (flash-decoding), where hf_cascade's suffix kernel runs one program per KV head.

Where it applies (:func:`fused_attention_applies`): no explicit mask (causal aligned top-left with ``Lq == Lk``, or
full), no soft-capping, fp16/bf16 on CUDA (head dim <= 256, a multiple of 8), any float dtype on CPU. Elsewhere the
callers use :func:`~hf_cascade.ops.suffix_attention.suffix_attention` (the Triton kernel / PyTorch reference).
GQA: the CUDA kernel takes ``Hq = G * Hkv`` as it is; the CPU kernel gets the KV heads repeated.

LSE: natural log, fp32, ``[B, Hq, Lq]`` (-inf for a query that sees no key cannot happen here: no masks).
"""

from __future__ import annotations

import torch
from torch import Tensor


__all__ = ["KERNEL_CHOICES", "flash_takes", "fused_attention", "fused_attention_applies", "use_fused_attention"]

KERNEL_CHOICES = ("auto", "fused", "suffix")  # the `kernels` / `block_backend` option of context parallelism


def use_fused_attention(query: Tensor, key: Tensor, choice: str, *, mask: Tensor | None = None,
                        softcap: float | None = None) -> bool:
    """Whether a block of a caller that offers :data:`KERNEL_CHOICES` runs :func:`fused_attention`: ``"auto"`` on
    CUDA where it applies, ``"fused"`` wherever it applies (CPU too: tests), ``"suffix"`` never.

    Raises:
        ValueError: ``choice`` is not one of :data:`KERNEL_CHOICES`.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"`kernels` must be one of {KERNEL_CHOICES}; got {choice!r}.")
    if choice == "suffix" or (choice == "auto" and query.device.type != "cuda"):
        return False
    return fused_attention_applies(query, key, mask=mask, softcap=softcap)


def fused_attention_applies(query: Tensor, key: Tensor, *, mask: Tensor | None = None,
                            softcap: float | None = None) -> bool:
    """Whether :func:`fused_attention` can compute this block exactly (see the module docstring)."""
    if mask is not None or softcap is not None or query.device.type not in ("cuda", "cpu"):
        return False
    D = query.shape[-1]
    if key.shape[-1] != D or query.shape[1] % key.shape[1]:
        return False
    if query.device.type == "cuda":
        return flash_takes(query.dtype, D)
    return query.dtype in (torch.float32, torch.float16, torch.bfloat16)


def flash_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch's CUDA FlashAttention-2 takes this dtype and head size (fp16/bf16; head dim <= 256 and a
    multiple of 8)."""
    return dtype in (torch.float16, torch.bfloat16) and 0 < head_dim <= 256 and head_dim % 8 == 0


def fused_attention(query: Tensor, key: Tensor, value: Tensor, *, scale: float, causal: bool,
                    kernel: str = "flash") -> tuple[Tensor, Tensor]:
    """``softmax(scale * q k^T [+ causal mask]) v`` and its LSE, by PyTorch's flash kernel.

    Args:
        query: ``[B, Hq, Lq, D]``; key, value: ``[B, Hkv, Lk, D]`` (``Hq % Hkv == 0``), query's dtype and device;
            last dim contiguous (other strides free).
        scale: softmax scale.
        causal: query ``i`` sees keys ``j <= i`` (top-left aligned: use with ``Lq == Lk``); False: every key.
        kernel: on CUDA, ``"flash"`` (FlashAttention-2; splits a long key range over the SMs for one query row)
            or ``"cudnn"`` (cuDNN's fused attention, ~1.6x FlashAttention-2 on Hopper for long blocks; used where
            :func:`cudnn_attention_agrees` found its output and LSE equal to FlashAttention-2's on this device, else
            the flash kernel runs). Ignored on CPU.
    Returns:
        ``(out [B, Hq, Lq, D] in query.dtype, lse [B, Hq, Lq] float32, natural log)``.
    Raises:
        ValueError: shapes, dtypes or devices the kernel does not take (check :func:`fused_attention_applies`).
    """
    if not fused_attention_applies(query, key):
        raise ValueError(
            f"fused_attention: query {tuple(query.shape)} {query.dtype} on {query.device} with key "
            f"{tuple(key.shape)} is not a block PyTorch's flash kernel takes (CUDA: fp16/bf16, head dim <= 256 and a "
            "multiple of 8; Hq a multiple of Hkv). Use hf_cascade.ops.suffix_attention for it."
        )
    if causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"fused_attention: causal=True needs Lq == Lk; got {query.shape[2]} and {key.shape[2]}.")
    if key.shape[2] == 0:
        B, H, Lq, _ = query.shape
        return query.new_zeros(query.shape), query.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    if query.device.type == "cuda":
        if kernel == "cudnn" and cudnn_attention_agrees(query.device):
            if groups > 1 and not causal:  # the G query heads of a KV head as G x Lq rows of one head
                return _cudnn_folded_gqa(query, key, value, scale)
            if groups > 1:  # (cuDNN's op takes as many KV heads as query heads)
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, None, True, 0.0, causal, False, scale=scale)[:2]
            return out, lse.reshape(query.shape[:3])
        if groups > 1 and not _native_gqa(query.device):
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                          scale=scale)
    return out, lse.float()


def _cudnn_folded_gqa(query: Tensor, key: Tensor, value: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Non-causal GQA on cuDNN without repeating the KV heads: query head ``h`` reads KV head ``h // G`` (transformers'
    ``repeat_kv`` order), so ``[B, Hkv * G, Lq, D]`` viewed as ``[B, Hkv, G * Lq, D]`` is the same attention with
    one query block per KV head. The KV is read as it is (a long key range costs no ``G``-fold copy)."""
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[1]
    folded = query.reshape(B, Hkv, (Hq // Hkv) * Lq, D)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        folded, key, value, None, True, 0.0, False, False, scale=scale)[:2]
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)


_NATIVE_GQA: dict[int, bool] = {}  # CUDA device index -> the flash op takes Hq = G * Hkv as it is (probed once)


def _native_gqa(device: torch.device) -> bool:
    """Whether this torch's CUDA flash op takes fewer KV heads than query heads (FlashAttention-2 does; a build that
    checks equal heads raises): probed once per device on a tiny block, else the KV heads are repeated."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NATIVE_GQA:
        q = torch.zeros(1, 2, 1, 64, device=device, dtype=torch.bfloat16)
        kv = torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
        try:
            torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, False, False, scale=1.0)
            _NATIVE_GQA[index] = True
        except RuntimeError:
            _NATIVE_GQA[index] = False
    return _NATIVE_GQA[index]


_CUDNN_AGREES: dict[int, bool] = {}  # CUDA device index -> cuDNN's attention matches FlashAttention-2 here


def cudnn_attention_agrees(device: torch.device) -> bool:
    """Whether cuDNN's fused attention op runs on this device and returns FlashAttention-2's output and natural-log
    LSE (within bf16 rounding) on a small causal and a non-square block: checked once per device, so a cuDNN or
    torch build with another LSE convention or a failing op falls back to the flash kernel."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDNN_AGREES:
        g = torch.Generator(device=device).manual_seed(0)
        ok = True
        for lq, lk, causal in ((256, 256, True), (128, 384, False)):
            q = torch.randn(1, 4, lq, 128, device=device, dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, 4, lk, 128, device=device, dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, 4, lk, 128, device=device, dtype=torch.bfloat16, generator=g)
            try:
                out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, True, 0.0, causal, False, scale=0.088)[:2]
            except RuntimeError:
                ok = False
                break
            ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=0.088)[:2]
            ok = ok and lse.numel() == ref_lse.numel() and bool(
                (lse.reshape(ref_lse.shape) - ref_lse).abs().max() < 1e-2
                and (out.float() - ref_out.float()).abs().max() < 2e-2)
        _CUDNN_AGREES[index] = ok
    return _CUDNN_AGREES[index]
