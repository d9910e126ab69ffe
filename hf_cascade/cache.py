"""``CascadeCache``: a transformers ``Cache`` that stores shared prefixes once and each row's suffix apart.

Layout. The cache holds

* ``levels``: the shared-prefix tree, level by level. Level ``l`` packs the KV of its ``N_l`` nodes along the
  sequence: per model layer, keys/values ``[num_kv_heads, T_l, head_dim]`` with **no batch dimension** (stored
  once, never replicated, never ``repeat_kv``-ed). Node ``n`` occupies ``[node_starts[n], node_starts[n+1])``.
* ``row_nodes``: ``[num_levels, batch]`` int64 on the host, the node of each row at each level (-1: none).
  ``None`` means "every row uses node 0 of every level" (the ``from_prefix`` case, any batch size). The
  schedule of each level's prefix pass is planned from it once per batch layout (not per layer or step), so
  decoding never synchronises with the device.
* per layer, the rows' suffix KV ``[batch, num_kv_heads, S, head_dim]``, grown by ``update()`` like
  ``DynamicCache``; or, with ``max_suffix_length``, fixed buffers ``[batch, num_kv_heads, max_suffix_length,
  head_dim]`` written in place like ``StaticCache`` (no host synchronisation, fixed addresses: generate() compiles
  the decode step, with CUDA graphs on a GPU).

What generate() sees. Every row is laid out ``[prefix chain | pads | suffix]`` in ``prefix_length`` leading
columns plus the suffix columns. ``get_seq_length()`` is ``prefix_length + S`` (the logical length: generate()
slices ``input_ids`` and builds positions from it), and ``get_mask_sizes()`` returns
``(S + q_len, prefix_length)`` so transformers builds a mask that covers exactly the suffix KV. ``update()``
returns only the suffix KV; the attention function reaches the prefix through :meth:`CascadeCache.attend`
(see :mod:`hf_cascade.attention`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_cascade.attention import ATTENTION_NAME, bind_layer, check_model_uses_cascade, plain_attention, sink_attention
from hf_cascade.captured_step import static_step
from hf_cascade.compiled_layers import outside_layer_graphs
from hf_cascade.model_scan import attention_modules
from hf_cascade.ops._backend import host_to_device
from hf_cascade.ops.builtin_cascade import builtin_cascade_attention
from hf_cascade.ops.kv_write import write_suffix_kv
from hf_cascade.ops.plan import CascadePlan, cascade_attention_planned, padded_level_count, plan_cascade
from hf_cascade.ops.reference import write_suffix_kv_ref
from hf_cascade.prefill import PrefixLevel, prefill_levels, validate_token_ids
from hf_cascade.step_buffers import StepBuffers, take_or_new
from hf_cascade.ops.bounded import merge_sink
from hf_cascade.windows import cache_bounded_attend, layer_sinks, layer_window


class _SuffixLayer(CacheLayerMixin):
    """One model layer's per-row suffix KV, ``[batch, num_kv_heads, S, head_dim]``, grown by concatenation."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None  # see _append_columns

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
            self.keys, self.values = _append_columns(self, key_states, value_states)
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


def _append_columns(layer: _SuffixLayer, key_states: torch.Tensor, value_states: torch.Tensor):
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


class _StaticSuffixLayer(_SuffixLayer):
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
        positions = _memoized(step_memo, ("positions", key_states.shape[-2], self.device),
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


def _memoized(memo: dict | None, key: tuple, compute):
    """``memo[key]``, computed by ``compute()`` and stored on first use; ``compute()`` every time without a memo."""
    value = None if memo is None else memo.get(key)
    if value is None:
        value = compute()
        if memo is not None:
            memo[key] = value
    return value


def _stacked_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``[layers, ...]`` tensor whose ``unbind(0)`` views ``tensors`` are (as prefill packs a level), or None."""
    base = tensors[0]._base
    if base is None or base.dim() != tensors[0].dim() + 1 or base.shape[0] != len(tensors) or not base.is_contiguous():
        return None
    step = base.stride(0) * base.element_size()
    start = base.data_ptr()
    if all(t._base is base and t.data_ptr() == start + i * step and t.shape == base.shape[1:]
           for i, t in enumerate(tensors)):
        return base
    return None


def _same_view(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """``a`` and ``b`` are the same tensor, or views of the same memory with the same shape and strides (the model's
    mask reaches each layer as a new view ``mask[:, 0]`` of the one tensor; ``a``, kept in the memo, keeps that
    memory from being reused by another tensor)."""
    if a is b:
        return True
    if torch.compiler.is_compiling():  # traced tensors have no data pointer
        return False
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4: ``config.layer_types[i] == "chunked_attention"``,
    each token attends only within its chunk of ``config.attention_chunk_size`` tokens), or None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if not chunk or not layer_types or module.layer_idx >= len(layer_types):
        return None
    return int(chunk) if layer_types[module.layer_idx] == "chunked_attention" else None


def _num_layers(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.num_hidden_layers)


class CascadeCache(Cache):
    """A prefix-aware KV cache: shared prefixes stored once (batch 1), each row's suffix apart.

    Build it with :meth:`from_prefix` (one prefix shared by every row) or get one from
    :func:`hf_cascade.shared_prefix_inputs` (nested prefixes found automatically), then pass it to
    ``model.generate(..., past_key_values=cache)``. Rows must be laid out ``[prefix | pads | suffix]`` (the
    prefix columns included, with ``attention_mask`` covering them), as transformers' prompt-reuse convention
    expects. The same cache serves several ``generate()`` calls one after another: each call starts from the
    stored prefix (the previous call's suffixes are dropped), so the prefix is never prefilled again.

    Example::

        cache = CascadeCache.from_prefix(model, prefix_ids)          # prefix_ids: [P] or [1, P]
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
        print(cache.nbytes)                                          # prefix once + suffixes
    """

    def __init__(
        self,
        model: torch.nn.Module,
        levels: Sequence[PrefixLevel] = (),
        row_nodes: torch.Tensor | None = None,
        prefix_length: int = 0,
        max_suffix_length: int | None = None,
        suffix_start: torch.Tensor | None = None,
        prefix_tree=None,
        window_mask: torch.Tensor | None = None,
    ):
        check_model_uses_cascade(model)
        if max_suffix_length is not None and (
            isinstance(max_suffix_length, bool) or not isinstance(max_suffix_length, int) or max_suffix_length < 1
        ):
            raise ValueError(
                f"`max_suffix_length` must be None (suffixes grow as needed) or a positive int (fixed buffers, "
                f"compileable); got {max_suffix_length!r}."
            )
        self.max_suffix_length = max_suffix_length
        num_layers = _num_layers(model.config)
        if max_suffix_length is None:
            layers = [_SuffixLayer() for _ in range(num_layers)]
        else:
            layers = [_StaticSuffixLayer(max_suffix_length) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.levels: list[PrefixLevel] = list(levels)
        self.prefix_length = int(prefix_length)
        if row_nodes is not None and row_nodes.shape[0] != len(self.levels):
            raise ValueError(
                f"`row_nodes` must have one row per prefix level: shape {tuple(row_nodes.shape)} for "
                f"{len(self.levels)} levels."
            )
        if row_nodes is None and any(level.num_nodes != 1 for level in self.levels):
            raise ValueError("`row_nodes` is required when a prefix level has more than one node.")
        if row_nodes is not None:
            row_nodes = row_nodes.detach().to("cpu", torch.int64)
        if suffix_start is not None:
            suffix_start = suffix_start.detach().to("cpu", torch.int64)
            if row_nodes is not None and suffix_start.shape != (row_nodes.shape[1],):
                raise ValueError(
                    f"`suffix_start` must hold one column per row: shape {tuple(suffix_start.shape)} for "
                    f"{row_nodes.shape[1]} rows."
                )
            if not bool(suffix_start.any()):
                suffix_start = None
        # Fixed buffers + rows planned from their tokens: the mask over the suffix window is known here, so a
        # compiled step builds it from device data and nothing in the graph depends on prefix_length (a batch
        # with another layout reuses the compiled step). ``window_mask`` bool [B, sw]: the user's mask over the
        # suffix window's prompt columns; stored [max_suffix_length, B] (batch last, like row_nodes).
        self._planned_window = None
        if window_mask is not None and max_suffix_length is not None:
            window = torch.ones((max_suffix_length, window_mask.shape[0]), dtype=torch.bool)
            window[: window_mask.shape[1]] = window_mask.detach().to("cpu", torch.bool).T
            if suffix_start is not None:
                window &= torch.arange(max_suffix_length)[:, None] >= suffix_start[None, :]
            self._planned_window = window
        self._planned_row_nodes = row_nodes
        self._planned_suffix_start = suffix_start
        self._set_rows(row_nodes, suffix_start, self._planned_window)
        # The rows' token ids were checked against the stored prefix (shared_prefix_inputs, hf_cascade.generate).
        # A from_prefix cache given straight to generate() is not: its first prefill checks the rows' positions.
        self.rows_verified = row_nodes is not None
        self.prefix_tree = prefix_tree
        self.prefilled_prefix_tokens = sum(level.node_starts[-1] for level in self.levels)
        # The prefix KV a compiled step reads: (key slots, value slots), one [layers, Hkv, T, D] tensor per level,
        # padded to padded_level_count levels (_pad_prefix_levels). Built at the first forward (_match_rows), from
        # the StepBuffers given by use_step_buffers if any.
        self._compiled_prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # Whether _compiled_prefix has the empty levels that let one compiled graph serve trees of 1 to
        # COMPILED_LEVELS levels (a recorded step, recorded per tree, launches for the real levels only).
        self.pad_levels = True
        self._step_buffers: StepBuffers | None = None
        # The attention modules this cache may serve (reusing it with another model is an error); the model's
        # kept scan, shared with its other caches (read only).
        self._modules: dict[int, weakref.WeakSet] = attention_modules(model)
        self._model_name = type(model).__name__
        self._config = model.config
        self._user_defined = False
        # One generate() at a time: the thread that started the current one owns the suffix state (see _claim).
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._positions_checked = False
        self._builtin_kernels = False

    @property
    def builtin_kernels(self) -> bool:
        """Attend and write the fixed buffers with kernels that ship compiled in PyTorch (FlashAttention-2,
        matmuls: :mod:`hf_cascade.ops.builtin_cascade`) instead of hf_cascade's Triton kernels, which a process
        with an empty Triton cache must build first. Set by ``hf_cascade.generate`` from :mod:`hf_cascade.tiers`;
        False (Triton on CUDA) by default. Never used inside ``torch.compile``."""
        return self._builtin_kernels

    @builtin_kernels.setter
    def builtin_kernels(self, value: bool) -> None:
        self._builtin_kernels = bool(value)
        for layer in self.layers:
            if isinstance(layer, _StaticSuffixLayer):
                layer.builtin_kernels = self._builtin_kernels

    def static_layout_key(self) -> tuple | None:
        """What a recorded decode step must be keyed on besides its tensors: the rows' layout (per level the
        nodes' key ranges and each row's node) when the built-in kernels run, which read it on the host (the
        Triton op reads it from the plan's index tensors, so one graph serves every layout of its shapes)."""
        if not self._builtin_kernels:
            return None
        if self._layout_key is None:
            nodes = None if self.row_nodes is None else tuple(map(tuple, self.row_nodes.tolist()))
            self._layout_key = ("builtin", tuple(tuple(level.node_starts) for level in self.levels), nodes)
        return self._layout_key

    def static_step_keepalive(self):
        """What a recorded decode step must keep alive besides the step buffers: the plan whose host-made index
        tensors the built-in kernels read (a later call with the same layout replays the graph at their addresses)."""
        return self._plan if self._builtin_kernels else None

    def _pad_prefix_levels(self, buffers: StepBuffers | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The prefix KV a compiled step takes: per level slot, the keys (values) of every layer as one tensor
        ``[layers, Hkv, T, D]``, with empty slots (2 keys that no row reads) in front of the real levels, so that
        trees of 1 to COMPILED_LEVELS levels run one graph (where ``pad_levels``). One tensor per slot, not per layer: the step's inputs,
        and the sizes dynamo reads from them before every replay, do not grow with the layers. CUDA graphs read
        them in place (no copy per replay); a new cache re-records, never recompiles, and a level of another
        length is the same graph (its length is dynamic). ``buffers``: the slots are tensors taken from it. The
        levels' per-layer tensors become views of their slot (the KV is stored once)."""
        first = self.levels[0].keys[0]
        layers, (heads, _, head_dim) = len(self.levels[0].keys), first.shape
        if any(t.shape[::2] != first.shape[::2] or t.dtype != first.dtype for t in self.levels[0].keys):
            raise NotImplementedError(
                f"This model's layers store KV of different shapes ([heads, tokens, head_dim] per layer: "
                f"{sorted({tuple(t.shape[::2]) for t in self.levels[0].keys})} heads x head_dim); hf_cascade's fixed "
                "buffers (compiled decode) need one shape for every layer. Pass `cascade_options=dict("
                "fixed_buffers=False)` (or `disable_compile=True`) to generate(), or build the cache without "
                "`max_new_tokens` / `max_suffix_length`."
            )
        new = lambda shape: take_or_new(buffers, shape, first.dtype, first.device)  # noqa: E731
        pad = padded_level_count(len(self.levels)) - len(self.levels) if self.pad_levels else 0
        slots = ([], [])
        for kind, kind_slots in enumerate(slots):  # taken in the order step_buffer_tensors lists them
            width = head_dim if kind == 0 else self.levels[0].values[0].shape[-1]  # K and V head sizes may differ
            kind_slots += [new((layers, heads, 2, width)) for _ in range(pad)]
            for level in self.levels:
                tensors = level.keys if kind == 0 else level.values
                stacked = _stacked_base(tensors) if buffers is None else None
                if stacked is None:  # one copy, then the level reads the stacked tensor
                    stacked = new((layers, *tensors[0].shape))
                    for layer_idx, t in enumerate(tensors):
                        stacked[layer_idx].copy_(t)
                    tensors[:] = list(stacked.unbind(0))
                kind_slots.append(stacked)
        for tensor in (*slots[0], *slots[1]):
            torch._dynamo.mark_static_address(tensor, guard=False)
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
        return slots[0], slots[1]

    def use_step_buffers(self, buffers: StepBuffers) -> None:
        """Take this cache's fixed buffers and prefix KV from ``buffers`` (a model's :class:`StepBuffers`), so a
        compiled step replays the CUDA graphs an earlier call with the same shapes recorded. Call before the first
        forward, on a cache whose levels nothing else holds; give them back with ``buffers.keep(
        cache.step_buffer_tensors())`` when the call ends (the cache's contents are then the next call's)."""
        if self.max_suffix_length is None:
            return
        for layer in self.layers:
            layer.step_buffers = buffers
        self._step_buffers = buffers

    def step_buffer_tensors(self) -> list[torch.Tensor]:
        """The device tensors a compiled or recorded decode step reads in place, in the order a call takes them
        from its :class:`StepBuffers`: the padded prefix slots, the window mask, the suffix buffers and their
        lengths, the op's index tensors."""
        tensors = [t for slots in self._compiled_prefix or () for t in slots]
        if self._window_dev is not None:
            tensors.append(self._window_dev)
        tensors += [t for layer in self.layers if layer.is_initialized
                    for t in (layer.keys, layer.values, layer.cumulative_length)]
        return tensors + list(self._op_inputs or ())

    def static_step_tensors(self) -> list[torch.Tensor]:
        """Every device tensor of this cache that a compiled or recorded decode step reads (the step buffers, and the
        rows' suffix starts where no window mask was planned): what a recorded CUDA graph is keyed on."""
        tensors = self.step_buffer_tensors()
        if self._window_dev is None and self._suffix_start_dev is not None:  # read by _suffix_mask only then
            tensors.append(self._suffix_start_dev)
        if self._shifts is not None:  # layers whose window is shorter than the sequence (hf_cascade.windows)
            tensors += [self._shifts.level_shift, self._shifts.suffix_shift]
            if self._plan is not None:
                tensors += [*self._plan.row_node, *(level.node_starts_dev for level in self._plan.levels)]
        return tensors

    def suffix_lengths(self) -> list[torch.Tensor]:
        """Each fixed-buffer layer's written suffix length (device int64 scalar), the state a decode step advances:
        what to restore to run a failed step again."""
        return [layer.cumulative_length for layer in self.layers
                if isinstance(layer, _StaticSuffixLayer) and layer.is_initialized]

    def begin_static_step(self) -> None:
        """A compiled or recorded step is about to run (or, replayed, has run) on the device: the host's count of
        written columns is stale, and nothing computed for an earlier step is reused."""
        self._step_memo = None
        for layer in self.layers:
            if isinstance(layer, _StaticSuffixLayer) and layer.is_initialized:
                layer._host_length_stale = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_prefix(
        cls, model: torch.nn.Module, prefix_ids: torch.Tensor | Sequence[int], max_suffix_length: int | None = None
    ) -> "CascadeCache":
        """Prefill ``prefix_ids`` once and return a cache every row of a later batch shares.

        Args:
            model: a causal LM loaded with ``attn_implementation="cascade"``.
            prefix_ids: ``[P]`` or ``[1, P]`` token ids (int64), P >= 1.
            max_suffix_length: None (suffixes grow as needed), or the most tokens any row holds after the prefix
                (prompt suffix + new tokens): fixed buffers, so generate() compiles the decode step on CUDA
                (transformers' auto-compile, CUDA graphs) as it does with ``cache_implementation="static"``.
        Returns:
            A cache holding the prefix KV once; pass it to ``model.generate(input_ids, attention_mask=...,
            past_key_values=cache)`` with rows laid out ``[prefix | pads | suffix]``.
        """
        check_model_uses_cascade(model)
        prefix = validate_token_ids(prefix_ids, "prefix_ids", model)
        if prefix.dim() == 2:
            if prefix.shape[0] != 1:
                raise ValueError(
                    f"`prefix_ids` must be [P] or [1, P] (one prefix shared by all rows); got shape "
                    f"{tuple(prefix.shape)}. For different prefixes per group of rows use "
                    "`hf_cascade.shared_prefix_inputs`."
                )
            prefix = prefix[0]
        if prefix.dim() != 1 or prefix.numel() == 0:
            raise ValueError(
                f"`prefix_ids` must be a non-empty [P] or [1, P] tensor of token ids; got shape {tuple(prefix.shape)}."
            )
        tokens = tuple(prefix.tolist())
        levels = prefill_levels(model, [[(tokens, None, 0)]], cache_class=cls)
        return cls(model, levels, row_nodes=None, prefix_length=len(tokens), max_suffix_length=max_suffix_length)

    # ------------------------------------------------------------------ what generate() calls
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Append the new suffix KV ``[batch, num_kv_heads, q_len, head_dim]``; return this layer's suffix KV."""
        if outside_layer_graphs():  # a decoder layer compiled for a recorded step: its attention op writes the step
            return key_states, value_states
        if static_step():  # a compiled or recorded step: device work only (see captured_step)
            memo = None
            if not torch.compiler.is_compiling():
                # Eager (a step CapturedDecodeStep runs or records): what all layers compute alike (write positions,
                # the suffix mask) is computed by the first and reused; a compiled step fuses it instead.
                if layer_idx == 0 or self._step_memo is None:  # (begin_static_step clears it too)
                    self._step_memo = {}
                memo = self._step_memo
            keys, values = self.layers[layer_idx].update(key_states, value_states, step_memo=memo)
            bind_layer(self, layer_idx, keys, values)
            return keys, values
        with self._lock:  # a reset by another thread's generate() cannot interleave with this write
            if self._owner is not None and self._owner != threading.get_ident():
                raise ValueError(
                    "Two generate() calls are using one CascadeCache at the same time (another thread started a "
                    "generate() with it while this one was running); their suffixes would overwrite each other. A "
                    "cache serves one generate() at a time: give each thread its own cache, or pass "
                    "`custom_generate=hf_cascade.generate`, which gives every call its own view of the stored prefix."
                )
            if layer_idx == 0:  # once per forward: every layer serves the same rows
                impl = getattr(self._config, "_attn_implementation", None)
                if impl != ATTENTION_NAME:
                    raise ValueError(
                        f"A CascadeCache was given to a model running attn_implementation={impl!r}: that attention "
                        "never reads the shared prefix stored in the cache, so every row would silently lose it. "
                        "Load the model with attn_implementation='cascade' (or call "
                        "`model.set_attn_implementation('cascade')`), or pass no cache to this model."
                    )
                self._match_rows(key_states.shape[0], key_states.device)
            keys, values = self.layers[layer_idx].update(key_states, value_states)
        bind_layer(self, layer_idx, keys, values)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0):
        """Prefix + suffix tokens: an int, or (fixed buffers) a device int64 scalar, as transformers' StaticCache."""
        return self.prefix_length + self.layers[layer_idx].get_seq_length()

    @property
    def suffix_length(self) -> int:
        """Suffix tokens held per row (the columns after the prefix)."""
        return self.layers[0].host_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        kv_length, _ = self.layers[layer_idx].get_mask_sizes(query_length)
        if self.window is not None and torch.compiler.is_compiling():
            return kv_length, 0  # unused: attend() builds the compiled step's mask itself (_suffix_mask)
        return kv_length, self.prefix_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # transformers 5.17
        suffix = self.layers[layer_idx].get_max_cache_shape()
        return -1 if suffix < 0 else self.prefix_length + suffix

    def crop(self, tokens_to_remove: int) -> None:
        """Drop ``-tokens_to_remove`` tokens from the end (negative, transformers >= 5.18 convention) or crop to an
        absolute length (positive, 5.17's legacy convention). The shared prefix cannot be cropped."""
        suffix_length = self.suffix_length
        if tokens_to_remove > 0:  # legacy: the absolute length to keep
            tokens_to_remove = max(self.prefix_length + suffix_length - tokens_to_remove, 0)
        else:
            tokens_to_remove = -tokens_to_remove
        if tokens_to_remove > suffix_length:
            raise ValueError(
                f"Cannot crop {tokens_to_remove} tokens from a CascadeCache holding {suffix_length} suffix tokens: "
                f"the {self.prefix_length} shared prefix tokens are immutable. Build a new cache instead."
            )
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        state = self._row_state()
        if any(t is not None for t in state):
            # Beams of one prompt share its prefix nodes and columns, so this is usually a no-op; check on the host.
            index = beam_idx.to("cpu")
            reordered = tuple(None if t is None else t.index_select(t.dim() - 1, index) for t in state)
            if not all(_same(a, b) for a, b in zip(reordered, state)):
                self._set_rows(*reordered)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._set_rows(*(None if t is None else t.repeat_interleave(repeats, dim=-1) for t in self._row_state()))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        index = torch.as_tensor(indices).to("cpu")
        self._set_rows(*(None if t is None else t[..., index] for t in self._row_state()))

    def reset(self) -> None:
        """Drop every row's suffix and go back to the stored prefix (which is kept)."""
        for layer in self.layers:
            layer.reset()
        self._set_rows(self._planned_row_nodes, self._planned_suffix_start, self._planned_window)
        self._positions_checked = False

    def _claim(self) -> None:
        """A generate() call starts with this cache: the calling thread owns it until another call claims it.

        A second thread that claims the cache while the first is still decoding makes the first fail at its next
        step with a clear error (its suffixes were dropped); the second runs on a clean cache."""
        if not self._lock.acquire(blocking=False):
            raise ValueError(
                "This CascadeCache is in use by a generate() call in another thread. A cache serves one generate() "
                "at a time: give each thread its own cache, or pass `custom_generate=hf_cascade.generate`, which "
                "gives every call its own view of the stored prefix."
            )
        try:
            self._owner = threading.get_ident()
            self.reset()
        finally:
            self._lock.release()

    # generate() marks a cache the user passed with `_is_user_defined = True` when it starts: a new generate() call
    # starts from the stored prefix, so one cache serves several batches one after another.
    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._user_defined = value
        if value:
            self._claim()

    @property
    def nbytes(self) -> int:
        """Bytes of KV held: each shared node once, plus every row's suffix."""
        return sum(level.nbytes for level in self.levels) + sum(layer.nbytes for layer in self.layers)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def __repr__(self) -> str:
        nodes = "/".join(str(level.num_nodes) for level in self.levels) or "0"
        return (
            f"CascadeCache(prefix_length={self.prefix_length}, levels={len(self.levels)}, nodes per level={nodes}, "
            f"suffix_length={self.suffix_length}, nbytes={self.nbytes})"
        )

    # ------------------------------------------------------------------ attention
    def _set_rows(
        self, row_nodes: torch.Tensor | None, suffix_start: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
    ) -> None:
        """The rows' layout: ``row_nodes`` ``[num_levels, B]`` (node per level, -1 none; None: node 0 everywhere),
        ``suffix_start`` ``[B]`` (first column of the suffix window holding the row's own tokens; None: 0) and
        ``window`` ``[max_suffix_length, B]`` (fixed buffers, planned rows: which suffix columns each row sees)."""
        self.row_nodes = row_nodes
        self.suffix_start = suffix_start
        self.window = window
        self._suffix_start_dev = self._window_dev = None
        self._mask_memo = None
        self._step_memo: dict | None = None  # per eager device-only step (see update)
        self._plans: dict[int, CascadePlan] = {}
        self._plan: CascadePlan | None = None
        self._op_inputs: list[torch.Tensor] | None = None
        self._shifts = None  # hf_cascade.windows.RowShifts of these rows, built by the first bounded layer
        self._layout_key: tuple | None = None  # static_layout_key, computed once per layout

    def _row_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.row_nodes, self.suffix_start, self.window

    def _plan_for(self, batch_size: int, device: torch.device) -> CascadePlan:
        """The :class:`CascadePlan` of the current rows (built once per batch layout, on the host)."""
        plan = self._plans.get(batch_size)
        if plan is None:
            plan = plan_cascade(self.row_nodes, [level.node_starts for level in self.levels], batch_size, device)
            self._plans[batch_size] = plan
        return plan

    def _match_rows(self, batch_size: int, device: torch.device) -> None:
        """Fit the planned rows to the batch generate() runs: num_return_sequences / num_beams expand rows
        with repeat_interleave and never the cache, so a multiple of the planned batch is expanded the same way."""
        planned = next((t.shape[-1] for t in self._row_state() if t is not None), batch_size)
        if planned != batch_size:
            if batch_size % planned:
                raise ValueError(
                    f"This CascadeCache was planned for {planned} rows but the model got a batch of {batch_size}. "
                    "Pass the `input_ids`/`attention_mask` returned by `shared_prefix_inputs` together with its cache "
                    "(or a multiple of them, as num_return_sequences/num_beams make), or build a new cache for this "
                    "batch."
                )
            self._set_rows(
                *(None if t is None else t.repeat_interleave(batch_size // planned, dim=-1) for t in self._row_state())
            )
        # Planned here, outside any compiled or captured region.
        self._plan = self._plan_for(batch_size, device) if self.levels else None
        if self._compiled_prefix is None and self.max_suffix_length is not None and self.levels:
            self._compiled_prefix = self._pad_prefix_levels(self._step_buffers)
        if self.suffix_start is not None and self._suffix_start_dev is None:
            self._suffix_start_dev = host_to_device(self.suffix_start, device)
        if self.window is not None and self._window_dev is None:
            window = host_to_device(self.window.T.contiguous(), device)  # [B, max_suffix_length]
            if self._step_buffers is not None:  # at the address an earlier call's had (its CUDA graphs read it)
                window = self._step_buffers.take(window.shape, window.dtype, device).copy_(window)
            self._window_dev = window
            torch._dynamo.maybe_mark_dynamic(self._window_dev, 1)  # as the buffers' capacity

    def _suffix_mask(self, attention_mask: torch.Tensor | None, layer, query_length: int, kv_length: int):
        """The mask over the suffix KV: transformers' mask (or causal), and, when rows start their own tokens
        at different columns of the suffix window, without each row's columns before ``suffix_start`` (those
        tokens are in the row's prefix chain, or padding). bool ``[B or 1, q_len, S]`` or None (causal)."""
        if self._window_dev is not None and static_step():
            # Compiled (or recorded) step: the mask from device data only (transformers' was built at kv_offset 0, see
            # get_mask_sizes), so the graph does not depend on this batch's prefix_length. The same for every layer
            # (each has written as many columns): an eager step builds it once (see update).
            memo = None if torch.compiler.is_compiling() else self._step_memo
            return _memoized(memo, ("mask", query_length, layer.capacity, layer.device),
                             lambda: self._window_dev[:, None, :] & layer.causal_mask(query_length))
        if attention_mask is None:
            attention_mask = layer.causal_mask(query_length)
        if self._suffix_start_dev is None:
            return attention_mask
        memo = self._mask_memo
        if memo is not None and _same_view(memo[0], attention_mask) and memo[1] == (query_length, kv_length):
            return memo[2]
        device = self._suffix_start_dev.device
        columns = torch.arange(kv_length, device=device)
        if attention_mask is None:  # causal, aligned bottom-right
            last = kv_length - query_length + torch.arange(query_length, device=device)
            attention_mask = (columns[None, :] <= last[:, None])[None]
        combined = attention_mask & (columns[None, :] >= self._suffix_start_dev[:, None])[:, None, :]
        if not static_step():
            self._mask_memo = (attention_mask, (query_length, kv_length), combined)
        return combined

    def _check_positions(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
        """First prefill of a cache whose rows were not checked against its prefix (a from_prefix cache given to
        generate() directly): every row must attend to all ``prefix_length`` stored columns, so the first token
        after them has position ``prefix_length``. Zeros in attention_mask over the prefix columns (a tokenizer's
        left padding before the prefix, or masked prefix tokens) lower it: refuse rather than answer wrongly."""
        self._positions_checked = True
        if position_ids is None or not self.levels or position_ids.dim() != 2:
            return
        q_len = position_ids.shape[1]
        if attention_mask is None:
            real = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
        else:
            steps = torch.arange(q_len, device=attention_mask.device)
            real = attention_mask[:, steps, steps]  # the suffix was empty: query j is column j
            real = real.expand(position_ids.shape[0], q_len)
        big = torch.iinfo(torch.int64).max
        first = torch.where(real, position_ids.to(torch.int64), big).min(dim=1).values.tolist()
        for row, position in enumerate(first):
            if position != big and position != self.prefix_length:
                raise ValueError(
                    f"Row {row} of this batch does not attend to all {self.prefix_length} prefix columns of this "
                    f"CascadeCache: its first token after them has position {position}, so `attention_mask` has "
                    f"{self.prefix_length - position} zero(s) over columns [0, {self.prefix_length}) (left padding "
                    "before the prefix, as a tokenizer's left-padded batch has, or masked prefix tokens). The prefix "
                    "is stored once for every row. Pass `custom_generate=hf_cascade.generate` to generate(), which "
                    "accepts the tokenizer's padded batch and checks each row's prefix tokens, or lay rows out "
                    "[prefix | pads | suffix] with the mask 1 over the prefix."
                )

    def _check_module(self, module: torch.nn.Module) -> None:
        modules = self._modules.get(module.layer_idx)
        if modules is None or module not in modules:
            self.reset()
            raise ValueError(
                f"This CascadeCache was built with a different model ({self._model_name}); a cache's prefix KV only "
                "fits the model that computed it. Build a new cache with `CascadeCache.from_prefix(model, ...)` or "
                "`shared_prefix_inputs(model, ...)` for this model."
            )

    def attention_module(self, layer_idx: int) -> torch.nn.Module:
        """The attention module of layer ``layer_idx`` of the model this cache was built for."""
        return next(iter(self._modules[layer_idx]))

    def attend(self, module, query, key, value, attention_mask, *, scaling, softcap=None, sliding_window=None, **kwargs):
        """Cascade attention for one layer: shared-prefix passes (one per level) merged with the suffix pass.

        Args:
            query: ``[batch, num_heads, q_len, head_dim]``.
            key, value: this layer's suffix KV ``[batch, num_kv_heads, S, head_dim]`` (S includes the new tokens).
            attention_mask: None (causal, bottom-right) or bool ``[batch, q_len, S]`` over the suffix KV.
        Returns:
            ``[batch, q_len, num_heads, head_dim]`` in ``query.dtype``.
        """
        compiling = static_step()  # a compiled or recorded step (device work only)
        builtin = self._builtin_kernels and not torch.compiler.is_compiling()
        if not compiling:  # checked eagerly at prefill; a compiled step is bound to this model
            self._check_module(module)
        layer_idx = module.layer_idx
        window, chunk = layer_window(module, sliding_window), _attention_chunk(module)
        sinks = layer_sinks(module, kwargs.get("s_aux"))
        # A window (or chunk) shorter than the sequence: each query's keys start at a lower bound (hf_cascade.windows).
        # Read only for such layers: a compiled step guards on the host ints it reads (a layout's prefix length would
        # then compile a graph per layout for every model).
        bounded = False
        if window is not None or chunk is not None:
            last_column = self.prefix_length + (key.shape[2] if self.max_suffix_length is None else
                                                self.max_suffix_length) - 1
            bounded = any(size is not None and last_column >= size for size in (window, chunk))
        layer = self.layers[layer_idx]
        if not self.rows_verified and not self._positions_checked and not compiling:
            if layer.host_length == query.shape[2]:  # the first forward over an empty suffix (the prefill)
                self._check_positions(attention_mask, kwargs.get("position_ids"))
        # Fixed buffers: None would also admit the columns not written yet; rows' own columns: see _suffix_mask.
        attention_mask = self._suffix_mask(attention_mask, layer, query.shape[2], key.shape[2])
        # Fixed buffers: the kernels read the suffix only as far as it is written (the mask hides the rest anyway).
        written = layer.cumulative_length if isinstance(layer, _StaticSuffixLayer) and layer.is_initialized else None
        if bounded:  # (Triton in eager forwards; the PyTorch path in compiled / recorded steps, for now)
            out, lse = cache_bounded_attend(self, layer_idx, query, key, value, attention_mask, scale=scaling,
                                            softcap=softcap, window=window, chunk=chunk, key_length=written,
                                            position_ids=kwargs.get("position_ids"), static=compiling or builtin)
            return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]
        if compiling and self._compiled_prefix is not None and not builtin:
            # The padded levels: the graph reads no level count (a tree of 1 to 4 levels is the same graph).
            # L + 1 Triton launches (see ops/cascade_attention.launch_cascade).
            prefix_keys, prefix_values = self._compiled_prefix  # every layer's; the op reads this layer's
            out, lse = torch.ops.hf_cascade.cascade_attention(
                query, key, value, prefix_keys, prefix_values, self._op_inputs, attention_mask, scaling, softcap,
                layer_idx, written,
            )
            return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]
        if not self.levels:  # nothing shared (e.g. prefilling a tree's first level): the fastest exact kernel
            if sinks is not None:
                return sink_attention(query, key, value, attention_mask, sinks, scale=scaling, softcap=softcap)
            mask = None if attention_mask is None else attention_mask[:, None]
            return plain_attention(module, query, key, value, mask, scaling=scaling, softcap=softcap)
        prefix_keys = [level.keys[layer_idx] for level in self.levels]
        prefix_values = [level.values[layer_idx] for level in self.levels]
        if builtin:  # PyTorch's own kernels (no Triton build): hf_cascade.ops.builtin_cascade
            if self._plan is None:
                self._plan = self._plan_for(query.shape[0], query.device)
            out, lse = builtin_cascade_attention(query, key, value, self._plan.prefixes(prefix_keys, prefix_values),
                                                 scale=scaling, mask=attention_mask, softcap=softcap)
            return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]
        if self._compiled_prefix is not None and self._op_inputs is None:
            # Plan the decode step (one query position) now, outside the compiled step's CUDA graphs.
            self._op_inputs = self._plan.op_inputs(query[:, :, -1:], key,
                                                   [slot[layer_idx] for slot in self._compiled_prefix[0]],
                                                   buffers=self._step_buffers)
        out, lse = cascade_attention_planned(
            query, key, value, prefix_keys, prefix_values, self._plan, scale=scaling, mask=attention_mask,
            softcap=softcap, key_length=written, return_lse=True,
        )
        return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]
