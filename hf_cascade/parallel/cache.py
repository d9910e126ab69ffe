"""``ContextParallelCache``: a transformers ``Cache`` whose KV is sharded along the sequence over ranks.

Every rank runs the whole model on the same decode tokens; only the attention is distributed. Per model layer a
rank holds

* its zigzag shard of the prompt's KV (``[batch, num_kv_heads, S_r, head_dim]``, ``S_r ~ prompt / N``), with the
  global column of every key (``cols``, int64 ``[S_r]``),
* the KV of the decode tokens placed on it: each forward's new tokens go to ONE rank, the least-loaded one
  (``placement="least_loaded"``, default) or the next in turn (``"round_robin"``), so shards stay balanced,
* optionally, its zigzag shard of a prefix shared by every row, stored once without a batch dimension
  (``[num_kv_heads, P_r, head_dim]``; see :func:`~hf_cascade.parallel.inputs.context_parallel_inputs`'s
  ``shared_prefix``); the rows' own columns (suffixes, decode tokens) are then placed as above.

What generate() sees is a cache of the *logical* length (all ranks' columns): ``get_seq_length()`` and
``get_mask_sizes(q_len) = (length + q_len, 0)`` are those of a ``DynamicCache`` holding the whole sequence, so
transformers builds its masks and positions over global columns; :meth:`ContextParallelCache.attend` picks the
columns this rank holds out of that mask.

Attention (through the registered ``"cascade"`` attention, see :mod:`hf_cascade.attention`):

* prefill (inside ``context_parallel_inputs``): zigzag ring attention
  (:func:`~hf_cascade.parallel.ring.ring_attention`);
* decode: this rank's partial attention (shared-prefix shard merged with its row KV: out ``[B, H, Lq, D]``, lse
  fp32 ``[B, H, Lq]``), then the exact ``combine`` across ranks: ``"all_gather"`` (default; one all-gather of
  the packed states per layer, merged locally), ``"tree"`` or ``"all_to_all"``
  (:mod:`~hf_cascade.parallel.combine`), or the ``"all_gather_kv"`` baseline (gathers every rank's KV; for
  benchmarks).

Fixed decode buffers (``context_parallel_inputs(..., max_new_tokens=N)``, :mod:`~hf_cascade.parallel.fixed`): the
decode tokens' KV goes to per-layer buffers written in place at a device-side length, round-robin over the ranks;
``is_compileable`` is True and ``get_seq_length()`` is a device scalar, so generate() compiles the decode step
(``torch.compile(fullgraph=True)``, functional collectives in the combine) where it compiles (CUDA; elsewhere
with ``compile_config._compile_all_devices``).

All ranks must call the model in lockstep (same batch, same number of tokens): each attention layer is a
collective operation.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from hf_cascade.attention import bind_layer, check_model_uses_cascade
from hf_cascade.cache import _attention_chunk, _num_layers
from hf_cascade.step_context import outside_layer_graphs
from hf_cascade.model_scan import attention_modules
from hf_cascade.ops.fused_attention import KERNEL_CHOICES
from hf_cascade.ops.cascade_wrapper import CascadeWrapper, LevelKV
from hf_cascade.ops.bounded import merge_sink
from hf_cascade.ops.merge import merge_attention_states
from hf_cascade.ops.suffix_attention import suffix_attention
from hf_cascade.parallel._group import GroupInfo
from hf_cascade.parallel.combine import all_gather_kv, check_combine, combine_states
from hf_cascade.parallel.fixed import DecodeBuffers, attend_fixed, check_max_new_tokens
from hf_cascade.suffix_layers import SuffixLayer
from hf_cascade.transformers_compat import fixed_buffers_refusal
from hf_cascade.windows import layer_sinks
from hf_cascade.parallel.prefill_plan import PrefillPlan, PrefillRound, PrefillState
from hf_cascade.parallel.ring import past_state, past_state_workspace_numel, ring_exchange_numel, ring_states

PLACEMENTS = ("least_loaded", "round_robin")
_GROW = 256  # columns of spare capacity added when a rank's row KV storage is full


class _ShardLayer(SuffixLayer):
    """One model layer's slice of the sequence on this rank.

    Attributes:
        keys, values: ``[batch, num_kv_heads, S_r, head_dim]`` row KV held here (None before the first update).
        cols: int64 ``[S_r]`` global column of each key, ascending.
        length: columns of the whole (logical) sequence this layer has seen, shared prefix included.
        prefix_keys, prefix_values: ``[num_kv_heads, P_r, head_dim]`` shared-prefix shard, or None.
        decode: :class:`~hf_cascade.parallel.fixed.DecodeBuffers` (fixed decode buffers) or None (growing).
        row_valid: bool ``[batch, S_r]`` with ``decode``: which row-shard keys each row sees (prompt padding).
    """

    def __init__(self):
        super().__init__()
        self.cols = None
        self.prefix_keys = self.prefix_values = None
        self.length = 0
        self.decode: DecodeBuffers | None = None
        self.row_valid: torch.Tensor | None = None
        self.rows_all_valid = False  # with ``decode``: no row has prompt padding in this shard (no mask needed)
        self._buffers = None  # (keys, values, cols) storage with spare capacity; keys/values/cols are views

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.cols = torch.zeros(0, dtype=torch.long, device=key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):  # the cache implements update itself
        raise NotImplementedError("ContextParallelCache layers are updated through ContextParallelCache.update().")

    def crop(self, tokens_to_remove: int) -> None:  # columns are global: the cache crops with keep_columns_below
        raise NotImplementedError("ContextParallelCache layers are cropped through ContextParallelCache.crop().")

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Append ``[batch, num_kv_heads, q_len, head_dim]`` new KV at global columns ``start, start + 1, ...``.

        Storage grows in steps of at least ``_GROW`` columns (a buffer with spare capacity; ``keys``/``values``
        are views of it), so a decode step does not copy this rank's whole shard as ``torch.cat`` would.
        """
        size, q_len = self.keys.shape[2], key_states.shape[2]
        if self._buffers is None or self._buffers[0].shape[2] < size + q_len:
            capacity = size + max(q_len, _GROW)
            buffers = []
            for old in (self.keys, self.values):
                buf = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
                buf[:, :, :size] = old
                buffers.append(buf)
            cols = self.cols.new_empty(capacity)
            cols[:size] = self.cols
            self._buffers = (*buffers, cols)
        kbuf, vbuf, cbuf = self._buffers
        kbuf[:, :, size:size + q_len] = key_states
        vbuf[:, :, size:size + q_len] = value_states
        cbuf[size:size + q_len] = torch.arange(start, start + q_len, device=cbuf.device)
        self.keys, self.values, self.cols = kbuf[:, :, :size + q_len], vbuf[:, :, :size + q_len], cbuf[:size + q_len]

    def keep_columns_below(self, length: int) -> None:
        if self.cols is not None:
            keep = torch.nonzero(self.cols < length).flatten()
            if keep.numel() != self.cols.numel():
                self.keys = self.keys.index_select(2, keep)
                self.values = self.values.index_select(2, keep)
                self.cols = self.cols.index_select(0, keep)
                self._buffers = None
        self.length = min(self.length, length)

    def _select(self, fn) -> None:
        if self.keys is not None:
            super()._select(fn)
        self._buffers = None  # keys/values are no longer views of the growth buffers
        if self.row_valid is not None:
            self.row_valid = fn(self.row_valid)
        if self.decode is not None:
            self.decode.select(fn)

    def reset(self) -> None:
        self.__init__()

    @property
    def nbytes(self) -> int:
        """Bytes of the KV held (used columns; spare capacity of the growth buffer not counted; fixed decode
        buffers counted whole)."""
        tensors = (self.keys, self.values, self.prefix_keys, self.prefix_values)
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return held + (0 if self.decode is None else self.decode.nbytes)



class ContextParallelCache(Cache):
    """KV cache sharded along the sequence over the ranks of a process group (see the module docstring).

    Built and prefilled by :func:`hf_cascade.context_parallel_inputs`; pass it to ``model.generate()`` on every
    rank. ``nbytes`` is the KV this rank holds (about ``1/N`` of the prompt's).

    Args:
        model: the causal LM (``attn_implementation="cascade"``) this cache serves.
        info: the process group (:func:`hf_cascade.parallel._group.resolve_group`).
        combine: ``"all_gather"`` (default: one collective per layer), ``"tree"``, ``"all_to_all"`` or
            ``"all_gather_kv"`` (baseline); see :mod:`hf_cascade.parallel.combine`.
        placement: where each forward's new tokens go: ``"least_loaded"`` (default) or ``"round_robin"``.
        kernels: the blocks' kernel, ring prefill and decode prompt shards: ``"auto"`` (PyTorch's cuDNN / flash
            attention where it applies on CUDA), ``"fused"`` (wherever it applies, CPU too), ``"suffix"``
            (hf_cascade's suffix kernel); see :func:`~hf_cascade.parallel.ring.block_attention`.

    Attributes:
        decode_step: how :func:`~hf_cascade.parallel.generation.context_parallel_generate` runs the decode steps
            (``"auto"``, ``"layers"``, ``"graphs"``, ``"compile"``, ``"eager"``); set by ``context_parallel_inputs``.
    """

    def __init__(self, model: torch.nn.Module, info: GroupInfo, *, combine: str = "all_gather",
                 placement: str = "least_loaded", kernels: str = "auto"):
        check_model_uses_cascade(model)
        if placement not in PLACEMENTS:
            raise ValueError(f"`placement` must be one of {PLACEMENTS}; got {placement!r}.")
        super().__init__(layers=[_ShardLayer() for _ in range(_num_layers(model.config))])
        self.fixed_buffers_refusal = fixed_buffers_refusal(model)  # (transformers 5.17, Llama 4)
        self.info = info
        self.combine = check_combine(combine)
        self.placement = placement
        self._prefill: PrefillState | None = None  # set while the prompt is prefilled
        self.prefill_releases = 0
        self._base_counts = [0] * info.world_size  # prompt / shared-prefix columns owned by each rank
        self._base_length = 0  # columns placed by the prefill (zigzag); later ones are in _segments
        self._segments: list[tuple[int, int, int]] = []  # (start, end, owner rank) of each later forward
        self._counts = [0] * info.world_size  # keys held by each rank (= rank_token_counts())
        self._prefix_length = 0
        # The door to the attention kernels (as CascadeCache's): the plan of the shared prefix shard (one level, one
        # node every row reads, or none), per batch.
        self._wrapper = CascadeWrapper()
        self._prompt_length = 0  # what generate() starts from (see _is_user_defined)
        self._user_defined = False
        self._attention_modules = attention_modules(model)
        self._modules = {id(m) for modules in self._attention_modules.values() for m in modules}
        self.max_new_tokens: int | None = None  # set by use_fixed_buffers (fixed decode buffers)
        self.prompt_as_given: torch.Tensor | None = None  # [B, W] the user's rows where a shared prefix relaid them
        self.prompt_padding_as_given: torch.Tensor | None = None  # [B] their left padding (columns)
        self._prompt_rows: int | None = None  # the prompt's rows (mark_prompt)
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"`kernels` must be one of {KERNEL_CHOICES}; got {kernels!r}.")
        self.kernels = kernels
        self.decode_step = "auto"

    # ------------------------------------------------------------------ prefill (driven by context_parallel_inputs)
    def begin_prefill(self, plan: PrefillPlan, key_valid: torch.Tensor | None, *, shared: bool,
                      device: torch.device | str | None = None, keep_cached: int = 0) -> None:
        """The next forwards run the prompt's rounds (:mod:`~hf_cascade.parallel.prefill_plan`), one per
        :meth:`begin_round`; every layer's KV storage is sized once, for ``plan.num_real(rank)`` columns.

        ``key_valid``: bool ``[B, plan.length]`` over the prompt's columns (False = left padding) or None.
        ``shared``: the prompt is a prefix shared by every row (batch 1), stored without a batch dimension after.
        ``device``: the model's (where the stored columns' indices live; default ``key_valid``'s, else the CPU).
        ``keep_cached``: bytes of free cached segments PyTorch's CUDA allocator may hold at a layer's start before
        they are handed back (:meth:`~hf_cascade.parallel.prefill_plan.PrefillState.release_cached`).
        """
        if plan.world_size != self.info.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, the group has {self.info.world_size}.")
        if self.get_seq_length() != 0 or self._prefill is not None:
            raise ValueError("begin_prefill: the prompt's prefill must be the first thing written to the cache.")
        if key_valid is not None and tuple(key_valid.shape[1:]) != (plan.length,):
            raise ValueError(f"begin_prefill: key_valid must be bool [batch, {plan.length}]; got "
                             f"{tuple(key_valid.shape)}.")
        if device is None and key_valid is not None:
            device = key_valid.device
        self._prefill = PrefillState(plan, plan.rounds(self.info.rank), key_valid, shared, keep_cached=keep_cached)
        self._prefill.columns = plan.columns(self.info.rank, device)

    def begin_round(self, index: int) -> PrefillRound:
        """The next forward runs this rank's zigzag shard of round ``index``; returns the round."""
        prefill = self._prefill
        rnd = prefill.rounds[index]
        prefill.current = rnd
        valid = prefill.key_valid
        if valid is None:
            prefill.round_valid = prefill.past_valid = None
        else:
            ours = valid[:, rnd.start:rnd.start + rnd.layout.length]
            pad = rnd.layout.padded_length - rnd.layout.length
            prefill.round_valid = torch.cat([ours, ours.new_ones(ours.shape[0], pad)], dim=1) if pad else ours
            prefill.past_valid = valid.index_select(1, prefill.columns[:rnd.offset])
        return rnd

    def end_prefill(self) -> None:
        """Switch to decode. The sequence now holds ``plan.length`` columns."""
        prefill = self._prefill
        plan = prefill.plan
        for layer in self.layers:
            if plan.length and layer.cols is None:
                raise RuntimeError("end_prefill: a layer saw no update during the prefill.")
            layer.length = plan.length
            if prefill.shared and layer.keys is not None:  # batch 1 -> [Hkv, P_r, D], stored once
                layer.prefix_keys, layer.prefix_values = layer.keys[0], layer.values[0]  # (contiguous views)
                layer.keys = layer.values = layer.cols = None
                layer._buffers = None
        self._prefill = None
        self.prefill_releases = prefill.releases  # cached segments handed back during the prefill (benchmarks)
        self._base_counts = [plan.num_real(r) for r in range(plan.world_size)]
        self._counts = list(self._base_counts)
        self._base_length = plan.length
        self._prefix_length = plan.length if prefill.shared else 0
        self._prompt_length = plan.length

    def _store_round(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the real columns of this round's ``[B, Hkv, 2c, D]`` KV in place into the layer's storage."""
        prefill, rnd = self._prefill, self._prefill.current
        layer = self.layers[layer_idx]
        if layer._buffers is None:  # sized once for the whole prompt: nothing grows, nothing is copied
            keys, values = prefill.storage(layer_idx, len(self.layers), key_states, value_states)
            layer._buffers = (keys, values, prefill.columns)
        keys, values, cols = layer._buffers
        real = rnd.layout.num_real(self.info.rank)
        end = rnd.offset + real
        keys[:, :, rnd.offset:end] = key_states[:, :, :real]
        values[:, :, rnd.offset:end] = value_states[:, :, :real]
        layer.keys, layer.values, layer.cols = keys[:, :, :end], values[:, :, :end], cols[:end]

    def mark_prompt(self, rows: int) -> None:
        """Record the current length as the prompt of ``rows`` rows: each later generate() call starts again from
        here."""
        self._prompt_length = self.get_seq_length()
        self._prompt_rows = rows

    def use_fixed_buffers(self, max_new_tokens: int, prompt_mask: torch.Tensor) -> None:
        """Switch decode to fixed buffers for ``max_new_tokens`` tokens (see :mod:`hf_cascade.parallel.fixed`).

        Call after the prompt is prefilled and marked (again to resize: the decode tokens are dropped).
        ``prompt_mask``: ``[B, >= prompt_length]`` the prompt's attention mask (1 = real token; the ``attention_mask``
        generate() gets), the same on every rank; or ``[B * k, ...]``, its rows repeated ``k`` times each as
        generate() repeats them for ``num_return_sequences`` / ``num_beams``.
        """
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        if self.fixed_buffers_refusal:
            raise ValueError(self.fixed_buffers_refusal)
        if self.combine == "all_gather_kv":
            raise ValueError("combine='all_gather_kv' (a benchmark baseline) has no fixed-buffer decode; pick "
                             "'all_gather', 'tree' or 'all_to_all', or drop `max_new_tokens`.")
        length = self._prompt_length
        if prompt_mask.dim() != 2 or prompt_mask.shape[1] < length:
            raise ValueError(f"use_fixed_buffers: prompt_mask must be [batch, >= {length}]; got "
                             f"{tuple(prompt_mask.shape)}.")
        first_owner = self._counts.index(min(self._counts))  # decode tokens start on the least-loaded rank
        valid = prompt_mask[:, :length].bool()
        rows = next((layer.keys.shape[0] for layer in self.layers if layer.keys is not None), valid.shape[0])
        if rows and valid.shape[0] != rows and valid.shape[0] % rows == 0:
            valid = valid[:: valid.shape[0] // rows]  # generate()'s repeat_interleave of the rows, undone
        for layer in self.layers:
            if layer.keys is not None and layer.keys.shape[0] != valid.shape[0]:
                raise ValueError(f"use_fixed_buffers: prompt_mask has {valid.shape[0]} rows but the cache holds "
                                 f"{layer.keys.shape[0]}.")
            layer.row_valid = None if layer.keys is None else valid.index_select(1, layer.cols)
            layer.rows_all_valid = layer.row_valid is not None and bool(layer.row_valid.all())
            layer.decode = DecodeBuffers(max_new_tokens, self.info, first_owner, length, prompt_mask.device)
            layer.is_compileable = True
            if layer.keys is not None:
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
                layer._buffers = None
            # Read in place by the compiled step (CUDA graphs: fixed addresses; a new cache re-records).
            for tensor in (layer.keys, layer.values, layer.row_valid, layer.prefix_keys, layer.prefix_values):
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor, guard=False)
        self.max_new_tokens = max_new_tokens

    @property
    def fixed_decode_buffers(self) -> bool:
        """Fixed decode buffers were set (:meth:`use_fixed_buffers`): a decode step may be compiled or recorded into
        a CUDA graph (what :mod:`hf_cascade.decode` asks of a cache)."""
        return self.max_new_tokens is not None

    # ------------------------------------------------------------------ placement of new columns
    def rank_token_counts(self) -> list[int]:
        """Columns (keys) held by every rank, shared prefix included; identical on every rank."""
        decode = self.layers[0].decode
        if decode is not None:
            return [c + decode.held_by(r) for r, c in enumerate(self._counts)]
        return list(self._counts)

    def _owner(self, start: int, q_len: int) -> int:
        """Rank that stores columns ``[start, start + q_len)``; the first layer to see them decides."""
        placed = self._segments[-1][1] if self._segments else self._base_length
        if start == placed:
            if self.placement == "round_robin":
                owner = len(self._segments) % self.info.world_size
            else:
                owner = self._counts.index(min(self._counts))
            self._segments.append((start, start + q_len, owner))
            self._counts[owner] += q_len
            return owner
        for seg_start, seg_end, owner in reversed(self._segments):
            if seg_start == start and seg_end == start + q_len:
                return owner
        raise RuntimeError(
            f"ContextParallelCache: layer update for columns [{start}, {start + q_len}) does not match the columns "
            f"placed so far (up to {placed}); every layer must see the same tokens."
        )

    # ------------------------------------------------------------------ what generate() calls
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store ``[batch, num_kv_heads, q_len, head_dim]`` new KV if this rank owns it; return this rank's row KV
        (with fixed decode buffers: write in place and return the layer's decode buffers)."""
        if outside_layer_graphs():  # a decoder layer compiled for a recorded step: its attention op writes the step
            return key_states, value_states
        layer = self.layers[layer_idx]
        if layer.decode is not None and self._prefill is None:  # fixed decode buffers
            self._match_rows(layer, key_states.shape[0])
            layer.decode.write(key_states, value_states)
            bind_layer(self, layer_idx, layer.decode.keys, layer.decode.values)
            return layer.decode.keys, layer.decode.values
        if layer.keys is None:
            layer.lazy_initialization(key_states, value_states)
        if self._prefill is not None:  # a prefill round: this rank's zigzag shard of the round
            self._store_round(layer_idx, key_states, value_states)
            bind_layer(self, layer_idx, key_states, value_states)
            return key_states, value_states  # the round's KV, end padding included, is what the ring sends
        else:
            self._match_rows(layer, key_states.shape[0])
            q_len = key_states.shape[2]
            if self._owner(layer.length, q_len) == self.info.rank:
                layer.append(key_states, value_states, layer.length)
            layer.length += q_len
        bind_layer(self, layer_idx, layer.keys, layer.values)
        return layer.keys, layer.values

    def _match_rows(self, layer: _ShardLayer, batch_size: int) -> None:
        """num_return_sequences / num_beams expand generate()'s tensors, never the cache: expand the rows alike. Rows
        an earlier call expanded otherwise go back to the prompt's first (each prompt's ``k`` rows hold its prompt
        columns: beams reorder only within a prompt's group), so the inputs serve any later call."""
        if layer.keys is None:  # no row KV on this rank (fixed decode buffers are sized at their first write)
            return
        rows, prompt_rows = layer.keys.shape[0], self._prompt_rows
        if rows == batch_size:
            return
        if prompt_rows and rows != prompt_rows and rows % prompt_rows == 0 and batch_size % prompt_rows == 0:
            layer.batch_select_indices(torch.arange(0, rows, rows // prompt_rows, device=layer.keys.device))
            rows = prompt_rows
            if rows == batch_size:
                return
        if rows == 0 or batch_size % rows:
            raise ValueError(
                f"ContextParallelCache holds {rows} rows but the model got a batch of {batch_size}; pass the inputs "
                "returned by context_parallel_inputs (or a multiple of them, as num_return_sequences/num_beams make)."
            )
        layer.batch_repeat_interleave(batch_size // rows)

    def get_seq_length(self, layer_idx: int = 0):
        """Logical length: an int, or (fixed decode buffers) a device int64 scalar, as transformers' StaticCache."""
        decode = self.layers[layer_idx].decode
        if decode is not None:
            return self._prompt_length + decode.length
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if self.max_new_tokens is not None:  # fixed: the same every step (attend builds its own masks)
            return self._prompt_length + self.max_new_tokens, 0
        return self.layers[layer_idx].length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:  # transformers 5.17
        return -1 if self.max_new_tokens is None else self._prompt_length + self.max_new_tokens

    def crop(self, tokens_to_remove: int) -> None:
        """Drop ``-tokens_to_remove`` columns from the end (transformers >= 5.18) or keep an absolute length
        (positive, 5.17's legacy convention). The shared prefix and the ring-prefilled prompt cannot be cropped."""
        decode = self.layers[0].decode
        length = self._prompt_length + decode.host_length if decode is not None else self.get_seq_length()
        new_length = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
        new_length = min(new_length, length)
        if decode is not None:
            if new_length < self._prompt_length:
                raise ValueError(
                    f"Cannot crop this ContextParallelCache to {new_length} columns: with fixed decode buffers the "
                    f"{self._prompt_length} prompt columns are kept. Call context_parallel_inputs again."
                )
            for layer in self.layers:
                layer.decode.truncate(new_length - self._prompt_length)
            return
        if new_length < self._base_length:
            raise ValueError(
                f"Cannot crop a ContextParallelCache to {new_length} columns: its first {self._base_length} columns "
                "were prefilled with ring attention and cannot be cut. Call context_parallel_inputs again."
            )
        for layer in self.layers:
            layer.keep_columns_below(new_length)
        self._segments = [(s, min(e, new_length), o) for s, e, o in self._segments if s < new_length]
        self._counts = list(self._base_counts)
        for start, end, owner in self._segments:
            self._counts[owner] += end - start

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    # generate() sets `_is_user_defined = True` on a cache passed to it: start again from the prompt, so the dict
    # returned by context_parallel_inputs can be passed to several generate() calls.
    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._user_defined = value
        fixed = self.layers[0].decode is not None  # (its length is a device scalar: compare on the host)
        if value and (fixed or self.get_seq_length() > self._prompt_length):
            self.crop(self._prompt_length)

    @property
    def nbytes(self) -> int:
        """Bytes of KV this rank holds (its shards of the prompt / shared prefix, plus its decode tokens)."""
        return sum(layer.nbytes for layer in self.layers)

    def __repr__(self) -> str:
        return (
            f"ContextParallelCache(rank={self.info.rank}/{self.info.world_size}, length={self.get_seq_length()}, "
            f"shared_prefix={self._prefix_length}, combine={self.combine!r}, keys per rank="
            f"{self.rank_token_counts()}, nbytes={self.nbytes})"
        )

    # ------------------------------------------------------------------ recorded / compiled decode steps
    def attention_module(self, layer_idx: int) -> torch.nn.Module:
        """The attention module of layer ``layer_idx`` of the model this cache was built for."""
        return next(iter(self._attention_modules[layer_idx]))

    def static_step_tensors(self) -> list[torch.Tensor]:
        """Every device tensor a decode step with fixed buffers reads or writes (what a recorded CUDA graph is keyed
        on: :class:`~hf_cascade.decode.captured_step.CapturedDecodeStep`)."""
        tensors = []
        for layer in self.layers:
            decode = layer.decode
            candidates = (layer.keys, layer.values, layer.row_valid, layer.prefix_keys, layer.prefix_values,
                          None if decode is None else decode.keys, None if decode is None else decode.values,
                          None if decode is None else decode.cols, None if decode is None else decode.length)
            tensors.extend(t for t in candidates if t is not None)
        return tensors

    def suffix_lengths(self) -> list[torch.Tensor]:
        """Each layer's decode length (device int64 scalar): the state a decode step advances."""
        return [layer.decode.length for layer in self.layers if layer.decode is not None]

    def begin_static_step(self) -> None:
        """A recorded step is about to run on the device: the host's count of decode tokens is stale."""
        for layer in self.layers:
            if layer.decode is not None:
                layer.decode._host_stale = True

    # ------------------------------------------------------------------ attention
    def attend(self, module, query, key, value, attention_mask, *, scaling, softcap=None, sliding_window=None,
               **kwargs):
        """This layer's attention over the whole sharded sequence.

        Args:
            query: ``[batch, num_heads, q_len, head_dim]`` (this rank's zigzag shard during the ring prefill, the
                same new tokens on every rank afterwards).
            key, value: this rank's row KV ``[batch, num_kv_heads, S_r, head_dim]`` as returned by ``update``.
            attention_mask: None (causal) or bool ``[batch, q_len, length + q_len]`` over global columns. With
                fixed decode buffers it is not read: the prompt's padding was recorded by ``use_fixed_buffers``
                and the decode columns are causal (:func:`~hf_cascade.parallel.fixed.attend_fixed`).
        Returns:
            ``[batch, q_len, num_heads, head_dim]`` in ``query.dtype``, identical on every rank after decode; a
            layer's attention sinks (GPT-OSS) merged into the combined state.
        """
        if not torch.compiler.is_compiling() and id(module) not in self._modules:
            raise ValueError(
                "This ContextParallelCache was built for a different model; call context_parallel_inputs with the "
                "model you generate with."
            )
        out, lse = self._attend_state(module, query, key, value, attention_mask, scaling, softcap, sliding_window)
        sinks = layer_sinks(module, kwargs.get("s_aux"))
        return out if sinks is None else merge_sink(out, lse, sinks, heads_dim=2)[0]

    def _attend_state(self, module, query, key, value, attention_mask, scaling, softcap, sliding_window):
        """:meth:`attend`'s state: ``(out [B, q_len, Hq, D] in query.dtype, lse fp32 [B, Hq, q_len])``."""
        layer = self.layers[module.layer_idx]
        chunk = _attention_chunk(module)  # Llama 4's chunked layers: keys within the query's chunk only
        bound, kind = (sliding_window, "a sliding window") if sliding_window is not None else (chunk, "attention chunks")
        if layer.decode is not None and self._prefill is None:
            # Checked against the most columns the buffers can reach (a constant: no host length per step).
            if bound is not None and self._prompt_length + self.max_new_tokens > bound:
                raise NotImplementedError(
                    f"{type(module).__name__} (layer {module.layer_idx}) uses {kind} of {bound} tokens and prompt + "
                    f"max_new_tokens = {self._prompt_length + self.max_new_tokens} exceeds it: context parallelism "
                    "supports full attention only. Lower max_new_tokens."
                )
            return attend_fixed(layer, query, self.info, self.combine, scaling=scaling, softcap=softcap,
                                backend=self.kernels)
        # The ring prefill ignores both (its whole prompt is checked); a growing decode reads transformers' mask,
        # which carries the chunks.
        length = layer.length if self._prefill is None else self._prefill.plan.length
        in_mask = sliding_window is None and attention_mask is not None and self._prefill is None
        if bound is not None and length > bound and not in_mask:
            raise NotImplementedError(
                f"{type(module).__name__} (layer {module.layer_idx}) uses {kind} of {bound} tokens and the sequence "
                f"has {length}: context parallelism supports full attention only. Keep prompt + new tokens within "
                "it, or use a model whose layers attend to every key."
            )
        if self._prefill is not None:
            return self._attend_round(layer, query, key, value, scaling, softcap)
        if self.combine == "all_gather_kv":
            return self._attend_all_gather_kv(layer, query, key, value, attention_mask, scaling, softcap)

        q_len = query.shape[2]
        start = layer.length - q_len  # first new column
        mask, causal = None, False
        if attention_mask is not None:
            if attention_mask.shape[-1] != layer.length:
                raise ValueError(
                    f"ContextParallelCache.attend: the attention mask covers {attention_mask.shape[-1]} columns but "
                    f"the sequence has {layer.length}; pass the attention_mask returned by context_parallel_inputs "
                    "(generate() extends it)."
                )
            mask = attention_mask.index_select(-1, layer.cols)
        else:  # causal: only the rank holding the new tokens has keys at or after column `start`
            causal = layer.cols.numel() > 0 and bool(self._owner(start, q_len) == self.info.rank)
        # This rank's partial state: its shard of the shared prefix (every row reads it) and its row KV.
        idx, shared = module.layer_idx, layer.prefix_keys is not None and layer.prefix_keys.shape[1] > 0
        self._wrapper.plan(None, [(0, layer.prefix_keys.shape[1])] if shared else [], query.shape[0], query.device)
        levels = [LevelKV({idx: layer.prefix_keys}, {idx: layer.prefix_values})] if shared else []
        out, lse = self._wrapper.run(idx, query, key, value, levels, scale=scaling, mask=mask, causal=causal,
                                     softcap=softcap)
        out, lse = combine_states(out.transpose(1, 2), lse, self.info, self.combine)
        return out.transpose(1, 2), lse

    def _attend_round(self, layer, query, key, value, scaling, softcap):
        """A prefill round: the round's queries against its own keys (zigzag ring) and, after the first round,
        against every rank's stored keys of the earlier rounds (:func:`~hf_cascade.parallel.ring.past_state`),
        merged exactly. ``key``/``value``: the round's ``[B, Hkv, 2c, D]`` as ``update`` returned them."""
        prefill, rnd = self._prefill, self._prefill.current
        if query.is_cuda and not torch.compiler.is_compiling():
            prefill.release_cached(query.device)
        exchange = prefill.workspace(ring_exchange_numel(key), key, use="ring") if self.info.world_size > 1 else None
        out, lse = ring_states(query, key, value, layout=rnd.layout, info=self.info, scale=scaling,
                               key_valid=prefill.round_valid, softcap=softcap, block_backend=self.kernels,
                               exchange=exchange)
        if rnd.start > 0:  # the same on every rank: past_state is a collective
            keys, values = layer.keys[:, :, :rnd.offset], layer.values[:, :, :rnd.offset]
            workspace = prefill.workspace(past_state_workspace_numel(query, self.info.world_size), query)
            past_out, past_lse = past_state(query, keys, values, info=self.info, scale=scaling,
                                            valid=prefill.past_valid, softcap=softcap, block_backend=self.kernels,
                                            workspace=workspace)
            out, lse = merge_attention_states(out, lse, past_out, past_lse)
        return out.to(query.dtype).transpose(1, 2), lse

    def _attend_all_gather_kv(self, layer, query, key, value, attention_mask, scaling, softcap):
        """Baseline: gather every rank's row KV, then plain attention over the whole sequence on every rank."""
        if layer.prefix_keys is not None:
            raise NotImplementedError("combine='all_gather_kv' (a benchmark baseline) does not support shared_prefix.")
        counts = self.rank_token_counts()
        k, v, cols = all_gather_kv(key, value, layer.cols, counts, self.info)
        q_len = query.shape[2]
        if attention_mask is not None:
            mask = attention_mask.index_select(-1, cols)
        else:
            new_cols = torch.arange(layer.length - q_len, layer.length, device=query.device)
            mask = (cols[None, :] <= new_cols[:, None])[None]
        out, lse = suffix_attention(query, k, v, scale=scaling, mask=mask, causal=False, softcap=softcap)
        return out.transpose(1, 2), lse
