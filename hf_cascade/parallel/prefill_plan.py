"""The context-parallel prefill in rounds: a bounded working set at any prompt length.

A prompt of ``length`` columns is cut into consecutive **rounds** of ``world_size * rank_tokens`` columns (the last
one shorter). Every round is sharded zigzag over the ranks (:class:`~hf_cascade.parallel.layout.ZigzagLayout`), so
each rank runs at most ``rank_tokens`` columns through the model at a time: projections, rotary, MLP and the
attention blocks all see one round, whatever the prompt's length. Each rank writes its real columns' KV in place
into storage sized once for the whole prompt (:meth:`PrefillPlan.num_real` columns per rank), so nothing is
copied or re-allocated as the prompt grows.

A round's attention is exact: its queries against the round's own keys (zigzag ring,
:func:`~hf_cascade.parallel.ring.ring_states`) merged by log-sum-exp with their state against every earlier
round's keys, which every rank holds an equal share of (:func:`~hf_cascade.parallel.ring.past_state`: the round's
queries are all-gathered, each rank attends them to its stored keys, and the partial states travel back in one
all-to-all). Both parts move queries or states, never the stored KV, so the traffic per round does not grow with
the prompt.

A prompt that fits one round is the plain zigzag ring prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_cascade.parallel.layout import ZigzagLayout

ROUND_TOKENS_PER_ROW = 16384  # default columns a rank runs through the model at a time (one row)
ROUND_TOKENS_ALL_RANKS = 65536  # ... and at most this many over all ranks (the gathered queries of a round)
MIN_ROUND_TOKENS = 64


def default_rank_tokens(world_size: int, batch: int) -> int:
    """Columns each rank runs through the model per round by default: ``min(16384, 65536 / world_size) / batch``,
    even, at least 64. Bounds the activations (``~ batch * rank_tokens``) and the round's gathered queries
    (``~ world_size * batch * rank_tokens``)."""
    tokens = min(ROUND_TOKENS_PER_ROW, ROUND_TOKENS_ALL_RANKS // max(1, world_size)) // max(1, batch)
    return max(MIN_ROUND_TOKENS, tokens - tokens % 2)


def check_rank_tokens(value) -> int | None:
    """Validate the ``prefill_chunk_tokens`` option: None (default) or an even int >= 2."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise ValueError(
            f"`prefill_chunk_tokens` must be an even int >= 2 (prompt columns each rank runs through the model at a "
            f"time; default {default_rank_tokens(1, 1)} for one row); got {value!r}."
        )
    return value


@dataclass(frozen=True)
class PrefillRound:
    """One round of a :class:`PrefillPlan`.

    Attributes:
        index: the round's position in the plan.
        start: global column of the round's first column.
        layout: the round's zigzag sharding (``layout.length`` columns).
        offset: columns this rank stored in the earlier rounds (where this round's go in its storage).
    """

    index: int
    start: int
    layout: ZigzagLayout
    offset: int


@dataclass(frozen=True)
class PrefillPlan:
    """How ``length`` prompt columns are prefilled over ``world_size`` ranks, ``rank_tokens`` per rank at a time.

    Attributes:
        length: prompt columns to prefill (>= 0).
        world_size: ranks.
        rank_tokens: columns per rank per round (even, >= 2); a round holds ``world_size * rank_tokens``.
    """

    length: int
    world_size: int
    rank_tokens: int

    def __post_init__(self) -> None:
        check_rank_tokens(self.rank_tokens)

    @property
    def round_length(self) -> int:
        return self.world_size * self.rank_tokens

    @property
    def num_rounds(self) -> int:
        return -(-self.length // self.round_length)

    def rounds(self, rank: int) -> list[PrefillRound]:
        """The rounds in order, with ``rank``'s storage offsets."""
        out, offset = [], 0
        for index in range(self.num_rounds):
            start = index * self.round_length
            layout = ZigzagLayout(min(self.round_length, self.length - start), self.world_size)
            out.append(PrefillRound(index, start, layout, offset))
            offset += layout.num_real(rank)
        return out

    def num_real(self, rank: int) -> int:
        """Prompt columns ``rank`` stores (its KV storage), summed over the rounds."""
        return sum(r.layout.num_real(rank) for r in self.rounds(rank))

    def max_local_columns(self) -> int:
        """The most columns any rank runs through the model at once (the first round's ``2 * chunk``)."""
        return 0 if self.length == 0 else ZigzagLayout(min(self.round_length, self.length), self.world_size).local_length

    def columns(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global columns ``rank`` stores, in storage order (ascending): int64 ``[num_real(rank)]``."""
        parts = [r.layout.real_columns(rank, device) + r.start for r in self.rounds(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


class PrefillState:
    """The prompt's prefill in progress on one rank (``ContextParallelCache.begin_prefill``): the plan, this rank's
    rounds, the round running now, its key masks, the KV storage of every layer and how much free cached memory
    the allocator may keep between layers (``keep_cached`` bytes, :meth:`release_cached`)."""

    def __init__(self, plan: PrefillPlan, rounds: list[PrefillRound], key_valid, shared: bool, *,
                 keep_cached: int = 0):
        self.plan, self.rounds, self.key_valid, self.shared = plan, rounds, key_valid, shared
        self.keep_cached = int(keep_cached)
        self.releases = 0  # times release_cached handed segments back (benchmarks read it)
        self.columns: torch.Tensor | None = None  # int64 [plan.num_real(rank)]: global columns, storage order
        self.current: PrefillRound | None = None
        self.round_valid = None  # bool [B, round padded length] or None
        self.past_valid = None  # bool [B, current.offset] or None
        self._blocks = None  # (keys [layers, B, Hkv, n, D], values [...]): every layer's storage, one allocation each
        self._workspaces: dict[str, torch.Tensor] = {}  # flat, by use: shared by every layer and round

    def storage(self, layer_idx: int, num_layers: int, key_states, value_states):
        """Layer ``layer_idx``'s KV storage ``([B, Hkv, n, Dk], [B, Hkv, n, Dv])`` for this rank's ``n`` columns.

        The first layer to ask allocates every layer's at once (two allocations for the whole cache, made before
        the rounds' temporaries: no fragmentation as the prompt grows); a layer of another shape gets its own."""
        capacity = self.columns.numel()
        k_shape = (*key_states.shape[:2], capacity, key_states.shape[3])
        v_shape = (*value_states.shape[:2], capacity, value_states.shape[3])
        if self._blocks is None:
            self._blocks = (key_states.new_empty((num_layers, *k_shape)), value_states.new_empty((num_layers, *v_shape)))
        keys, values = self._blocks
        if keys.shape[1:] == k_shape and values.shape[1:] == v_shape and keys.dtype == key_states.dtype:
            return keys[layer_idx], values[layer_idx]
        return key_states.new_empty(k_shape), value_states.new_empty(v_shape)

    def workspace(self, numel: int, like: torch.Tensor, use: str = "past") -> torch.Tensor:
        """A flat scratch tensor of at least ``numel`` elements of ``like``'s dtype and device for ``use``, made once
        and handed to every layer of every round: ``"past"``, :func:`~hf_cascade.parallel.ring.past_state`'s
        gathered queries and states; ``"ring"``, :func:`~hf_cascade.parallel.ring.ring_states`' two exchange
        buffers. The largest temporaries of a round are then not freed and re-made per layer, so they leave no
        holes behind; and buffers that NCCL's stream still uses when the host has moved on (an exchange's) are never
        freed, so the allocator does not make new segments beside them while it waits for the stream."""
        ws = self._workspaces.get(use)
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            self._workspaces.pop(use, None)  # (the old one goes before the new one is made)
            self._workspaces[use] = ws = like.new_empty(numel)
        return ws

    def release_cached(self, device: torch.device) -> bool:
        """At a layer's attention: hand PyTorch's cached free CUDA segments back when they hold more than
        ``keep_cached`` bytes. Returns whether it did.

        The layer before leaves its temporaries' segments cached (the MLP's, the norms', the ring's) and the next
        layer reuses them; but temporaries of other sizes split them and new segments pile up: a 128K prefill on 4x
        H100 made eleven 448 MiB MLP segments where three are live at once (1.21x reserved / allocated,
        results/cp_memory_probe.jsonl). Handing them back at every layer kept reserved within 1.09x of allocated
        (4x H200, 1.04x at 1M) but costs a device sync and fresh cudaMallocs per layer (~4% of a 512K prefill,
        ~10% at 128K); past one round's temporaries (``keep_cached``) it is the pile-up, not the reuse."""
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if cached <= self.keep_cached:
            return False
        torch.cuda.empty_cache()
        self.releases += 1
        return True
