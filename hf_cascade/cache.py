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
from transformers.cache_utils import Cache

from hf_cascade.attention import (
    ATTENTION_NAME, bind_layer, check_model_uses_cascade, sdpa_attention, unshareable_model,
)
from hf_cascade.step_context import memoized, outside_layer_graphs, static_step
from hf_cascade.step_buffers import StepBuffers
from hf_cascade.model_scan import attention_modules
from hf_cascade.ops._backend import host_to_device
from hf_cascade.ops.bounded import WindowRequest, merge_sink
from hf_cascade.ops.cascade_wrapper import CascadeWrapper
from hf_cascade.ops.plan import CascadePlan
from hf_cascade.prefill import (
    PrefixLevel, check_first_positions, check_row_tokens, prefill_levels, validate_token_ids,
)
from hf_cascade.static_steps import StaticStepMixin
from hf_cascade.suffix_layers import StaticSuffixLayer, SuffixLayer, append_columns
from hf_cascade.transformers_compat import fixed_buffers_refusal, text_config
from hf_cascade.windows import layer_sinks, layer_window

# The names these had when they were defined here (kept importable from hf_cascade.cache).
_SuffixLayer, _StaticSuffixLayer, _append_columns, _memoized = SuffixLayer, StaticSuffixLayer, append_columns, memoized


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


def _check_cache_serves(model: torch.nn.Module, shares: bool, max_suffix_length) -> None:
    """A CascadeCache for ``model`` (``shares``: with prefix levels; ``max_suffix_length``: fixed buffers, or None)
    would answer exactly: else the error naming why and the fix."""
    check_model_uses_cascade(model)
    reason = unshareable_model(model) if shares else None
    if reason is not None:
        raise NotImplementedError(f"A shared prefix cannot serve {reason} exactly; call generate() "
                                  "without a CascadeCache (`custom_generate=hf_cascade.generate` runs generate()'s own "
                                  "decoding for this model, with a warning).")
    if max_suffix_length is None:
        return
    if isinstance(max_suffix_length, bool) or not isinstance(max_suffix_length, int) or max_suffix_length < 1:
        raise ValueError(f"`max_suffix_length` must be None (suffixes grow as needed) or a positive int (fixed "
                         f"buffers, compileable); got {max_suffix_length!r}.")
    refusal = fixed_buffers_refusal(model)  # (transformers 5.17, Llama 4)
    if refusal is not None:
        raise ValueError(refusal)


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4: ``config.layer_types[i] == "chunked_attention"``,
    each token attends only within its chunk of ``config.attention_chunk_size`` tokens), or None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if not chunk or not layer_types or module.layer_idx >= len(layer_types):
        return None
    return int(chunk) if layer_types[module.layer_idx] == "chunked_attention" else None


def window_sizes(model: torch.nn.Module) -> set[int]:
    """The sliding windows and attention chunks of ``model``'s layers, in tokens (empty: every layer sees every key)."""
    sizes = set()
    for modules in attention_modules(model).values():
        for module in modules:
            sizes.update(size for size in (layer_window(module), _attention_chunk(module)) if size is not None)
    return sizes


def _num_layers(config) -> int:
    return int(text_config(config).num_hidden_layers)


class CascadeCache(StaticStepMixin, Cache):
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
        _check_cache_serves(model, bool(levels), max_suffix_length)
        self.max_suffix_length = max_suffix_length
        num_layers = _num_layers(model.config)
        if max_suffix_length is None:
            layers = [SuffixLayer() for _ in range(num_layers)]
        else:
            layers = [StaticSuffixLayer(max_suffix_length) for _ in range(num_layers)]
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
        # The one door to the attention kernels: the rows' plan, the compiled step's tensors, the op's call.
        self._wrapper = CascadeWrapper()
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
        # Whether the prefix slots a compiled step reads (the wrapper's prefix_slots, built at the first forward by
        # _pad_prefix_levels) have the empty levels that let one compiled graph serve trees of 1 to COMPILED_LEVELS
        # levels (a recorded step, recorded per tree, launches for the real levels only).
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
        # The rows' positions were checked against the stored prefix chains (by hf_cascade.generate's plan, else by
        # the first prefill of each generate() call: _check_positions).
        self.positions_checked = False

    def __deepcopy__(self, memo):
        raise TypeError(
            "A CascadeCache is not deep-copied: reuse it as it is. Its shared prefix is stored once and never written "
            "(each generate() call writes only the rows' own suffix, reset at the next call), so one cache serves "
            "several calls in a row, as a deep copy of a prefilled DynamicCache does in transformers' prompt-reuse "
            "recipe. Pass the same cache to each call (or build one per concurrent thread)."
        )

    @property
    def builtin_kernels(self) -> bool:
        """Attend and write the fixed buffers with kernels that ship compiled in PyTorch (FlashAttention-2,
        matmuls: :mod:`hf_cascade.ops.builtin_cascade`) instead of hf_cascade's Triton kernels, which a process
        with an empty Triton cache must build first. Set by ``hf_cascade.generate`` from :mod:`hf_cascade.tiers`;
        False (Triton on CUDA) by default. Never used inside ``torch.compile``."""
        return self._wrapper.builtin

    @builtin_kernels.setter
    def builtin_kernels(self, value: bool) -> None:
        self._wrapper.builtin = bool(value)
        for layer in self.layers:
            if isinstance(layer, StaticSuffixLayer):
                layer.builtin_kernels = bool(value)

    @property
    def fixed_decode_buffers(self) -> bool:
        """The rows' suffix KV lives in fixed buffers (``max_suffix_length``): a decode step may be compiled or
        recorded into a CUDA graph (what :mod:`hf_cascade.decode` asks of a cache)."""
        return self.max_suffix_length is not None

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
        self.positions_checked = False

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
        self._wrapper.reset()  # (and the rows' window shifts, hf_cascade.windows)
        self._layout_key: tuple | None = None  # static_layout_key, computed once per layout

    def _row_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.row_nodes, self.suffix_start, self.window

    def _plan_for(self, batch_size: int, device: torch.device, check: bool = False) -> CascadePlan | None:
        """The :class:`CascadePlan` of the current rows (built once per batch layout, on the host, by the layout's
        first forward: ``check``), or None without prefix levels."""
        if self.levels and (check or self._wrapper.layout is None):
            self._wrapper.plan(self.row_nodes, [level.node_starts for level in self.levels], batch_size, device)
        return self._wrapper.layout if self.levels else None

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
        self._plan_for(batch_size, device, check=True)
        if self._wrapper.prefix_slots is None and self.max_suffix_length is not None and self.levels:
            self._wrapper.prefix_slots = self._pad_prefix_levels(self._step_buffers)
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
            return memoized(memo, ("mask", query_length, layer.capacity, layer.device),
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

    def check_planned_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """A ValueError where ``input_ids [B, W]`` are not the rows this cache was planned for (their first real
        tokens are not each row's stored prefix chain): :func:`~hf_cascade.prefill.check_row_tokens`."""
        if self.levels and self._planned_row_nodes is not None:
            check_row_tokens(self.levels, self._planned_row_nodes, input_ids, attention_mask)

    def _check_positions(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
        """First prefill of rows this call's generate() did not plan (a cache of the user's on the plain path): each
        row's first own token must have the position its stored prefix chain ends at (:func:`check_first_positions`:
        a ValueError naming the cause where not)."""
        self.positions_checked = True
        if position_ids is not None and self.levels and position_ids.dim() == 2:
            check_first_positions(self.levels, self.row_nodes, self.suffix_start, self.rows_verified,
                                  attention_mask, position_ids)

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

    @staticmethod
    def _written_suffix(layer, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                        static: bool) -> tuple:
        """Fixed buffers: the kernels read the suffix only as far as it is written (the mask hides the rest anyway).
        Returns ``(key, value, attention_mask, key_length)``: in a compiled or recorded step (or a compiled prefill)
        the buffers whole and the written count as an int64 device scalar (``key_length``); in an eager forward the
        buffers cut at the host's count (views; ``key_length`` None), which launches the kernel variants a growing
        cache's forwards launch (the background build's grid has them: ``hf_cascade.build_grid``)."""
        if not (isinstance(layer, StaticSuffixLayer) and layer.is_initialized):
            return key, value, attention_mask, None
        if static or torch.compiler.is_compiling():
            return key, value, attention_mask, layer.cumulative_length
        n = layer.host_length
        return key[:, :, :n], value[:, :, :n], None if attention_mask is None else attention_mask[..., :n], None

    def _window_request(self, window: int | None, chunk: int | None, position_ids: torch.Tensor | None,
                        static: bool) -> WindowRequest:
        """What the wrapper builds a bounded layer's bounds from (:func:`~hf_cascade.ops.bounded.window_bounds`):
        the rows' layout, and this step's memo (the bounds once per step for every layer of one window) in an
        eager device-only step."""
        in_step = static and not (self.builtin_kernels and not torch.compiler.is_compiling())
        memo = self._step_memo if in_step and not torch.compiler.is_compiling() else None
        # Rows planned from the user's batch count a window in columns from the row's first real column, masked
        # columns inside a row included, as transformers' masks do (the layout's host shifts: hf_cascade.windows); a
        # from_prefix cache given rows [prefix | pads | suffix] counts positions (the forward's position_ids): its
        # rows stand for the left-padded rows of prefix + suffix.
        positions = None if self.rows_verified else position_ids
        return WindowRequest(window, chunk, self.row_nodes, self.suffix_start, positions, memo)

    def attend(self, module, query, key, value, attention_mask, *, scaling, softcap=None, sliding_window=None, **kwargs):
        """Cascade attention for one layer: shared-prefix passes (one per level) merged with the suffix pass.

        Args:
            query: ``[batch, num_heads, q_len, head_dim]``.
            key, value: this layer's suffix KV ``[batch, num_kv_heads, S, head_dim]`` (S includes the new tokens).
            attention_mask: None (causal, bottom-right) or bool ``[batch, q_len, S]`` over the suffix KV.
        Returns:
            ``[batch, q_len, num_heads, head_dim]`` in ``query.dtype``.
        """
        static = static_step()  # a compiled or recorded step (device work only)
        if not static:  # checked eagerly at prefill; a compiled step is bound to this model
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
        if not self.positions_checked and not static:
            if layer.host_length == query.shape[2]:  # the first forward over an empty suffix (the prefill)
                self._check_positions(attention_mask, kwargs.get("position_ids"))
        # Fixed buffers: None would also admit the columns not written yet; rows' own columns: see _suffix_mask.
        attention_mask = self._suffix_mask(attention_mask, layer, query.shape[2], key.shape[2])
        key, value, attention_mask, written = self._written_suffix(layer, key, value, attention_mask, static)
        shared = bounded or self._wrapper.prefix_slots is not None or bool(self.levels)
        if not shared and softcap is None and sinks is None:  # nothing shared: sdpa, the fastest exact kernel
            mask = None if attention_mask is None else attention_mask[:, None]
            return sdpa_attention(module, query, key, value, mask, scaling=scaling)
        if not torch.compiler.is_compiling() and self.levels:  # (planned by the layout's first forward; if not yet)
            self._plan_for(query.shape[0], query.device)
        request = self._window_request(window, chunk, kwargs.get("position_ids"), static) if bounded else None
        out, lse = self._wrapper.run(layer_idx, query, key, value, self.levels, scale=scaling, mask=attention_mask,
                                     softcap=softcap, key_length=written, static=static, window=request)
        return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]
