"""Fixed decode buffers for :class:`~hf_cascade.parallel.cache.ContextParallelCache` (compiled decode).

``context_parallel_inputs(..., max_new_tokens=N)`` keeps the prompt's KV as the ring prefill left it (this rank's
zigzag shard, plus any shared prefix) and gives every layer fixed buffers for the KV of the tokens generate()
feeds afterwards (the last prompt token and the generated ones: at most ``N``). Decode token ``t`` (``t = 0`` is
the last prompt token, global column ``prompt_length + t``) lives on rank ``(first_owner + t) % world_size`` in
slot ``t // world_size``: round-robin, so every rank holds ``ceil(N / world_size)`` columns at most. Each rank
writes every step in place at a device-side length (as ``StaticSuffixLayer`` does); a token it does not own goes
to one extra "trash" column that the mask never shows. So a decode step has no host ints that change from step
to step, no host synchronisation and fixed addresses: ``is_compileable`` is True and generate() compiles the step
(``torch.compile(fullgraph=True)``; the per-layer combine then runs functional collectives, see
:mod:`~hf_cascade.parallel.combine`).

Attention of one layer on this rank (:func:`attend_fixed`), merged by LSE: the shared-prefix shard (every row
reads it), the row shard of the prompt (masked by the prompt's padding, ``row_valid``), then the decode buffers
(masked by column: a written column at or before the query's own); then the cross-rank combine.
"""

from __future__ import annotations

import torch

from hf_cascade.step_context import static_step
from hf_cascade.ops.fused_attention import fused_attention, use_fused_attention
from hf_cascade.ops.merge import merge_attention_states
from hf_cascade.ops.suffix_attention import suffix_attention
from hf_cascade.parallel._group import GroupInfo
from hf_cascade.parallel.combine import combine_states

_UNWRITTEN = 2**62  # column of a slot holding no token (greater than every query's column: always masked)


def check_max_new_tokens(max_new_tokens) -> int | None:
    """Validate ``max_new_tokens`` (None = growing storage, no compile); returns it."""
    if max_new_tokens is None:
        return None
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(
            f"`max_new_tokens` must be None (decode KV grows as needed, eager decode) or a positive int, the most "
            f"tokens generate() will produce (fixed decode buffers, compileable); got {max_new_tokens!r}."
        )
    return max_new_tokens


class DecodeBuffers:
    """One layer's decode-time KV on this rank, in fixed buffers.

    Attributes:
        keys, values: ``[batch, num_kv_heads, capacity + 1, head_dim]`` (None before the first write); the last
            column is the trash column.
        cols: int64 ``[capacity + 1]`` global column of each slot (``_UNWRITTEN`` for empty slots and the trash).
        length: int64 device scalar, decode tokens written so far over ALL ranks (the same on every rank).
        capacity: ``ceil(max_new_tokens / world_size)`` slots per rank.
    """

    def __init__(self, max_new_tokens: int, info: GroupInfo, first_owner: int, start_column: int,
                 device: torch.device):
        self.max_new_tokens = max_new_tokens
        self.rank, self.world_size = info.rank, info.world_size
        self.first_owner = first_owner
        self.start_column = start_column
        self.capacity = -(-max_new_tokens // info.world_size)
        self.device = device
        self.keys = self.values = None
        self.cols = torch.full((self.capacity + 1,), _UNWRITTEN, dtype=torch.int64, device=device)
        self.length = torch.zeros((), dtype=torch.int64, device=device)
        # Host mirror of `length` for eager bounds checks; compiled steps mark it stale (as StaticSuffixLayer).
        self._host_length, self._host_stale = 0, False
        self._mark_static(self.cols, self.length)

    @staticmethod
    def _mark_static(*tensors: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():  # fixed addresses for CUDA graphs; a new cache re-records
            for tensor in tensors:
                torch._dynamo.mark_static_address(tensor, guard=False)

    @property
    def host_length(self) -> int:
        """Decode tokens written (all ranks), as a host int (synchronises only after compiled steps)."""
        if self._host_stale:
            self._host_length, self._host_stale = int(self.length), False
        return self._host_length

    def _allocate(self, key_states: torch.Tensor) -> None:
        B, Hkv, _, D = key_states.shape
        shape = (B, Hkv, self.capacity + 1, D)
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=key_states.dtype, device=self.device)
        self._mark_static(self.keys, self.values)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the new ``[batch, num_kv_heads, q_len, head_dim]`` KV this rank owns, in place.

        Raises:
            ValueError: (eager steps) more than ``max_new_tokens`` decode tokens.
        """
        q_len = key_states.shape[2]
        if self.keys is None or self.keys.shape[0] != key_states.shape[0]:
            self._allocate(key_states)  # generate()'s first forward (batch expanded for beams / sequences)
        if static_step():  # a compiled or recorded step: device work only
            self._host_stale = True
        else:
            total = self.host_length + q_len
            if total > self.max_new_tokens:
                raise ValueError(
                    f"This ContextParallelCache has fixed decode buffers for {self.max_new_tokens} tokens after the "
                    f"prompt and this step would make {total}. Pass a larger `max_new_tokens` to "
                    "context_parallel_inputs (at least generate()'s max_new_tokens), or lower generate()'s."
                )
            self._host_length = total
        index = self.length + torch.arange(q_len, device=self.device)  # global decode indices of the new tokens
        owned = (index + self.first_owner) % self.world_size == self.rank
        slot = torch.where(owned, index // self.world_size, self.capacity)  # not ours: the trash column
        self.length.add_(q_len)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.cols.index_copy_(0, slot, torch.where(owned, index + self.start_column, _UNWRITTEN))

    def mask(self, query_length: int) -> torch.Tensor:
        """bool ``[1, q_len, capacity + 1]``: a slot is visible to a query at or after its column."""
        last = self.start_column + self.length - query_length + torch.arange(query_length, device=self.device)
        return (self.cols[None, :] <= last[:, None])[None]

    def reset(self) -> None:
        """Drop every decode token (the buffers keep their addresses)."""
        self.truncate(0)

    def truncate(self, decode_tokens: int) -> None:
        """Keep the first ``decode_tokens`` decode tokens (host int, eager only)."""
        self.length.fill_(decode_tokens)
        self.cols.masked_fill_(self.cols >= self.start_column + decode_tokens, _UNWRITTEN)
        self._host_length, self._host_stale = decode_tokens, False

    def select(self, fn) -> None:
        """Apply a batch selection ``fn`` (beam reorder: in place; repeat / subset: new buffers)."""
        if self.keys is None:
            return
        keys, values = fn(self.keys), fn(self.values)
        if keys.shape == self.keys.shape:
            self.keys.copy_(keys)
            self.values.copy_(values)
        else:
            self.keys, self.values = keys, values
            self._mark_static(self.keys, self.values)

    def held_by(self, rank: int) -> int:
        """Decode tokens rank ``rank`` holds now (host)."""
        n = self.host_length
        offset = (rank - self.first_owner) % self.world_size
        return 0 if n <= offset else -(-(n - offset) // self.world_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (full capacity, trash column included)."""
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()


def _shared_prefix_state(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """Every row's queries against the shared-prefix shard ``[Hkv, P_r, D]`` in ONE flash call: the rows become
    query positions of a batch of one (``[1, Hq, B * Lq, D]``), as the cascade's shared pass does."""
    B, Hq, Lq, D = query.shape
    folded = query.permute(1, 0, 2, 3).reshape(1, Hq, B * Lq, D)
    out, lse = fused_attention(folded, keys[None], values[None], scale=scaling, causal=False)
    out = out.reshape(Hq, B, Lq, D).permute(1, 0, 2, 3)
    return out, lse.reshape(Hq, B, Lq).permute(1, 0, 2)


def partial_state(layer, query: torch.Tensor, *, scaling: float, softcap: float | None,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's exact partial attention state over the prompt KV it holds and its decode buffers.

    The prompt shards run PyTorch's flash kernel where it applies (``backend="auto"``: CUDA, fp16/bf16, no soft-cap;
    a row shard only where no row has prompt padding): it splits a long shard's keys over the SMs
    (flash-decoding). Else, and for the decode buffers (masked by column), hf_cascade's suffix kernel, which also
    merges the prompt's state into its own in its epilogue.

    Returns:
        ``(out [B, Hq, Lq, D] in query.dtype, lse [B, Hq, Lq] float32)``.
    """
    B, _, q_len, _ = query.shape
    held = layer.keys if layer.keys is not None else layer.prefix_keys
    fused = held is not None and use_fused_attention(query, held if held.dim() == 4 else held[None], backend,
                                                     softcap=softcap)
    out = lse = None
    if layer.prefix_keys is not None and layer.prefix_keys.shape[1] > 0:  # every row reads the shared prefix
        if fused:
            out, lse = _shared_prefix_state(query, layer.prefix_keys, layer.prefix_values, scaling)
        else:
            keys = layer.prefix_keys[None].expand(B, -1, -1, -1)
            values = layer.prefix_values[None].expand(B, -1, -1, -1)
            out, lse = suffix_attention(query, keys, values, scale=scaling, causal=False, softcap=softcap)
    if layer.keys is not None and layer.keys.shape[2] > 0:  # the prompt's row shard: all before the queries
        if fused and layer.rows_all_valid:
            row_out, row_lse = fused_attention(query, layer.keys, layer.values, scale=scaling, causal=False)
            out, lse = (row_out, row_lse) if out is None else merge_attention_states(out.float(), lse, row_out,
                                                                                      row_lse)
        else:
            mask = layer.row_valid[:, None, :].expand(B, q_len, layer.keys.shape[2])
            out, lse = suffix_attention(query, layer.keys, layer.values, scale=scaling, mask=mask, softcap=softcap,
                                        prefix_out=None if out is None else out.float(), prefix_lse=lse)
    buffers = layer.decode
    return suffix_attention(query, buffers.keys, buffers.values, scale=scaling, mask=buffers.mask(q_len),
                            softcap=softcap, prefix_out=None if out is None else out.float(), prefix_lse=lse)


def attend_fixed(layer, query: torch.Tensor, info: GroupInfo, combine: str, *, scaling: float,
                 softcap: float | None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's decode attention with fixed buffers: this rank's partial state (:func:`partial_state`), then
    the exact combine across ranks.

    Args:
        layer: the cache layer (``prefix_keys``/``prefix_values`` ``[Hkv, P_r, D]`` or None; ``keys``/``values``
            ``[B, Hkv, S_r, D]`` or None with ``row_valid`` bool ``[B, S_r]``; ``decode`` a :class:`DecodeBuffers`).
        query: ``[B, Hq, Lq, D]`` the new tokens' queries (the same on every rank).
        backend: the prompt shards' kernel (``"auto"``, ``"fused"``, ``"suffix"``; see :func:`partial_state`).
    Returns:
        ``(out [B, Lq, Hq, D] in query.dtype, lse fp32 [B, Hq, Lq])``, identical on every rank.
    """
    out, lse = partial_state(layer, query, scaling=scaling, softcap=softcap, backend=backend)
    out, lse = combine_states(out, lse, info, combine)
    return out.transpose(1, 2), lse
