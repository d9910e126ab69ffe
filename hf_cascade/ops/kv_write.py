"""Write a step's new keys and values into fixed suffix buffers and advance the written length: one launch per layer
(instead of one ``index_copy_`` each for K and V and an in-place add), for the recorded decode step."""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import padded_head_dim, resolve_backend
from .reference import write_suffix_kv_ref

__all__ = ["write_suffix_kv"]

_OP = "write_suffix_kv"


def write_suffix_kv(key: Tensor, value: Tensor, keys: Tensor, values: Tensor, positions: Tensor, length: Tensor, *,
                    backend: str = "auto") -> None:
    """``keys[:, :, positions] = key``, ``values[:, :, positions] = value``, ``length += Q``, in place.

    Args:
        key, value: the new tokens' KV ``[B, H, Q, D]`` / ``[B, H, Q, Dv]`` (any strides; Dv may differ from D),
            dtype of the buffers.
        keys, values: the fixed buffers ``[B, H, S, D]`` / ``[B, H, S, Dv]``, last dimension contiguous.
        positions: int64 ``[Q]`` on the buffers' device, distinct buffer columns in ``[0, S)`` (not checked on the
            host: that would wait for the GPU).
        length: int64 scalar tensor on the buffers' device, the written length; advanced by ``Q``.
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".
    """
    _validate(key, value, keys, values, positions, length)
    if key.shape[2] == 0:
        return
    if resolve_backend(backend, keys.device, _OP) == "torch":
        write_suffix_kv_ref(key, value, keys, values, positions, length)
        return
    from . import _kv_write_kernel as kernels  # lazy: triton is optional

    B, H, Q, D = key.shape
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    kernels._write_suffix_kv_kernel[(B * H, Q)](
        key, value, keys, values, positions, length, H, Q, D, value.shape[-1],
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        BLOCK_D=padded_head_dim(D), BLOCK_DV=padded_head_dim(value.shape[-1]), num_warps=1,
    )


def _validate(key: Tensor, value: Tensor, keys: Tensor, values: Tensor, positions: Tensor, length: Tensor) -> None:
    if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
        raise ValueError(f"{_OP}: key and value must be [B, H, Q, D] and [B, H, Q, Dv]; got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}.")
    if (keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3] or keys.shape[:2] != key.shape[:2]
            or keys.shape[3] != key.shape[3] or values.shape[3] != value.shape[3]):
        raise ValueError(f"{_OP}: keys and values must be buffers [B, H, S, D] / [B, H, S, Dv] matching key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)} in B, H and head_dim; got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}.")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(f"{_OP}: the buffers' last dimension must be contiguous; got strides {keys.stride()} and "
                         f"{values.stride()}.")
    if {key.dtype, value.dtype} != {keys.dtype} or values.dtype != keys.dtype:
        raise ValueError(f"{_OP}: key/value ({key.dtype}, {value.dtype}) must have the buffers' dtype {keys.dtype}.")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (key.shape[2],):
        raise ValueError(f"{_OP}: positions must be int64 [Q] = [{key.shape[2]}]; got {positions.dtype} "
                         f"{tuple(positions.shape)}.")
    if length.dtype != torch.int64 or length.dim() != 0:
        raise ValueError(f"{_OP}: length must be an int64 scalar tensor; got {length.dtype} {tuple(length.shape)}.")
    devices = {t.device for t in (key, value, keys, values, positions, length)}
    if len(devices) != 1:
        raise ValueError(f"{_OP}: all tensors must be on one device; got {sorted(map(str, devices))}.")
