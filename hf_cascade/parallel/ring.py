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


def _scratch(buffer: torch.Tensor | None, numel: int, like: torch.Tensor, who: str) -> torch.Tensor:
    """``buffer`` (a flat scratch tensor a caller keeps from call to call) checked to hold ``numel`` elements of
    ``like``'s dtype on its device; a new one where None."""
    if buffer is None:
        return like.new_empty(numel)
    if buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
        raise ValueError(f"{who}: the buffer must be {like.dtype} on {like.device} with at least {numel} elements; "
                         f"got {buffer.dtype} on {buffer.device} with {buffer.numel()}.")
    return buffer


def _start_ring_exchange(block: torch.Tensor, info: GroupInfo, recv: torch.Tensor) -> list:
    """Send ``block`` to the next rank and receive the previous rank's block into ``recv`` (async). Returns the
    works."""
    ops = [
        dist.P2POp(dist.isend, block, info.peer(info.rank + 1), info.group),
        dist.P2POp(dist.irecv, recv, info.peer(info.rank - 1), info.group),
    ]
    return dist.batch_isend_irecv(ops)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs):
    """Exact causal attention of this rank's zigzag shard of queries over the whole (sharded) sequence:
    :func:`ring_states` with the output in ``query.dtype``: ``(out [B, Hq, 2c, D], lse [B, Hq, 2c] float32)``."""
    out, lse = ring_states(query, key, value, **kwargs)
    return out.to(query.dtype), lse


def ring_states(
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
    exchange: torch.Tensor | None = None,
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
        exchange: optional flat tensor of key's dtype and device with at least :func:`ring_exchange_numel`
            elements (contents ignored and overwritten): the two K/V blocks that travel round the ring, sent from one
            and received into the other in turn (one block on one rank). None: made per call.
    Returns:
        ``(out [B, Hq, 2c, D] float32, lse [B, Hq, 2c] float32)``. A query that sees no valid key
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
        return query.new_zeros(query.shape, dtype=torch.float32), query.new_full((B, Hq, 0), float("-inf"),
                                                                                  dtype=torch.float32)
    rank, n = info.rank, info.world_size
    own_cols = layout.columns(rank, query.device)

    def valid(src: int, half: slice) -> torch.Tensor:  # [B, keys of src's block half]
        return key_valid.index_select(1, layout.columns(src, query.device)[half])

    shape, half = (2, *key.shape), 2 * key.numel()  # [2, B, Hkv, 2c, D]: K and V, one message per step
    buffer = _scratch(exchange, ring_exchange_numel(key) if n > 1 else half, key, "ring_states")
    block, spare = buffer[:half].view(shape), (buffer[half:2 * half].view(shape) if n > 1 else None)
    block[0].copy_(key)
    block[1].copy_(value)
    out_acc = lse_acc = None
    for step in range(n):
        src = (rank - step) % n
        works = _start_ring_exchange(block, info, spare) if step + 1 < n else None
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
        if works is not None:
            for work in works:
                work.wait()
            # The block just sent is the next receive's buffer: its send is complete, and a receive into it is
            # issued after this step's attention on it (NCCL's stream waits for the compute stream).
            block, spare = spare, block
    return out_acc, lse_acc


def ring_exchange_numel(key: torch.Tensor) -> int:
    """Elements of :func:`ring_states`' ``exchange`` for this rank's ``key`` ``[B, Hkv, 2c, D]``: two K/V blocks."""
    return 4 * key.numel()


def past_state(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, info: GroupInfo, scale: float,
               valid: torch.Tensor | None = None, softcap: float | None = None, block_backend: str = "auto",
               workspace: torch.Tensor | None = None):
    """Exact attention of this rank's queries over the keys EVERY rank stores from earlier prefill rounds.

    All of those keys precede all of the queries (no causal mask). The ranks' queries are all-gathered, each rank
    attends every rank's block of them to its own stored keys, and one all-to-all returns each rank the states of
    its queries, merged by log-sum-exp. Traffic: queries and states, never the stored KV. A collective: every rank
    calls it in the same round (a rank storing no keys yet passes ``keys`` with 0 columns).

    Memory: two ``[world_size, B, Hq, Lq, D]`` buffers in query's dtype (the gathered queries, reused to receive
    the states, and the states to send), taken from ``workspace`` when given, so a prefill of many layers and
    rounds allocates them once; one rank's block of states at a time beside them.

    Args:
        query: ``[B, Hq, Lq, D]`` this rank's queries (``Lq`` the same on every rank).
        keys, values: ``[B, Hkv, P_r, D]`` this rank's stored keys/values (any ``P_r >= 0``), query's dtype.
        info: the process group.
        scale: softmax scale.
        valid: bool ``[B, P_r]`` (False = a left-padding key no query may see) or None (all valid).
        softcap: Gemma-2 style score soft-capping.
        block_backend: the attention call's kernel (:func:`block_attention`).
        workspace: optional flat tensor of query's dtype and device with at least
            :func:`past_state_workspace_numel` elements (contents ignored and overwritten).
    Returns:
        ``(out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32)``; a query that sees no key gets out 0, lse -inf.
    """
    from hf_cascade.ops.merge_states import merge_states
    from hf_cascade.parallel.combine import _all_gather_flat

    B, Hq, Lq, D = query.shape
    n = info.world_size
    if n == 1:
        out, lse = _attend_past(query, keys, values, valid, scale, softcap, block_backend)
        return out.float(), lse
    numel = n * query.numel()
    workspace = _scratch(workspace, past_state_workspace_numel(query, n), query, "past_state")
    gathered = workspace[:numel].view(n, B, Hq, Lq, D)  # every rank's queries; then the states received
    send = workspace[numel:2 * numel].view(n, B, Hq, Lq, D)  # this rank's states of every rank's queries
    send_lse = query.new_empty((n, B, Hq, Lq), dtype=torch.float32)
    _all_gather_flat(gathered, query, info)
    for src in range(n):
        out, lse = _attend_past(gathered[src], keys, values, valid, scale, softcap, block_backend)
        send[src].copy_(out)
        send_lse[src].copy_(lse)
        del out, lse
    got_lse = torch.empty_like(send_lse)
    dist.all_to_all_single(gathered, send, group=info.group)
    dist.all_to_all_single(got_lse, send_lse, group=info.group)
    return merge_states(gathered, got_lse, out_dtype=torch.float32)


def past_state_workspace_numel(query: torch.Tensor, world_size: int) -> int:
    """Elements of :func:`past_state`'s ``workspace`` for ``query`` ``[B, Hq, Lq, D]`` on ``world_size`` ranks."""
    return 2 * world_size * query.numel()


def _attend_past(query, keys, values, valid, scale, softcap, block_backend):
    """``query`` ``[B, Hq, Lq, D]`` against every stored key (no causal mask): ``(out, lse [B, Hq, Lq] float32)``,
    out 0 / lse -inf where no key is stored."""
    B, Hq, Lq, D = query.shape
    P = keys.shape[2]
    if P == 0:
        return query.new_zeros(query.shape), query.new_full((B, Hq, Lq), float("-inf"), dtype=torch.float32)
    mask = None if valid is None else valid[:, None, :].expand(B, Lq, P)
    return block_attention(query, keys, values, scale=scale, mask=mask, causal=False, softcap=softcap,
                           backend=block_backend)
