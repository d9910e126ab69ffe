"""Causal zigzag ring attention (the context-parallel prefill).

Rank ``r`` of ``N`` holds the queries and keys/values of its zigzag shard (chunks ``r`` and ``2N-1-r`` of
:class:`~hf_cascade.parallel.layout.ZigzagLayout`). In ``N`` steps every rank sees every rank's K/V: at step
``s`` it holds the block of rank ``src = (r - s) mod N``, starts sending that block to rank ``r + 1`` and
receiving the next one from rank ``r - 1`` (one ``batch_isend_irecv``: on NCCL the transfer runs on its own
stream while this block is computed), attends, and merges into an fp32 accumulator by LSE. Blocks travel
with the KV-head count (GQA/MQA: no ``repeat_kv``), K and V packed in one message.

Thanks to the zigzag layout each step is one dense, mask-free attention call of half the block size:

* ``src == r``: local queries against local keys, plain causal (local columns are ascending);
* ``src < r``:  all local queries against the first half of the block (the second half is in the future);
* ``src > r``:  the second half of the local queries against the whole block (the first half sees none of it).

A per-key validity mask (left-padded batches) adds an explicit bool mask to each call.

Each block runs the fastest exact kernel that returns the LSE (:func:`block_attention`): PyTorch's cuDNN attention
(else its flash kernel; :mod:`hf_cascade.ops.fused_attention`) for unmasked fp16/bf16 blocks on CUDA, the kernel sdpa
itself picks on Hopper;
hf_cascade's suffix kernel (Triton; the PyTorch reference on CPU) for the rest (masks, soft-capping, fp32).
"""


from __future__ import annotations

import torch
import torch.distributed as dist

from hf_cascade.ops.fused_attention import fused_attention, use_fused_attention
from hf_cascade.ops.merge import merge_attention_states
from hf_cascade.ops.suffix_attention import suffix_attention
from hf_cascade.parallel._group import GroupInfo
from hf_cascade.parallel.layout import ZigzagLayout

def block_attention(query, key, value, *, scale: float, mask=None, causal: bool, softcap=None,
                    backend: str = "auto"):
    """One ring block: ``(out [B, Hq, Lq, D] in query.dtype, lse [B, Hq, Lq] float32)``.

    ``backend``: ``"auto"`` (PyTorch's cuDNN / flash kernel where it applies on CUDA, else the suffix kernel),
    ``"fused"`` (the fused kernel wherever it applies, CPU included: for tests), ``"suffix"`` (always the suffix
    kernel); see :func:`~hf_cascade.ops.fused_attention.use_fused_attention`. ``causal`` with ``mask=None`` is the
    own block's ``Lq == Lk`` causal mask (ascending local columns).
    """
    if use_fused_attention(query, key, backend, mask=mask, softcap=softcap):
        return fused_attention(query, key, value, scale=scale, causal=causal, kernel="cudnn")
    return suffix_attention(query, key, value, scale=scale, mask=mask, causal=causal, softcap=softcap)


def _start_ring_exchange(block: torch.Tensor, info: GroupInfo) -> tuple[torch.Tensor, list]:
    """Send ``block`` to the next rank and receive the previous rank's block (async). Returns (recv buffer, works)."""
    recv = torch.empty_like(block)
    ops = [
        dist.P2POp(dist.isend, block, info.peer(info.rank + 1), info.group),
        dist.P2POp(dist.irecv, recv, info.peer(info.rank - 1), info.group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: ZigzagLayout,
    info: GroupInfo,
    scale: float,
    key_valid: torch.Tensor | None = None,
    softcap: float | None = None,
    block_backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of this rank's zigzag shard of queries over the whole (sharded) sequence.

    Args:
        query: ``[B, Hq, 2c, D]`` this rank's queries (``c = layout.chunk``), global columns
            ``layout.columns(info.rank)``; float32/float16/bfloat16.
        key, value: ``[B, Hkv, 2c, D]`` this rank's keys/values, same columns, query's dtype (``Hq % Hkv == 0``).
        layout: the zigzag layout of the sequence (``layout.world_size == info.world_size``).
        info: the process group.
        scale: softmax scale.
        key_valid: optional bool ``[B, layout.padded_length]`` over global columns, False = a padding key
            (left-padded rows) no query may attend. Every rank passes the same tensor. None = all valid.
        softcap: Gemma-2 style score soft-capping.
        block_backend: the kernel of each block (:func:`block_attention`).
    Returns:
        ``(out [B, Hq, 2c, D] in query.dtype, lse [B, Hq, 2c] float32)``. A query that sees no valid key
        (a left-padding query) gets out 0, lse -inf.
    """
    B, Hq, Lq, D = query.shape
    c = layout.chunk
    if layout.world_size != info.world_size:
        raise ValueError(
            f"ring_attention: layout is for {layout.world_size} ranks but the process group has {info.world_size}."
        )
    if Lq != 2 * c or key.shape[2] != 2 * c or key.shape != value.shape:
        raise ValueError(
            f"ring_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            f"must each hold this rank's 2 * chunk = {2 * c} zigzag columns on dim 2."
        )
    if key_valid is not None and (key_valid.dtype != torch.bool or tuple(key_valid.shape) != (B, layout.padded_length)):
        raise ValueError(
            f"ring_attention: key_valid must be bool [B, padded_length] = [{B}, {layout.padded_length}]; got "
            f"{key_valid.dtype} with shape {tuple(key_valid.shape)}."
        )
    if Lq == 0:
        return query.new_zeros(query.shape), query.new_full((B, Hq, 0), float("-inf"), dtype=torch.float32)
    rank, n = info.rank, info.world_size
    own_cols = layout.columns(rank, query.device)

    def valid(src: int, half: slice) -> torch.Tensor:  # [B, keys of src's block half]
        return key_valid.index_select(1, layout.columns(src, query.device)[half])

    block = torch.stack([key, value])  # [2, B, Hkv, 2c, D]: one message per step
    out_acc = lse_acc = None
    for step in range(n):
        src = (rank - step) % n
        pending = _start_ring_exchange(block, info) if step + 1 < n else None
        k, v = block[0], block[1]
        if step == 0:  # own block: causal over ascending local columns
            mask = None
            if key_valid is not None:
                mask = (own_cols[None, :] <= own_cols[:, None])[None] & valid(src, slice(None))[:, None, :]
            o, lse = block_attention(query, k, v, scale=scale, mask=mask, causal=True, softcap=softcap,
                                     backend=block_backend)
            out_acc, lse_acc = o.float(), lse
        elif src < rank:  # block's first chunk precedes all our columns, its second follows them
            mask = None if key_valid is None else valid(src, slice(0, c))[:, None, :].expand(B, Lq, c)
            o, lse = block_attention(query, k[:, :, :c], v[:, :, :c], scale=scale, mask=mask, causal=False,
                                     softcap=softcap, backend=block_backend)
            out_acc, lse_acc = merge_attention_states(out_acc, lse_acc, o, lse)
        else:  # both block chunks lie between our two chunks: only our second chunk sees them
            mask = None if key_valid is None else valid(src, slice(None))[:, None, :].expand(B, c, 2 * c)
            o, lse = block_attention(query[:, :, c:], k, v, scale=scale, mask=mask, causal=False, softcap=softcap,
                                     backend=block_backend)
            merged_out, merged_lse = merge_attention_states(out_acc[:, :, c:], lse_acc[:, :, c:], o, lse)
            out_acc[:, :, c:] = merged_out
            lse_acc[:, :, c:] = merged_lse
        if pending is not None:
            recv, works = pending
            for work in works:
                work.wait()
            block = recv
    return out_acc.to(query.dtype), lse_acc
