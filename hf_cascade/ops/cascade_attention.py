"""One cascade attention call: shared-prefix levels + per-row suffix, in L + 1 launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._backend import dot_precision, padded_head_dim, resolve_backend
from ._cascade_torch import cascade_attention_torch
from .prefix_attention import (
    PrefixPlan,
    _check_plan,
    _num_splits_for,
    _prefix_config,
    _prefix_launch_config,
    launch_combine,
    launch_prefix,
    partial_strides,
)
from .prefix_attention import _validate as _validate_prefix
from .suffix_attention import _validate as _validate_suffix
from .suffix_attention import check_key_length, launch_suffix, mask_with_key_length, suffix_attention

__all__ = ["cascade_attention"]

_OP = "cascade_attention"


def cascade_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefixes: Sequence[tuple[Tensor, Tensor, PrefixPlan]] = (),
    *,
    scale: float,
    mask: Tensor | None = None,
    causal: bool = True,
    softcap: float | None = None,
    backend: str = "auto",
    key_length: Tensor | None = None,
    key_lower: Sequence[Tensor] | None = None,
    suffix_lower: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every row over its shared-prefix levels and its own suffix, merged exactly.

    Same result as ``shared_prefix_attention`` per level, ``merge_attention_states`` across levels
    and ``suffix_attention(..., prefix_out=, prefix_lse=)``, but on Triton one launch per prefix
    level plus one suffix launch: the levels write their KV-split states (fp32) to one buffer and
    the suffix kernel combines them in its prologue (no separate combine or merge kernels).

    Args:
        query: [B, Hq, Lq, D] float32/float16/bfloat16 (any strides).
        key, value: the per-row suffix KV [B, Hkv, S, D] / [B, Hkv, S, Dv] (S may be 0; Dv may differ from D,
            MLA-style), query's dtype and device.
        prefixes: per level ``(prefix_key [Hkv, T, D], prefix_value [Hkv, T, Dv], plan)``, with
            ``plan = plan_shared_prefix(row_node, node_starts)`` built once per batch layout.
        scale, mask, causal, softcap: as in :func:`suffix_attention` (mask and causal apply to the
            suffix keys only; every query sees all keys of its prefix nodes).
        backend: "auto" (Triton on CUDA when available, else torch), "triton" or "torch".
        key_length: None, or an int64 tensor of one element on the device: the suffix keys from this index on
            are not written yet (fixed buffers) and never visible, as if masked; the Triton kernels stop reading
            there (a decode step's buffers are read only as far as they are written).
        key_lower, suffix_lower: None, or (both) per level and for the suffix an int64 ``[B, Lq]`` tensor: the first
            column of that level's packed keys / of the suffix keys each query sees (sliding windows, chunked
            attention; see :mod:`hf_cascade.ops.bounded`). The kernels skip the blocks below a tile's bounds.

    Returns:
        (out [B, Hq, Lq, Dv] in query.dtype, memory laid out [B, Lq, Hq, Dv] so ``out.transpose(1, 2)``
        is contiguous; lse [B, Hq, Lq] float32 natural log over all keys; -inf where none).

    Example:
        >>> plan = plan_shared_prefix(row_node, node_starts)  # once per batch layout
        >>> o, lse = cascade_attention(q, k_suffix, v_suffix, [(k_pre, v_pre, plan)],
        ...                            scale=q.shape[-1] ** -0.5)
    """
    mask = _validate_suffix(query, key, value, scale, mask, softcap, None, None)
    check_key_length(key_length, key, _OP)
    for k_pre, v_pre, plan in prefixes:
        _validate_prefix(query, k_pre, v_pre, scale, softcap)
        if k_pre.shape[0] != key.shape[1]:
            raise ValueError(
                f"{_OP}: prefix key heads ({k_pre.shape[0]}) must equal suffix key heads ({key.shape[1]}); "
                f"prefix key {tuple(k_pre.shape)}, suffix key {tuple(key.shape)}."
            )
        if v_pre.shape[-1] != value.shape[-1]:
            raise ValueError(
                f"{_OP}: prefix values' head_dim ({v_pre.shape[-1]}) must equal the suffix values' "
                f"({value.shape[-1]}); prefix value {tuple(v_pre.shape)}, suffix value {tuple(value.shape)}."
            )
        if not isinstance(plan, PrefixPlan):
            raise ValueError(f"{_OP}: each prefix level needs a PrefixPlan (plan_shared_prefix); got {type(plan)}.")
        _check_plan(plan, query, k_pre)
    bounded = _check_bounds(key_lower, suffix_lower, query, prefixes)
    torch_path = resolve_backend(backend, query.device, _OP) == "torch"
    if bounded and (torch_path or not prefixes):
        from .bounded import bounded_cascade_attention

        out, lse = bounded_cascade_attention(
            query, key, value, [k for k, _, _ in prefixes], [v for _, v, _ in prefixes],
            [plan.node_starts_dev for _, _, plan in prefixes],
            [torch.tensor(plan.row_node, dtype=torch.int64, device=query.device) for _, _, plan in prefixes],
            key_lower, suffix_lower, scale=scale, mask=mask, causal=causal, softcap=softcap, key_length=key_length)
        return out.to(query.dtype), lse
    if torch_path or not prefixes:
        mask = mask_with_key_length(mask, key_length, query.shape[2], key.shape[2], causal, key.device)
        if not torch_path:  # no prefix level: the suffix kernel alone
            return suffix_attention(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                                    backend=backend)
        return cascade_attention_torch(query, key, value, prefixes, scale=scale, mask=mask, causal=causal,
                                       softcap=softcap)
    return _cascade_triton(query, key, value, prefixes, scale=scale, mask=mask, causal=causal, softcap=softcap,
                           key_length=key_length, key_lower=key_lower, suffix_lower=suffix_lower)


def _check_bounds(key_lower, suffix_lower, query: Tensor, prefixes) -> bool:
    """Validate the per-query lower bounds (see :func:`cascade_attention`); True when given."""
    if key_lower is None and suffix_lower is None:
        return False
    B, Lq = query.shape[0], query.shape[2]
    if key_lower is None or suffix_lower is None or len(key_lower) != len(prefixes):
        raise ValueError(
            f"{_OP}: pass `key_lower` (one int64 [B, Lq] tensor per prefix level: {len(prefixes)}) and "
            f"`suffix_lower` (int64 [B, Lq]) together; got {None if key_lower is None else len(key_lower)} level "
            f"bounds and {'no' if suffix_lower is None else 'a'} suffix bound."
        )
    for name, bound in [*((f"key_lower[{i}]", b) for i, b in enumerate(key_lower)), ("suffix_lower", suffix_lower)]:
        if bound.dtype != torch.int64 or tuple(bound.shape) != (B, Lq) or bound.device != query.device:
            raise ValueError(
                f"{_OP}: `{name}` must be int64 [B, Lq] = [{B}, {Lq}] on {query.device} (the first visible key "
                f"column of each query); got {bound.dtype} {tuple(bound.shape)} on {bound.device}."
            )
    return True


_FUSE_MIN_ROWS = 64  # prefix query rows per KV head and node (rows x G x Lq) below which fusing never paid
_FUSE_SUFFIX_RATIO = 0.75  # fuse when the suffix's HBM time >= this x the prefix pass's estimated time
_HBM_BYTES_PER_S = 2.9e12  # H100 device-to-device copy (read + write), measured
_DOT_FLOPS_PER_S = 4.0e14  # the prefix kernel's measured tensor-core rate (bf16, B*G >= 256, H100)


def _fuse_suffix(query: Tensor, key: Tensor, prefixes, shape_only: bool = False) -> bool:
    """Cost model: run the last level's prefix programs and the suffix programs in one launch?

    Overlapping the passes pays when the suffix's memory traffic is large next to the prefix pass
    (long suffixes, or a short prefix at large batch): measured on an H100, B=64: P=4K/S=256 fused
    0.043 vs 0.057 ms, P=16K/S=1K 0.127 vs 0.149; but P=16K/S=256 0.101 vs 0.083 and B=128,
    P=16K/S=128 0.183 vs 0.114 (the fused prefix programs use smaller tiles to share the SM). Only
    for 16-bit inputs with head_dim <= 128 (else the fused kernel's registers spill). The
    interpreter (CI) always takes the fused path. ``shape_only``: decide from tensor shapes alone (every
    row on one node: rows B, key-row pairs B*T), as a compiled step whose layout changes between replays must.
    """
    if query.device.type != "cuda":
        return True
    if query.dtype == torch.float32 or padded_head_dim(query.shape[-1]) > 128:
        return False
    B, Hq, Lq, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    g_lq = Hq // Hkv * Lq
    if shape_only:
        sizes = [(B, k_pre.shape[1], B * k_pre.shape[1]) for k_pre, _, _ in prefixes]
    else:
        sizes = [(max(plan.rows_per_node, default=0), plan.total_keys, plan.key_row_pairs) for _, _, plan in prefixes]
    if max(rows for rows, _, _ in sizes) * g_lq < _FUSE_MIN_ROWS:
        return False
    e = query.element_size()
    t_prefix = sum(max(2 * Hkv * D * e * keys / _HBM_BYTES_PER_S, 4 * D * Lq * Hq * pairs / _DOT_FLOPS_PER_S)
                   for _, keys, pairs in sizes)
    t_suffix = 2 * B * Hkv * S * D * e / _HBM_BYTES_PER_S
    return t_suffix >= _FUSE_SUFFIX_RATIO * t_prefix


def launch_configs(query: Tensor, key: Tensor, prefixes, fuse_suffix: bool | None = None,
                   shape_only: bool = False) -> tuple[bool, list]:
    """The Triton launch choices of a call with these shapes: (fuse the suffix into the last level's launch?,
    per level ``(schedule, splits, BLOCK_M, BLOCK_N, num_warps, num_stages)``). ``prefixes``: per level
    ``(prefix_key, _, PrefixPlan or a ready _Schedule)``. ``shape_only``: every choice from tensor shapes alone,
    so that a compiled step replayed with another layout keeps valid choices (see ``ops/cascade_wrapper.py``).
    Cached in the plans: calling this once ahead (before CUDA-graph capture) leaves the call nothing to allocate
    but outputs."""
    if fuse_suffix is None:
        fuse_suffix = _fuse_suffix(query, key, prefixes, shape_only)
    if not shape_only:
        return fuse_suffix, [_prefix_launch_config(query, k_pre, plan, None, None, None, fused=fuse_suffix)
                             for k_pre, _, plan in prefixes]
    B, Hq, Lq, D = query.shape
    configs = []
    for k_pre, _, plan in prefixes:
        Hkv, T = k_pre.shape[0], k_pre.shape[1]
        G = Hq // Hkv
        block_m, block_n, num_warps, num_stages = _prefix_config(D, B * G * Lq, query.device, fused=fuse_suffix)
        sched = plan.schedule(G * Lq, block_m) if isinstance(plan, PrefixPlan) else plan
        splits = _num_splits_for(T, sched.num_tiles, Hkv, block_n, query.device)
        configs.append((sched, splits, block_m, block_n, num_warps, num_stages))
    return fuse_suffix, configs


def _cascade_triton(query, key, value, prefixes, *, scale, mask, causal, softcap, fuse_suffix: bool | None = None,
                    key_length: Tensor | None = None, key_lower=None, suffix_lower=None):
    """Triton launches with the launch choices of this layout (see :func:`launch_cascade`)."""
    fuse_suffix, configs = launch_configs(query, key, prefixes, fuse_suffix)
    return launch_cascade(query, key, value, [(k, v) for k, v, _ in prefixes], configs, fuse_suffix,
                          scale=scale, mask=mask, causal=causal, softcap=softcap, key_length=key_length,
                          key_lower=key_lower, suffix_lower=suffix_lower)


def launch_cascade(query, key, value, prefix_kv, configs, fuse_suffix, *, scale, mask, causal, softcap,
                   key_length: Tensor | None = None, key_lower=None, suffix_lower=None):
    """Triton launches of one cascade attention call. ``fuse_suffix``: the last level's prefix programs and the
    suffix programs share one launch and a combine kernel merges all states (L + 1 launches); else the suffix
    kernel merges the prefix states in its prologue (also L + 1 launches, no overlap of the two passes).

    ``prefix_kv``: per level ``(prefix_key, prefix_value)``; ``configs``: per level from :func:`launch_configs`;
    ``key_length``, ``key_lower``, ``suffix_lower``: as in :func:`cascade_attention` (validated).
    """
    lowers = [None] * len(prefix_kv) if key_lower is None else list(key_lower)
    B, Hq, Lq, _ = query.shape
    Hkv, D = key.shape[1], value.shape[-1]  # D: the values' head_dim (the states' and the output's)
    G = Hq // Hkv
    dev = query.device
    slots = sum(cfg[1] for cfg in configs) + (1 if fuse_suffix else 0)
    m_total = B * Lq * G
    part_out = torch.empty((slots, Hkv, m_total, D), dtype=torch.float32, device=dev)
    part_lse = torch.empty((slots, Hkv, m_total), dtype=torch.float32, device=dev)
    o_strides, l_strides = partial_strides(part_out, part_lse, Lq, G, D)
    if not fuse_suffix:
        slot0 = 0
        for (k_pre, v_pre), cfg, lower in zip(prefix_kv, configs, lowers):
            if m_total:
                launch_prefix(query, k_pre, v_pre, None, cfg, part_out, part_lse, o_strides, l_strides, slot0,
                              scale=scale, softcap=softcap, lower=lower)
            slot0 += cfg[1]
        return launch_suffix(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap,
                             states=(part_out, part_lse, slots, (*o_strides, 1), l_strides), key_length=key_length,
                             lower=suffix_lower)
    # [B, Lq, Hq, D] memory so that transformers' out.transpose(1, 2) is free.
    out = torch.empty((B, Lq, Hq, D), dtype=query.dtype, device=dev).transpose(1, 2)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    if m_total == 0:
        return out, lse
    slot0 = 0
    for (k_pre, v_pre), cfg, lower in zip(prefix_kv[:-1], configs[:-1], lowers[:-1]):
        launch_prefix(query, k_pre, v_pre, None, cfg, part_out, part_lse, o_strides, l_strides, slot0,
                      scale=scale, softcap=softcap, lower=lower)
        slot0 += cfg[1]
    k_pre, v_pre = prefix_kv[-1]
    _launch_fused(query, k_pre, v_pre, configs[-1], key, value, mask, causal, part_out, part_lse,
                  o_strides, l_strides, slot0, slots - 1, scale=scale, softcap=softcap, key_length=key_length,
                  lowers=None if key_lower is None else (lowers[-1], suffix_lower))
    launch_combine(out, lse, part_out, part_lse, G)
    return out, lse


def _launch_fused(query, k_pre, v_pre, config, key, value, mask, causal, part_out, part_lse, o_strides,
                  l_strides, slot0, suffix_slot, *, scale, softcap, key_length=None, lowers=None):
    """One launch: the prefix programs of one level (slots slot0...) + the suffix programs (suffix_slot).
    ``lowers``: None, or (the level's, the suffix's) per-query lower bounds int64 [B, Lq]."""
    from . import _cascade_kernel as kernels  # lazy: triton is optional
    from ._suffix_kernel import MASK_CAUSAL, MASK_FULL, MASK_TENSOR

    sched, splits, block_mp, block_n, num_warps, num_stages = config
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    k_pre = k_pre if k_pre.stride(-1) == 1 else k_pre.contiguous()
    v_pre = v_pre if v_pre.stride(-1) == 1 else v_pre.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if mask is not None:
        mask_arg = mask.expand(B, Lq, S).view(torch.uint8)  # no copy; stride 0 if broadcast
        mask_strides = mask_arg.stride()
        mode = MASK_TENSOR.value
    else:
        mask_arg, mask_strides = key, (0, 0, 0)  # unused placeholder pointer
        mode = (MASK_CAUSAL if causal else MASK_FULL).value
    block_ms = min(64, max(16, 1 << max(G * Lq - 1, 0).bit_length()))
    if query.device.type != "cuda":
        block_ms = min(block_ms, 32)
    s_mtiles = -(-(G * Lq) // block_ms)
    n_prefix = sched.num_tiles * Hkv * splits
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    kernels._cascade_fwd_kernel[(n_prefix + B * Hkv * s_mtiles,)](
        query, k_pre, v_pre,
        sched.rows, sched.row_start, sched.node_starts, sched.tile_node, sched.tile_m0,
        *((sched.rows, sched.rows) if lowers is None else lowers),
        key, value, mask_arg, key if key_length is None else key_length, part_out, part_lse,
        Lq, S, G, D, Dv, Hkv, splits, slot0, suffix_slot, n_prefix, sched.num_tiles, s_mtiles,
        float(scale), float(softcap) if softcap is not None else 1.0,
        *query.stride(), *k_pre.stride()[:2], *v_pre.stride()[:2],
        *key.stride()[:3], *value.stride()[:3], *mask_strides,
        *((0, 0, 0, 0) if lowers is None else (*lowers[0].stride(), *lowers[1].stride())),
        *o_strides, *l_strides,
        MASK_MODE=mode,
        HAS_SOFTCAP=softcap is not None,
        HAS_KEY_LEN=key_length is not None,
        HAS_LOWER=lowers is not None,
        EVEN_D=block_d == D, EVEN_DV=block_dv == Dv,
        INPUT_PRECISION=dot_precision(query.dtype),
        BLOCK_MP=block_mp, BLOCK_MS=block_ms, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=num_warps, num_stages=num_stages,
    )
