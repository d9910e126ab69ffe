"""Prefill shared-prefix nodes once, level by level, through the model's own forward pass.

Level ``l``'s nodes run as one batch (one row per node) against a temporary :class:`CascadeCache` that holds
levels ``< l``: each node attends to its parent chain through the cascade attention (the parents' KV read once
for all their children) and causally to itself. The suffix KV that forward leaves in the temporary cache is the
node's KV; it is packed (padding dropped) into the new level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_cascade.compiled_layers import compiled_forward
from hf_cascade.ops._backend import host_to_device
from hf_cascade.ops.bounded import node_spans
from hf_cascade.transformers_compat import CACHE_KWARG


@dataclass
class PrefixLevel:
    """One level of the shared-prefix tree.

    Attributes:
        node_tokens: token ids of each node.
        node_starts: ``[N + 1]`` offsets of the nodes in the packed KV (CPU list).
        keys, values: per model layer, ``[num_kv_heads, T, head_dim]`` (``T = node_starts[-1]``).
    """

    node_tokens: list[tuple[int, ...]]
    node_starts: list[int]
    keys: list[torch.Tensor] = field(repr=False)
    values: list[torch.Tensor] = field(repr=False)

    @property
    def num_nodes(self) -> int:
        return len(self.node_tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


# (tokens of the node, index of its parent in the previous level or None, position of its first token)
NodeSpec = tuple[tuple[int, ...], int | None, int]


def validate_token_ids(ids, name: str, model: torch.nn.Module) -> torch.Tensor:
    """Return ``ids`` as an int64 tensor on the model's device, or raise a ValueError naming ``name`` and the fix."""
    device = model.device
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.tensor(ids, dtype=torch.int64, device=device)
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{name}` must be a tensor or a (nested) list of token ids: {err}") from None
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"`{name}` must hold integer token ids (torch.int64); got dtype {ids.dtype}. Pass the tokenizer's "
            "`input_ids`, or call `.long()`."
        )
    if ids.device != device:
        raise ValueError(
            f"`{name}` is on {ids.device} but the model is on {device}; move it with `{name}.to(model.device)`."
        )
    vocab_size = getattr(model.config.get_text_config(), "vocab_size", None)
    if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise ValueError(
            f"`{name}` holds token ids outside the model's vocabulary [0, {vocab_size}): min {int(ids.min())}, "
            f"max {int(ids.max())}. Was it tokenized with this model's tokenizer?"
        )
    return ids.long()


def check_row_tokens(levels: Sequence[PrefixLevel], row_nodes: torch.Tensor, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor) -> None:
    """Rows handed to a cache planned for other rows: each row's first real tokens (``input_ids [B, W]`` where
    ``attention_mask [B, W]`` is 1) must be the tokens of its stored prefix chain (``row_nodes [num_levels, B']``,
    -1: none; ``B`` a multiple of ``B'``, as generate() repeats rows). A ValueError naming the first row that
    differs: rows reordered, regrouped or replaced would attend to other rows' prefixes."""
    rows = row_nodes.shape[1]
    if input_ids.shape[0] % rows or input_ids.shape != attention_mask.shape:
        return  # (the cache's own row check names a mismatch of rows; suffix rows or embeddings hold no prefix ids)
    row_nodes = row_nodes.repeat_interleave(input_ids.shape[0] // rows, dim=1).tolist()
    ids, real = input_ids.cpu(), attention_mask.cpu() != 0
    for row in range(ids.shape[0]):
        chain = [t for level, nodes in zip(levels, row_nodes) if nodes[row] >= 0 for t in level.node_tokens[nodes[row]]]
        if ids[row][real[row]][: len(chain)].tolist() != chain:
            raise ValueError(
                f"Row {row} of this batch does not start with the {len(chain)} prefix tokens this CascadeCache stores "
                "for it: the cache was planned for other rows (or these rows in another order). Pass the rows it was "
                "planned with (`shared_prefix_inputs`' `input_ids`, or a second turn that extends a cascade call's "
                "output rows, in their order), or build the inputs again for this batch."
            )


def check_first_positions(levels: Sequence[PrefixLevel], row_nodes: torch.Tensor | None,
                          suffix_start: torch.Tensor | None, planned: bool, attention_mask: torch.Tensor | None,
                          position_ids: torch.Tensor) -> None:
    """The first prefill over a cascade cache's empty suffix: each row's first own token (its first real query at
    or after ``suffix_start``) must have the position its prefix chain in ``levels`` ends at, the positions that
    chain's KV were computed for. ``row_nodes`` ``[num_levels, B']`` (-1: none; None: node 0 everywhere);
    ``planned``: rows planned from their tokens (a row with no real query is then a padding row); ``attention_mask``
    bool ``[B, q_len, q_len]`` over the suffix (or None); ``position_ids`` ``[B or 1, q_len]``. Raises a ValueError
    naming the cause: rows not longer than their prefix or mask zeros over it (a lower position), or
    ``position_ids`` other than the mask's running count (a higher one)."""
    q_len = position_ids.shape[1]
    steps = torch.arange(q_len, device=position_ids.device)
    real = torch.ones((1, q_len), dtype=torch.bool, device=steps.device) if attention_mask is None else \
        attention_mask[:, steps, steps].to(steps.device)
    batch = max(real.shape[0], position_ids.shape[0])
    real, positions = real.expand(batch, q_len), position_ids.to(torch.int64).expand(batch, q_len)
    chain = node_spans(levels, row_nodes, batch if row_nodes is None else row_nodes.shape[-1])[1].sum(0)
    starts = torch.zeros_like(chain) if suffix_start is None else suffix_start.to("cpu", torch.int64)
    if chain.shape[0] != batch:  # (generate() repeated the rows for num_return_sequences / num_beams)
        repeats = batch // chain.shape[0]
        chain, starts = chain.repeat_interleave(repeats), starts.repeat_interleave(repeats)
    own = real.cpu() & (torch.arange(q_len)[None, :] >= starts[:, None])
    big = torch.iinfo(torch.int64).max
    first = torch.where(own, positions.cpu(), big).min(dim=1).values.tolist()
    for row, (position, expected) in enumerate(zip(first, chain.tolist())):
        if position == expected or (position == big and planned):
            continue
        if position != big and position > expected:
            raise ValueError(
                f"Row {row}'s first token after its {expected} stored prefix tokens has position {position}: "
                "`position_ids` other than the attention mask's running count (`attention_mask.cumsum(-1) - 1`, what "
                f"generate() uses when none are given). The prefix KV were computed once at positions "
                f"0..{expected - 1}. Leave `position_ids` out, or call generate() without this cache."
            )
        position = 0 if position == big else position
        raise ValueError(
            f"Row {row} of this batch does not attend to all {expected} prefix columns of this CascadeCache: its "
            f"first token after them has position {position}. Either the rows are not longer than the prefix (each "
            f"needs a token of its own after its {expected} prefix tokens), or `attention_mask` has zeros over the "
            "prefix columns (left padding before the prefix, as a tokenizer's left-padded batch has, or masked "
            "prefix tokens). The prefix is stored once for every row. Pass `custom_generate=hf_cascade.generate` to "
            "generate(), which accepts the tokenizer's padded batch and checks each row's prefix tokens, or lay rows "
            "out [prefix | pads | suffix] with the mask 1 over the prefix."
        )


def fill_window(input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                rows: Sequence[Sequence[int]], starts: Sequence[int]) -> np.ndarray:
    """Lay ``rows`` (token ids; row ``b``'s first token at position ``starts[b]``, after its chain of shared nodes)
    out in a forward over a :class:`~hf_cascade.cache.CascadeCache` of ``P >= max(starts)`` prefix columns, as
    generate() lays out a left-padded row ``[pads | chain | own tokens]``.

    Args:
        input_ids, position_ids: zeroed int64 ``[B, W]`` (``W`` >= the longest row); attention_mask: zeroed int64
            ``[B, P + W]``. Filled in place: each row right-aligned in the ``W`` window columns, the mask 1 from
            column ``P + pad - start`` on (its chain's columns end where its own tokens start), so column ``j``
            holds position ``j - (leading zeros)``: transformers' chunked-attention mask (Llama 4), which counts
            chunks from a row's first 1, puts the bounds on the row's own positions.
    Returns:
        ``suffix_start`` int64 ``[B]``: each row's first own window column (``pad``); the window columns before it
        stand for chain tokens (read through the prefix levels) and are masked by the cache.
    """
    prefix_length, width = attention_mask.shape[1] - input_ids.shape[1], input_ids.shape[1]
    suffix_start = np.zeros(len(rows), dtype=np.int64)
    for i, (tokens, start) in enumerate(zip(rows, starts)):
        pad = width - len(tokens)
        if start > prefix_length or pad < 0:
            raise ValueError(f"fill_window: row {i} ({len(tokens)} tokens from position {start}) does not fit "
                             f"{prefix_length} prefix columns and a window of {width}.")
        input_ids[i, pad:] = np.fromiter(tokens, np.int64, len(tokens))
        position_ids[i, pad:] = np.arange(start, start + len(tokens))
        attention_mask[i, prefix_length + pad - start:] = 1
        suffix_start[i] = pad
    return suffix_start


def window_layout(rows: Sequence[Sequence[int]], starts: Sequence[int], prefix_length: int):
    """:func:`fill_window` into new CPU tensors: ``(input_ids [B, W], attention_mask [B, P + W], position_ids [B, W],
    suffix_start [B])``, all int64, ``W`` the longest row, ``P = prefix_length`` (at least ``max(starts)``)."""
    width = max(len(row) for row in rows)
    input_ids, position_ids = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
    attention_mask = np.zeros((len(rows), prefix_length + width), np.int64)
    suffix_start = fill_window(input_ids, attention_mask, position_ids, rows, starts)
    return tuple(torch.from_numpy(a) for a in (input_ids, attention_mask, position_ids, suffix_start))


def _chains(levels_so_far: int, parents: Sequence[Sequence[int | None]], node_parent: list[int | None]):
    """``[levels_so_far, N]`` int64 chain of ancestor node indices for each new node (row)."""
    rows = torch.full((levels_so_far, len(node_parent)), -1, dtype=torch.int64)
    for i, parent in enumerate(node_parent):
        for level in range(levels_so_far - 1, -1, -1):
            if parent is None:
                break
            rows[level, i] = parent
            parent = parents[level][parent]
    return rows


@torch.no_grad()
def prefill_levels(
    model: torch.nn.Module,
    node_levels: Sequence[Sequence[NodeSpec]],
    base_levels: Sequence = (),
    base_parents: Sequence[Sequence[int | None]] = (),
    *,
    cache_class,
    compile_layers: bool = False,
    builtin_kernels: bool = False,
) -> list:
    """Run the model over every node once and return the packed :class:`PrefixLevel` list.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"``.
        node_levels: ``node_levels[l]`` lists level ``l``'s nodes as ``(tokens, parent index, start position)``.
        base_levels: already-prefilled levels the new ones hang below (their parents index into them).
        base_parents: the parent index of each node of ``base_levels``.
        cache_class: :class:`~hf_cascade.cache.CascadeCache` (passed in: the cache imports this module).
        compile_layers: run each level's forward with the decoder layers compiled for any length
            (:func:`~hf_cascade.compiled_layers.compiled_forward`; eager where compiling fails).
        builtin_kernels: the levels below the first attend with PyTorch's own kernels (no Triton build).
    Returns:
        ``base_levels`` followed by the new levels.
    """
    levels = list(base_levels)
    parents = [list(p) for p in base_parents]
    device = model.device
    base_model = model.base_model
    for nodes in node_levels:
        node_parent = [parent for _, parent, _ in nodes]
        lengths = [len(tokens) for tokens, _, _ in nodes]
        width = max(lengths)
        prefix_length = max(start for _, _, start in nodes)
        # On the host: the cache keeps row_nodes there (a copy to the device and back would wait for the level
        # before).
        row_nodes = _chains(len(levels), parents, node_parent) if levels else None
        # The forward's ids, mask and positions in one host buffer: one pinned copy to the device, not three. Built
        # in numpy (one thread; torch's CPU kernels wake their thread pool for long nodes, slow on a busy host).
        rows = len(nodes)
        sizes = (rows * width, rows * (prefix_length + width), rows * width)
        packed = np.zeros(sum(sizes), dtype=np.int64)
        input_ids, attention_mask, position_ids = (
            part.reshape(rows, -1) for part in np.split(packed, np.cumsum(sizes)[:-1])
        )
        suffix_start = fill_window(input_ids, attention_mask, position_ids,
                                   [tokens for tokens, _, _ in nodes], [start for _, _, start in nodes])
        cache = cache_class(model, levels, row_nodes=row_nodes, prefix_length=prefix_length,
                            suffix_start=torch.from_numpy(suffix_start))
        cache.builtin_kernels = builtin_kernels
        cache.positions_checked = True  # (laid out here: fill_window)
        input_ids, attention_mask, position_ids = (
            part.view(rows, -1) for part in host_to_device(torch.from_numpy(packed), device).split(sizes)
        )
        def forward(cache=cache, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids):
            return base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=True, **{CACHE_KWARG: cache})

        if compile_layers:
            compiled_forward(model, cache, forward)
        else:
            forward()
        keys, values = _pack_layers([layer.keys for layer in cache.layers], lengths), \
            _pack_layers([layer.values for layer in cache.layers], lengths)
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        levels.append(PrefixLevel([tokens for tokens, _, _ in nodes], starts, keys, values))
        parents.append(node_parent)
        del cache
    return levels


def _pack_layers(suffixes: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """Per layer ``[N, Hkv, width, D]`` left-padded rows -> per layer ``[Hkv, sum(lengths), D]`` with the padding
    dropped: views of one ``[layers, Hkv, sum(lengths), D]`` tensor (a compiled step takes a level's KV of every
    layer as that one tensor; see ``CascadeCache._pad_prefix_levels``), or separate tensors when layers' KV shapes
    differ."""
    first = suffixes[0]
    width = first.shape[2]
    if any(s.shape != first.shape or s.dtype != first.dtype for s in suffixes):  # layers of other KV shapes: apart
        return [torch.cat([s[i, :, width - n :] for i, n in enumerate(lengths)], dim=1) for s in suffixes]
    stacked = first.new_empty((len(suffixes), first.shape[1], sum(lengths), first.shape[3]))
    for layer, suffix in enumerate(suffixes):
        parts = [suffix[i, :, width - length :] for i, length in enumerate(lengths)]
        torch.cat(parts, dim=1, out=stacked[layer])
    return list(stacked.unbind(0))
