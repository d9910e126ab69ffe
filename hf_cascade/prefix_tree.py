"""Find what the rows of a batch share: a tree of shared token segments (nested prefixes).

A batch such as::

    row 0: [system][few-shot A][question 0]
    row 1: [system][few-shot A][question 1]
    row 2: [system][few-shot B][question 2]
    row 3: [system][few-shot B][question 3]

gives level 0 = one node ``[system]`` (rows 0-3) and level 1 = two nodes ``[few-shot A]`` (rows 0, 1) and
``[few-shot B]`` (rows 2, 3). Each node is prefilled and stored once; a row attends to the chain of nodes on its
path from the root, then to its own suffix. A node must be shared by at least ``min_rows`` rows and be at least
``min_shared_tokens`` long (a shorter shared run is folded into its children, or left in the rows' suffixes).
The last token of every row is never shared: generate() must run it through the model to get the first logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixNode:
    """One shared segment.

    Attributes:
        level: depth in the tree (0 = attached to the root).
        tokens: the segment's token ids.
        rows: the batch rows whose prompt goes through this node.
        parent: index of the parent node in ``levels[level - 1]`` (None at level 0).
        start: position of the segment's first token in every row (the length of the parent chain).
    """

    level: int
    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    parent: int | None
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixTree:
    """Nested shared prefixes of a batch.

    Attributes:
        levels: ``levels[l]`` lists the nodes of depth ``l``.
        row_nodes: ``row_nodes[l][r]`` is the index in ``levels[l]`` of row ``r``'s node, or -1.
        row_prefix_len: ``row_prefix_len[r]`` is how many leading tokens of row ``r`` are shared (its chain length).
    """

    levels: list[list[PrefixNode]] = field(default_factory=list)
    row_nodes: list[list[int]] = field(default_factory=list)
    row_prefix_len: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.row_prefix_len)

    @property
    def shared_tokens(self) -> int:
        """Tokens stored once in the tree (the sum of node lengths)."""
        return sum(len(node.tokens) for level in self.levels for node in level)

    @property
    def saved_tokens(self) -> int:
        """Prefix tokens that would have been prefilled and stored per row, minus those stored once."""
        return sum(self.row_prefix_len) - self.shared_tokens

    def describe(self) -> str:
        """A short human-readable summary, e.g. ``'2 levels: [1 node: 40 tok x 8 rows] [2 nodes: 24, 24 tok]'``."""
        if not self.levels:
            return "no shared prefix"
        parts = []
        for level in self.levels:
            lengths = ", ".join(f"{len(n.tokens)} tok x {len(n.rows)} rows" for n in level)
            parts.append(f"[{len(level)} node{'s' if len(level) > 1 else ''}: {lengths}]")
        return f"{len(self.levels)} level{'s' if len(self.levels) > 1 else ''}: " + " ".join(parts)


def find_shared_prefixes(
    rows: Sequence[Sequence[int]] | torch.Tensor,
    *,
    min_shared_tokens: int = 4,
    min_rows: int = 2,
    max_levels: int = 4,
    keep_node: Callable[[int, int, float], bool] | None = None,
) -> PrefixTree:
    """Build the tree of nested shared prefixes of ``rows`` (token ids, no padding inside a row).

    Args:
        rows: one token-id sequence per batch row (real tokens only): lists or tuples of ints, numpy arrays, 1-D
            tensors; or one 2-D integer tensor ``[B, L]`` whose shorter rows end with -1 (row ``r`` is its entries
            before its first -1), the fastest form for long rows (compared as arrays, not token by token in Python).
        min_shared_tokens: shortest segment worth a node of its own (shorter runs fold into their children).
        min_rows: fewest rows that must share a segment.
        max_levels: deepest nesting kept; deeper sharing stays in the rows' suffixes.
        keep_node: optional ``(rows, tokens, mean tokens each row has after the segment) -> bool`` veto (e.g.
            :meth:`CascadeCostModel.share`): a segment it rejects is treated like a too-short one (folded into its
            children or left in the rows' suffixes).
    Returns:
        A :class:`PrefixTree`; row order is the order of ``rows``; node tokens are tuples of Python ints.
    """
    if min_shared_tokens < 1:
        raise ValueError(f"`min_shared_tokens` must be >= 1; got {min_shared_tokens}.")
    if min_rows < 2:
        raise ValueError(f"`min_rows` must be >= 2 (a segment of one row is not shared); got {min_rows}.")
    if max_levels < 0:
        raise ValueError(f"`max_levels` must be >= 0; got {max_levels}.")
    # Never share a row's last token: it must go through the model in generate() to produce the first logits.
    seqs = _TensorRows(rows) if isinstance(rows, torch.Tensor) else _TupleRows(rows)
    lengths = seqs.lengths
    tree = PrefixTree(row_prefix_len=[0] * len(lengths))

    def add_node(level: int, group: list[int], start: int, end: int, parent: int | None) -> int:
        while len(tree.levels) <= level:
            tree.levels.append([])
            tree.row_nodes.append([-1] * len(lengths))
        index = len(tree.levels[level])
        tree.levels[level].append(PrefixNode(level, seqs.tokens(group[0], start, end), tuple(group), parent, start))
        for r in group:
            tree.row_nodes[level][r] = index
            tree.row_prefix_len[r] = end
        return index

    # Explicit stack instead of recursion: (rows, next column to split at, level, parent, start of pending node).
    stack = [(list(range(len(lengths))), 0, 0, None, 0)]
    while stack:
        group_rows, split_at, level, parent, node_start = stack.pop()
        if level >= max_levels:
            continue
        longer = [r for r in group_rows if lengths[r] > split_at]
        by_token: dict[int, list[int]] = {}
        for r, token in zip(longer, seqs.tokens_at(longer, split_at)):
            by_token.setdefault(token, []).append(r)
        children = []
        for group in by_token.values():
            if len(group) < min_rows:
                continue
            end = seqs.common_prefix_end(group, split_at)
            too_small = end - node_start < min_shared_tokens
            if not too_small and keep_node is not None:
                after = sum(lengths[r] + 1 - end for r in group) / len(group)  # +1: the unshared last token
                too_small = not keep_node(len(group), end - node_start, after)
            if too_small:
                # Too short for a node: keep it pending and let the sub-groups carry it.
                children.append((group, end, level, parent, node_start))
            else:
                index = add_node(level, group, node_start, end, parent)
                children.append((group, end, level + 1, index, end))
        stack.extend(reversed(children))
    return tree


class _TupleRows:
    """The rows as tuples of Python ints, each without its last token (never shared)."""

    def __init__(self, rows: Sequence[Sequence[int]]):
        self.seqs = [_token_tuple(row)[:-1] for row in rows]
        self.lengths = [len(seq) for seq in self.seqs]

    def tokens_at(self, group: list[int], column: int) -> list[int]:
        """The token at ``column`` of each row of ``group`` (rows longer than ``column``)."""
        return [self.seqs[r][column] for r in group]

    def tokens(self, row: int, start: int, end: int) -> tuple[int, ...]:
        return self.seqs[row][start:end]

    def common_prefix_end(self, group: list[int], start: int) -> int:
        """First column >= start where the rows of ``group`` differ (or the shortest row ends)."""
        seqs = self.seqs
        first = seqs[group[0]]
        end = min(self.lengths[r] for r in group)
        for r in group[1:]:
            seq = seqs[r]
            i = start
            # Whole blocks compared as tuple slices (in C), then token by token inside the first block that differs.
            while i + _BLOCK <= end and seq[i : i + _BLOCK] == first[i : i + _BLOCK]:
                i += _BLOCK
            while i < end and seq[i] == first[i]:
                i += 1
            end = i
        return end


class _TensorRows:
    """The rows of a ``[B, L]`` integer tensor padded with -1 at the end, as a numpy int64 array (numpy: one thread;
    torch's CPU kernels wake their thread pool for arrays this size, slow on a busy GPU host); ``lengths`` leaves out
    each row's last token (never shared)."""

    def __init__(self, rows: torch.Tensor):
        if rows.dim() != 2 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise ValueError(
                f"`rows` as a tensor must be a 2-D integer tensor [B, L] of token ids (-1 after a shorter row's "
                f"last token); got {rows.dtype} of shape {tuple(rows.shape)}."
            )
        self.ids = rows.detach().cpu().numpy().astype(np.int64, copy=False)
        real = self.ids >= 0
        misplaced = (self.ids < -1).any(axis=1) | (real[:, 1:] & ~real[:, :-1]).any(axis=1)
        if misplaced.any():
            raise ValueError(
                f"`rows` row {int(np.flatnonzero(misplaced)[0])} holds a negative entry other than the -1 padding "
                "after a shorter row's last token: token ids are >= 0, and a row is padded with -1 only at its end."
            )
        self.lengths = np.maximum(real.sum(axis=1) - 1, 0).tolist()

    def tokens_at(self, group: list[int], column: int) -> list[int]:
        """The token at ``column`` of each row of ``group`` (rows longer than ``column``)."""
        return self.ids[group, column].tolist() if group else []

    def tokens(self, row: int, start: int, end: int) -> tuple[int, ...]:
        return tuple(self.ids[row, start:end].tolist())

    def common_prefix_end(self, group: list[int], start: int) -> int:
        """First column >= start where the rows of ``group`` differ (or the shortest row ends): a block of columns
        of all of them compared at once (``_TENSOR_BLOCK_ELEMENTS`` tokens), block after block up to the first
        difference."""
        end = min(self.lengths[r] for r in group)
        step = max(1, _TENSOR_BLOCK_ELEMENTS // len(group))
        for lo in range(start, end, step):
            block = self.ids[group, lo : min(lo + step, end)]
            differs = np.flatnonzero((block != block[:1]).any(axis=0))
            if differs.size:
                return lo + int(differs[0])
        return max(end, start)


def _token_tuple(row: Sequence[int]) -> tuple[int, ...]:
    """``row`` as a tuple of Python ints: a list of them (what ``tolist()`` gives; its ends checked) as it is, anything
    else (numpy ints, tensors) converted one by one (3x slower for a 4K-token row)."""
    if isinstance(row, list) and all(type(t) is int for t in (*row[:1], *row[-1:])):
        return tuple(row)
    return tuple(map(int, row))


_BLOCK = 256  # tokens per tuple-slice comparison (_TupleRows)
_TENSOR_BLOCK_ELEMENTS = 1 << 18  # tokens of a group's rows compared per numpy comparison (_TensorRows): 2 MiB
