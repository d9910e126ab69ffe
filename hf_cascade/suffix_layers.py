"""The rows' suffix KV of a :class:`~hf_cascade.cache.CascadeCache`, one storage object per model layer.

``SuffixLayer`` grows ``[batch, num_kv_heads, S, head_dim]`` as ``DynamicCache`` does (into spare room, see
:func:`append_columns`); ``StaticSuffixLayer`` writes fixed buffers in place at a device-side length, as
``StaticCache`` does, so a compiled or recorded decode step has fixed shapes and addresses.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_cascade.step_context import memoized, static_step
from hf_cascade.step_buffers import take_or_new
from hf_cascade.ops.kv_write import write_suffix_kv
from hf_cascade.ops.reference import write_suffix_kv_ref

__all__ = ["StaticSuffixLayer", "SuffixLayer", "append_columns"]


class SuffixLayer(CacheLayerMixin):
    """One model layer's per-row suffix KV, ``[batch, num_kv_heads, S, head_dim]``, grown by concatenation."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None  # see append_columns

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self._room = None
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        if torch.compiler.is_compiling():  # a compiled prefill: the graph's own concatenation (no Python-side room)
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        else:
            self.keys, self.values = append_columns(self, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def host_length(self) -> int:
        """Suffix tokens held, as a host int."""
        return self.get_seq_length()

    def causal_mask(self, query_length: int) -> None:
        """The suffix mask that ``None`` stands for: every column is written, so causal bottom-right (None)."""
        return None

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 5.17
        return -1

    def reset(self) -> None:
        self.keys = self.values = self._room = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if self.keys is not None and tokens_to_remove > 0:
            self.keys = self.keys[..., : self.keys.shape[-2] - tokens_to_remove, :]
            self.values = self.values[..., : self.values.shape[-2] - tokens_to_remove, :]

    def _select(self, fn) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices])

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


# Spare suffix columns allocated past the ones written (then doubled): a decode step writes its new column into them.
_SUFFIX_ROOM = 32


def _opens(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """``view`` is ``buffer[..., :n, :]`` for some n (the layer's KV still in its buffer: not replaced or reordered)."""
    return (view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride() and view.dtype == buffer.dtype
            and view.shape[:2] == buffer.shape[:2] and view.shape[-1] == buffer.shape[-1])


def append_columns(layer: SuffixLayer, key_states: torch.Tensor, value_states: torch.Tensor):
    """``layer``'s suffix KV with the new columns appended, as views of buffers with room for more columns.

    ``torch.cat`` copied the whole suffix at every decode step (two copies per layer and step, growing with the
    suffix; on a CPU, copies large enough to run on several threads, each a wait for OpenMP's threads on a busy
    machine). Here a step copies only its new columns; a buffer that is full is replaced by one twice the size."""
    keys, values = layer.keys, layer.values
    written, new = keys.shape[-2], key_states.shape[-2]
    room = layer._room
    if (room is None or written + new > room[0].shape[-2] or not _opens(keys, room[0])
            or not _opens(values, room[1]) or room[0].shape[:2] != key_states.shape[:2]):
        size = max(2 * (written + new), written + new + _SUFFIX_ROOM)
        room = tuple(t.new_empty((*t.shape[:2], size, t.shape[-1])) for t in (key_states, value_states))
        room[0][..., :written, :].copy_(keys)
        room[1][..., :written, :].copy_(values)
        layer._room = room
    room[0][..., written : written + new, :].copy_(key_states)
    room[1][..., written : written + new, :].copy_(value_states)
    return room[0][..., : written + new, :], room[1][..., : written + new, :]


class StaticSuffixLayer(SuffixLayer):
    """One model layer's per-row suffix KV in fixed buffers ``[batch, num_kv_heads, max_suffix_length, head_dim]``.

    Written in place at a device-side length (``cumulative_length``, int64 scalar), so a decode step has no
    host-dependent shapes and no host synchronisation: what ``torch.compile`` and CUDA graphs need (as
    transformers' ``StaticLayer``). ``update()`` returns the whole buffers; columns not written yet are zeros and
    the mask hides them. The buffers survive ``reset()`` (same addresses for the next generate() call).
    """

    is_compileable = True

    def __init__(self, max_suffix_length: int):
        super().__init__()
        self.max_suffix_length = max_suffix_length
        self.step_buffers = None  # a StepBuffers to take the buffers from (CascadeCache.use_step_buffers)
        self.builtin_kernels = False  # write with PyTorch ops, not the Triton kernel (CascadeCache.builtin_kernels)
        self.cumulative_length = torch.zeros((), dtype=torch.int64)
        # Host mirror of cumulative_length for eager bounds checks (no device sync per layer); compiled steps do
        # not update it (they would recompile on every new value) but mark it stale.
        self._host_length = 0
        self._host_length_stale = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (*key_states.shape[:2], self.max_suffix_length, key_states.shape[-1])
        value_shape = (*shape[:3], value_states.shape[-1])  # K and V head sizes may differ
        # With step buffers: an earlier call's (same addresses: its CUDA graphs replay), cleared.
        self.keys = take_or_new(self.step_buffers, shape, self.dtype, self.device, zeroed=True)
        self.values = take_or_new(self.step_buffers, value_shape, self.dtype, self.device, zeroed=True)
        self.cumulative_length = take_or_new(self.step_buffers, (), torch.int64, self.device, zeroed=True)
        self._host_length, self._host_length_stale = 0, False
        if not torch.compiler.is_compiling():
            # Fixed addresses for CUDA graphs; guard=False: a new cache re-records graphs instead of recompiling.
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor, guard=False)
            # Buffers of another capacity (bucket) are the same graph: the step reads the capacity from the
            # buffers' shape (capacity), never from the int.
            for tensor in (self.keys, self.values):
                torch._dynamo.maybe_mark_dynamic(tensor, 2)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, step_memo: dict | None = None, **kwargs):
        """Write the new KV at the written length; ``step_memo``: a dict shared by the layers of one eager
        device-only step (see ``CascadeCache.update``), which then compute the write positions once."""
        if not self.is_initialized or self.keys.shape[0] != key_states.shape[0]:
            self.lazy_initialization(key_states, value_states)
        if static_step():
            self._host_length_stale = True
        else:
            length = self.host_length + key_states.shape[-2]
            if length > self.max_suffix_length:
                raise ValueError(
                    f"This CascadeCache holds at most {self.max_suffix_length} suffix tokens per row "
                    f"(`max_suffix_length`) and this step would make {length}. Build the cache with a larger "
                    "`max_suffix_length` (or `max_new_tokens` in shared_prefix_inputs), or lower `max_new_tokens`."
                )
            self._host_length = length
        # Every layer has written as many columns: the positions are the same.
        positions = memoized(step_memo, ("positions", key_states.shape[-2], self.device),
                              lambda: torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length)
        # Traced, the reference's three ops (the compiler fuses them); else one launch on CUDA.
        write = write_suffix_kv_ref if torch.compiler.is_compiling() or self.builtin_kernels else write_suffix_kv
        write(key_states, value_states, self.keys, self.values, positions, self.cumulative_length)
        return self.keys, self.values

    def get_seq_length(self):
        """The number of suffix tokens written, as a device int64 scalar (0 before the first update)."""
        return self.cumulative_length if self.is_initialized else 0

    @property
    def host_length(self) -> int:
        """The number of suffix tokens written, as a host int (synchronises only after compiled steps)."""
        if self._host_length_stale:
            self._host_length, self._host_length_stale = int(self.cumulative_length), False
        return self._host_length

    @property
    def capacity(self):
        """Suffix columns per row: the buffers' size (a symbolic size inside a compiled step)."""
        return self.keys.shape[2] if self.is_initialized else self.max_suffix_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:
        return self.max_suffix_length

    def get_max_cache_shape(self) -> int:  # transformers 5.17
        return self.max_suffix_length

    def reset(self) -> None:
        if self.is_initialized:
            self.cumulative_length.zero_()
            self._host_length, self._host_length_stale = 0, False

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized and tokens_to_remove > 0:
            removed = min(tokens_to_remove, self.host_length)
            self.cumulative_length.sub_(removed)
            self._host_length -= removed

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:  # in place: the buffers keep their addresses
            beam_idx = beam_idx.to(self.device)
            self.keys.copy_(self.keys.index_select(0, beam_idx))
            self.values.copy_(self.values.index_select(0, beam_idx))

    def _select(self, fn) -> None:
        super()._select(fn)
        if self.is_initialized and not torch.compiler.is_compiling():
            for tensor in (self.keys, self.values):
                torch._dynamo.mark_static_address(tensor, guard=False)

    def causal_mask(self, query_length: int) -> torch.Tensor:
        """bool ``[1, q_len, max_suffix_length]``: query i sees the written columns up to its own position."""
        columns = torch.arange(self.capacity, device=self.device)
        last = self.cumulative_length - query_length + torch.arange(query_length, device=self.device)
        return (columns[None, :] <= last[:, None])[None]
