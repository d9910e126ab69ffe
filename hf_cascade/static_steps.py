"""The face of :class:`~hf_cascade.cache.CascadeCache` that a compiled or recorded decode step reads.

A mixin of ``CascadeCache`` (it reads the cache's levels, fixed buffers and the plan and step tensors its
:class:`~hf_cascade.ops.cascade_wrapper.CascadeWrapper` holds): which device tensors a step reads
in place, in which order a call takes them from the model's :class:`~hf_cascade.step_buffers.StepBuffers`, what
a recorded step is keyed on, and the prefix KV stacked into the slots a compiled step takes.
"""

from __future__ import annotations

import torch

from hf_cascade.step_buffers import StepBuffers, take_or_new
from hf_cascade.ops.cascade_wrapper import PrefixSlots, padded_level_count
from hf_cascade.suffix_layers import StaticSuffixLayer

__all__ = ["StaticStepMixin", "stacked_base"]


def stacked_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
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


class StaticStepMixin:
    """``CascadeCache``'s methods for fixed buffers and compiled / recorded decode steps."""

    def static_layout_key(self) -> tuple | None:
        """What a recorded decode step must be keyed on besides its tensors: the rows' layout (per level the
        nodes' key ranges and each row's node) when the built-in kernels run, which read it on the host (the
        Triton op reads it from the plan's index tensors, so one graph serves every layout of its shapes)."""
        if not self.builtin_kernels:
            return None
        if self._layout_key is None:
            nodes = None if self.row_nodes is None else tuple(map(tuple, self.row_nodes.tolist()))
            self._layout_key = ("builtin", tuple(tuple(level.node_starts) for level in self.levels), nodes)
        return self._layout_key

    def static_step_keepalive(self):
        """What a recorded decode step must keep alive besides the step buffers: the plan whose host-made index
        tensors the built-in kernels read (a later call with the same layout replays the graph at their addresses)."""
        return self._wrapper.layout if self.builtin_kernels else None

    def _pad_prefix_levels(self, buffers: StepBuffers | None = None) -> PrefixSlots:
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
                "fixed_buffers=False)` to generate(), or build the cache without "
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
                stacked = stacked_base(tensors) if buffers is None else None
                if stacked is None:  # one copy, then the level reads the stacked tensor
                    stacked = new((layers, *tensors[0].shape))
                    for layer_idx, t in enumerate(tensors):
                        stacked[layer_idx].copy_(t)
                    tensors[:] = list(stacked.unbind(0))
                kind_slots.append(stacked)
        for tensor in (*slots[0], *slots[1]):
            torch._dynamo.mark_static_address(tensor, guard=False)
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
        return PrefixSlots(*slots)

    def use_step_buffers(self, buffers: StepBuffers) -> None:
        """Take this cache's fixed buffers and prefix KV from ``buffers`` (a model's :class:`StepBuffers`), so a
        compiled step replays the CUDA graphs an earlier call with the same shapes recorded. Call before the first
        forward, on a cache whose levels nothing else holds; give them back with ``buffers.keep(
        cache.step_buffer_tensors())`` when the call ends (the cache's contents are then the next call's)."""
        if self.max_suffix_length is None:
            return
        for layer in self.layers:
            layer.step_buffers = buffers
        self._step_buffers = self._wrapper.buffers = buffers

    def step_buffer_tensors(self) -> list[torch.Tensor]:
        """The device tensors a compiled or recorded decode step reads in place, in the order a call takes them
        from its :class:`StepBuffers`: the padded prefix slots, the window mask, the suffix buffers and their
        lengths, the op's index tensors."""
        tensors = [t for slots in self._wrapper.prefix_slots or () for t in slots]
        if self._window_dev is not None:
            tensors.append(self._window_dev)
        tensors += [t for layer in self.layers if layer.is_initialized
                    for t in (layer.keys, layer.values, layer.cumulative_length)]
        tensors += list(self._wrapper.op_inputs or ())
        shifts = self._wrapper.shifts  # a window's rows (hf_cascade.windows): taken after the op's
        if shifts is not None and shifts.from_step_buffers:
            tensors += [shifts.level_shift, shifts.suffix_shift]
        return tensors

    def static_step_tensors(self) -> list[torch.Tensor]:
        """Every device tensor of this cache that a compiled or recorded decode step reads (the step buffers, and the
        rows' suffix starts where no window mask was planned): what a recorded CUDA graph is keyed on."""
        tensors = self.step_buffer_tensors()
        if self._window_dev is None and self._suffix_start_dev is not None:  # read by _suffix_mask only then
            tensors.append(self._suffix_start_dev)
        shifts = self._wrapper.shifts
        if shifts is not None:  # layers whose window is shorter than the sequence (hf_cascade.windows)
            tensors += [shifts.level_shift, shifts.suffix_shift]
            plan = self._wrapper.layout
            if plan is not None and (self.builtin_kernels or self._wrapper.op_inputs is None):
                # read by the PyTorch path (the bounded op reads the layout from the op's index tensors instead)
                tensors += [*plan.row_node, *(level.node_starts_dev for level in plan.levels)]
        return tensors

    def suffix_lengths(self) -> list[torch.Tensor]:
        """Each fixed-buffer layer's written suffix length (device int64 scalar), the state a decode step advances:
        what to restore to run a failed step again."""
        return [layer.cumulative_length for layer in self.layers
                if isinstance(layer, StaticSuffixLayer) and layer.is_initialized]

    def begin_static_step(self) -> None:
        """A compiled or recorded step is about to run (or, replayed, has run) on the device: the host's count of
        written columns is stale, and nothing computed for an earlier step is reused."""
        self._step_memo = None
        for layer in self.layers:
            if isinstance(layer, StaticSuffixLayer) and layer.is_initialized:
                layer._host_length_stale = True
