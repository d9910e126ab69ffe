"""Every Triton launch of cascade attention: the launch choices (tiles, KV splits, fused suffix or not) and the
launches of the prefix, suffix, fused and state-combine kernels (``_prefix_kernel``, ``_suffix_kernel``,
``_cascade_kernel``). The public ops validate their inputs and call one of :func:`cascade_triton`,
:func:`prefix_triton` and :func:`suffix_triton` (eager calls, launch choices from the plan), or
:func:`launch_configs` then :func:`launch_cascade` (compiled and recorded steps: launch choices from shapes alone).

Inputs here are validated already. Importing this module never imports Triton: the kernel modules are imported at
the first launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import dot_precision, num_programs_target, padded_head_dim
from .plan import PrefixPlan
from .reference import _empty_guard

__all__ = ["cascade_triton", "launch_cascade", "launch_combine", "launch_configs", "launch_prefix", "launch_suffix",
           "partial_strides", "prefix_triton", "suffix_triton"]

_MIN_KEYS_PER_SPLIT = 128  # below this a KV split costs more (partials + combine) than it saves
_FUSE_MIN_ROWS = 64  # prefix query rows per KV head and node (rows x G x Lq) below which fusing never paid
_FUSE_SUFFIX_RATIO = 0.75  # fuse when the suffix's HBM time >= this x the prefix pass's estimated time
_HBM_BYTES_PER_S = 2.9e12  # H100 device-to-device copy (read + write), measured
_DOT_FLOPS_PER_S = 4.0e14  # the prefix kernel's measured tensor-core rate (bf16, B*G >= 256, H100)


def cascade_triton(query, key, value, prefixes, *, scale, mask, causal, softcap, fuse_suffix: bool | None = None,
                   key_length: Tensor | None = None, key_lower=None, suffix_lower=None):
    """:func:`~hf_cascade.ops.cascade_attention`'s Triton path with the launch choices of this layout (see
    :func:`launch_cascade`); no prefix level: the suffix kernel alone."""
    if not prefixes:
        return launch_suffix(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap, states=None,
                             key_length=key_length, lower=suffix_lower)
    fuse_suffix, configs = launch_configs(query, key, prefixes, fuse_suffix)
    return launch_cascade(query, key, value, [(k, v) for k, v, _ in prefixes], configs, fuse_suffix,
                          scale=scale, mask=mask, causal=causal, softcap=softcap, key_length=key_length,
                          key_lower=key_lower, suffix_lower=suffix_lower)


def prefix_triton(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: PrefixPlan,
    *,
    scale: float,
    softcap: float | None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`~hf_cascade.ops.shared_prefix_attention`'s Triton path. ``num_splits`` / ``block_m`` / ``block_n``
    override the heuristics (tests)."""
    B, Hq, Lq, _ = query.shape
    Hkv, D = key.shape[0], value.shape[-1]  # D: the values' head_dim (the output's)
    G = Hq // Hkv
    dev = query.device
    out = torch.empty((B, Hq, Lq, D), dtype=torch.float32, device=dev)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    config = prefix_launch_config(query, key, plan, num_splits, block_m, block_n)
    splits = config[1]
    if splits == 1:  # states go straight to out / lse
        launch_prefix(query, key, value, plan, config, out, lse,
                      (0, out.stride(0), G * out.stride(1), out.stride(1), out.stride(2)),
                      (0, lse.stride(0), G * lse.stride(1), lse.stride(1), lse.stride(2)),
                      0, scale=scale, softcap=softcap)
        return out, lse
    m_total = B * Lq * G
    part_out = torch.empty((splits, Hkv, m_total, D), dtype=torch.float32, device=dev)
    part_lse = torch.empty((splits, Hkv, m_total), dtype=torch.float32, device=dev)
    launch_prefix(query, key, value, plan, config, part_out, part_lse,
                  *partial_strides(part_out, part_lse, Lq, G, D), 0, scale=scale, softcap=softcap)
    launch_combine(out, lse, part_out, part_lse, G)
    return out, lse


def suffix_triton(
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
    """:func:`~hf_cascade.ops.suffix_attention`'s Triton path. ``block_m`` / ``block_n`` override the heuristics
    (tests)."""
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
        return fuse_suffix, [prefix_launch_config(query, k_pre, plan, None, None, None, fused=fuse_suffix)
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


def fused_up_to_prefix_keys(rows: int, suffix_columns: int) -> float:
    """Keys of a one-node prefix level up to which :func:`_fuse_suffix` may fuse a decode step of ``rows`` rows with
    ``suffix_columns`` suffix-buffer columns (its HBM terms: the suffix traffic ``rows x suffix_columns`` against the
    prefix's keys; the tensor-core term only lowers it). Longer prefixes run the prefix pass apart (other tiles,
    other kernel variants: ``warmup`` builds those with a prefix past this)."""
    return rows * suffix_columns / _FUSE_SUFFIX_RATIO


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


def prefix_launch_config(query: Tensor, key: Tensor, plan: PrefixPlan, num_splits: int | None,
                          block_m: int | None, block_n: int | None, fused: bool = False):
    """(schedule, splits, BLOCK_M, BLOCK_N, num_warps, num_stages); cached per call shape."""
    B, Hq, Lq, D = query.shape
    Hkv = key.shape[0]
    G = Hq // Hkv
    cfg_key = (G, Lq, D, Hkv, num_splits, block_m, block_n, fused)
    cached = plan._tiles.get(cfg_key)
    if cached is None:
        m_node = max(plan.rows_per_node, default=0) * G * Lq
        cfg_m, cfg_n, num_warps, num_stages = _prefix_config(D, m_node, query.device, fused=fused)
        bm, bn = block_m or cfg_m, block_n or cfg_n
        sched = plan.schedule(G * Lq, bm)
        splits = num_splits or _num_splits_for(plan.max_node_len, sched.num_tiles, Hkv, bn, query.device)
        cached = plan._tiles[cfg_key] = (sched, splits, bm, bn, num_warps, num_stages)
    return cached


def _prefix_config(D: int, m_node: int, device: torch.device, *, fused: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``m_node`` query rows on the largest node.

    BLOCK_M covers the node's rows x group x positions up to 128 (tensor-core M; 64 and 128 use
    Hopper's wgmma with 4 / 8 warps). ``fused`` (prefix programs sharing a launch with the suffix
    programs): at most 64 rows and 4 warps, so that two programs fit on one SM. Measured on an H100
    (benchmarks/NOTES.md): BLOCK_N 64 with 3 stages is best or within 3% at every decode shape.
    """
    block_d = padded_head_dim(D)
    if device.type != "cuda":
        return 32, 64, 4, 1  # interpreter: small tiles keep numpy work per step low
    block_m = min(64 if fused else 128, max(16, 1 << max(m_node - 1, 0).bit_length()))
    if block_d >= 256:
        return min(block_m, 64), 32, 4 if block_m <= 16 or fused else 8, 2
    if block_m >= 128:
        return 128, 64, 8, 3
    return block_m, 64, 4, 3


def _num_splits_for(keys: int, tiles: int, hkv: int, block_n: int, device: torch.device) -> int:
    """KV splits for a longest node of ``keys`` keys (trailing splits of shorter nodes are empty): about one program
    per SM (measured best: 128 programs on the H100's 132 SMs, from B=1 to B=256), each split at least
    ``_MIN_KEYS_PER_SPLIT`` keys."""
    by_len = max(1, -(-keys // max(_MIN_KEYS_PER_SPLIT, block_n)))
    want = max(1, num_programs_target(device) // max(1, tiles * hkv))
    return max(1, min(by_len, want))


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

    sched, splits, block_mp, block_n, num_warps, num_stages = config
    B, Hq, Lq, D = query.shape
    Hkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = Hq // Hkv
    k_pre = k_pre if k_pre.stride(-1) == 1 else k_pre.contiguous()
    v_pre = v_pre if v_pre.stride(-1) == 1 else v_pre.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    mask_arg, mask_strides, mode = _mask_arg(mask, causal, key, B, Lq, S)
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


def launch_prefix(query: Tensor, key: Tensor, value: Tensor, plan: PrefixPlan, config, o: Tensor,
                  lse: Tensor, o_strides, lse_strides, slot0: int, *, scale: float,
                  softcap: float | None, lower: Tensor | None = None) -> None:
    """One prefix-kernel launch writing every (row, head, position) state into o / lse.

    ``o_strides`` = (slot, b, kvh, group, q) element strides of ``o`` (head_dim stride 1),
    ``lse_strides`` the same for ``lse``; split s goes to slot ``slot0 + s``. ``lower``: None, or int64 ``[B, Lq]``,
    each query's first visible column of ``key`` (sliding windows, chunks).
    """
    from . import _prefix_kernel as kernels  # lazy: triton is optional

    sched, splits, block_m, block_n, num_warps, num_stages = config
    Hkv = key.shape[0]
    B, Hq, Lq, D = query.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    Dv = value.shape[-1]
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    kernels._prefix_fwd_kernel[(sched.num_tiles, Hkv, splits)](
        query, key, value, o, lse,
        sched.rows, sched.row_start, sched.node_starts, sched.tile_node, sched.tile_m0,
        sched.rows if lower is None else lower,
        Lq, Hq // Hkv, D, Dv, splits, slot0,
        float(scale), float(softcap) if softcap is not None else 1.0,
        *query.stride(), *key.stride()[:2], *value.stride()[:2],
        *((0, 0) if lower is None else lower.stride()),
        *o_strides, *lse_strides,
        HAS_SOFTCAP=softcap is not None,
        HAS_LOWER=lower is not None,
        EVEN_D=block_d == D, EVEN_DV=block_dv == Dv,
        INPUT_PRECISION=dot_precision(query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=num_warps, num_stages=num_stages,
    )


def partial_strides(part_out: Tensor, part_lse: Tensor, Lq: int, G: int, D: int):
    """(slot, b, kvh, group, q) strides of split partials [slots, Hkv, B*Lq*G, D] / [..., B*Lq*G]."""
    return ((part_out.stride(0), Lq * G * D, part_out.stride(1), D, G * D),
            (part_lse.stride(0), Lq * G, part_lse.stride(1), 1, G))


def launch_combine(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, G: int, *,
                   block_m: int | None = None, slots_per_step: int | None = None,
                   num_warps: int | None = None) -> None:
    """Merge every slot of the fp32 states [slots, Hkv, B*Lq*G, D] into out [B, Hq, Lq, D] / lse.
    ``block_m`` (rows per program), ``slots_per_step`` (state loads in flight together), ``num_warps``: override
    the launch choice (tuning)."""
    from . import _prefix_kernel as kernels  # lazy: triton is optional

    B, Hq, Lq, D = out.shape
    slots, Hkv, m_total = part_lse.shape
    block_d = padded_head_dim(D)
    if block_m:
        block_c = block_m
    elif out.device.type != "cuda":
        block_c = 16
    else:  # the largest row block that still gives a program per SM: a few state loads per program, all in flight
        # (H100, B=32 decode, 9 slots: 8 rows 3.5 us, 16 rows 4.1 us; probe_decode_attention.py --sweep)
        sms = num_programs_target(out.device)
        block_c = next((bc for bc in (32, 16) if -(-m_total // bc) * Hkv >= sms), 8)
    kernels._state_combine_kernel[(-(-m_total // block_c), Hkv)](
        out, lse, part_out, part_lse,
        m_total, Lq, G, D, slots,
        *out.stride()[:3], *lse.stride(),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        EVEN_D=block_d == D, BLOCK_M=block_c, BLOCK_D=block_d, SLOTS_PER_STEP=slots_per_step or 2,
        num_warps=num_warps or 4,
    )


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
    mask_arg, mask_strides, mode = _mask_arg(mask, causal, key, B, Lq, S)
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


def _mask_arg(mask: Tensor | None, causal: bool, key: Tensor, B: int, Lq: int, S: int):
    """The suffix mask as the kernels read it: ``(pointer, (b, q, s) strides, MASK_MODE)``."""
    from ._suffix_kernel import MASK_CAUSAL, MASK_FULL, MASK_TENSOR  # lazy: triton is optional

    if mask is not None:
        mask_arg = mask.expand(B, Lq, S).view(torch.uint8)  # no copy; stride 0 if broadcast
        return mask_arg, mask_arg.stride(), MASK_TENSOR.value
    return key, (0, 0, 0), (MASK_CAUSAL if causal else MASK_FULL).value  # key: an unused placeholder pointer
