"""Zigzag sequence sharding for causal context parallelism.

A sequence of ``length`` tokens is padded at its *end* to ``padded = 2 * world_size * chunk`` tokens and cut into
``2 * world_size`` chunks of ``chunk`` tokens. Rank ``r`` holds chunks ``r`` and ``2 * world_size - 1 - r``, in
that order. Under a causal mask every rank then does the same amount of attention work (a contiguous split gives
the last rank ``world_size`` times the work of the first), and in the ring each rank only ever needs half of a
visiting block (see :mod:`hf_cascade.parallel.ring`):

* block from a rank ``src < r``: its first chunk precedes both of ours (visible to all our queries, no mask), its
  second chunk follows both of ours (never visible);
* block from a rank ``src > r``: both its chunks lie between our two chunks: visible to our second chunk only.

The end padding only ever sees itself (it lies after every real token), so it never changes a real token's
output; :class:`ZigzagLayout` tells each rank which of its columns are real so the cache can drop the rest.

Positions stay global: a rank's local tokens carry their global column indices and the model receives their
global ``position_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZigzagLayout:
    """Where each of ``length`` global columns lives when sharded zigzag over ``world_size`` ranks.

    Attributes:
        length: number of real columns (tokens) in the sequence, ``>= 0``.
        world_size: number of ranks ``N >= 1``.
    """

    length: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"ZigzagLayout: world_size must be an int >= 1; got {self.world_size!r}.")
        if not isinstance(self.length, int) or self.length < 0:
            raise ValueError(f"ZigzagLayout: length must be an int >= 0; got {self.length!r}.")

    @property
    def num_chunks(self) -> int:
        """``2 * world_size``."""
        return 2 * self.world_size

    @property
    def chunk(self) -> int:
        """Tokens per chunk: ``ceil(length / (2 * world_size))`` (0 for an empty sequence)."""
        return -(-self.length // self.num_chunks)

    @property
    def padded_length(self) -> int:
        """``2 * world_size * chunk`` >= ``length``; columns ``length..padded_length-1`` are end padding."""
        return self.chunk * self.num_chunks

    @property
    def local_length(self) -> int:
        """Columns per rank including end padding: ``2 * chunk`` (the same on every rank)."""
        return 2 * self.chunk

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ZigzagLayout: rank must be in [0, {self.world_size}); got {rank}.")

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` holds: ``(rank, 2 * world_size - 1 - rank)``."""
        self._check_rank(rank)
        return rank, self.num_chunks - 1 - rank

    def columns(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global column indices held by ``rank``, padding included: int64 ``[2 * chunk]``, ascending."""
        first, second = self.chunk_ids(rank)
        c = self.chunk
        return torch.cat([
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ])

    def real_columns(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global column indices of ``rank``'s real (non end-padding) tokens: int64 ``[n_r]``, ascending."""
        cols = self.columns(rank, device)
        return cols[cols < self.length]

    def num_real(self, rank: int) -> int:
        """How many real tokens ``rank`` holds (``real_columns(rank).numel()`` without building it)."""
        c, n = self.chunk, self.length
        return sum(max(0, min(n, (k + 1) * c) - k * c) for k in self.chunk_ids(rank))

    def owners(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The rank owning each real column: int64 ``[length]``."""
        if self.length == 0:
            return torch.zeros(0, dtype=torch.long, device=device)
        chunk_of = torch.arange(self.length, device=device) // self.chunk
        return torch.where(chunk_of < self.world_size, chunk_of, self.num_chunks - 1 - chunk_of)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1, pad_value: float | int = 0) -> torch.Tensor:
        """``rank``'s zigzag shard of ``x`` along ``dim`` (of size ``length``), end-padded with ``pad_value``.

        Args:
            x: any tensor whose ``dim`` axis is the sequence (e.g. ``input_ids [batch, length]``).
        Returns:
            ``x`` restricted to ``columns(rank)`` along ``dim``: size ``2 * chunk`` on that axis, same dtype/device.
        """
        dim = dim % x.dim()
        if x.shape[dim] != self.length:
            raise ValueError(
                f"ZigzagLayout.shard: x has {x.shape[dim]} entries along dim {dim} (shape {tuple(x.shape)}) but the "
                f"layout was built for length {self.length}."
            )
        pad = self.padded_length - self.length
        if pad:
            pad_shape = list(x.shape)
            pad_shape[dim] = pad
            x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
        return x.index_select(dim, self.columns(rank, x.device))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: put every rank's shard back in global order and drop the end padding.

        Args:
            shards: ``world_size`` tensors, rank order, each of size ``2 * chunk`` along ``dim``.
        Returns:
            a tensor of size ``length`` along ``dim``.
        """
        if len(shards) != self.world_size:
            raise ValueError(f"ZigzagLayout.unshard: expected {self.world_size} shards; got {len(shards)}.")
        dim = dim % shards[0].dim()
        c = self.chunk
        pieces: list[torch.Tensor | None] = [None] * self.num_chunks
        for rank, s in enumerate(shards):
            if s.shape[dim] != 2 * c:
                raise ValueError(
                    f"ZigzagLayout.unshard: shard of rank {rank} has {s.shape[dim]} entries along dim {dim}; "
                    f"expected {2 * c}."
                )
            first, second = self.chunk_ids(rank)
            pieces[first] = s.narrow(dim, 0, c)
            pieces[second] = s.narrow(dim, c, c)
        return torch.cat(pieces, dim=dim).narrow(dim, 0, self.length)
