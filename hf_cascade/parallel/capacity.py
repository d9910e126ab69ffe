"""Will this prompt fit? The context-parallel capacity check, before any work.

Every rank computes what the prompt needs on it (:class:`MemoryNeed`: its share of the KV, the prefill's working
set, the decode buffers) and what it has free; ONE small all-gather shares the numbers, and a prompt that does not
fit raises the same ``ValueError`` on every rank at once, naming the longest prompt that fits on this many GPUs and
how many GPUs would hold this one. No rank starts the prefill while a peer is about to fail, so nothing waits on a
failed peer.

The working set is bounded by the prefill's rounds (:mod:`~hf_cascade.parallel.prefill_plan`): it depends on the
columns a rank runs at a time, not on the prompt's length.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_cascade.parallel._group import GroupInfo, open_channels
from hf_cascade.transformers_compat import text_config

GiB = 1 << 30
# Kernels' workspaces, the decode step's logits and graph pools, and the allocator's holes: segments of one round's
# temporaries that another's cannot reuse (1.6 GiB of them when a 1.89M prompt ran out of memory on 4x H100, with
# 2.0 GiB allocated beyond weights + KV: benchmarks/results/context_parallel.jsonl, 2026-11-28).
_SLACK_BYTES = 1792 << 20


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only model's prefill depends on (from its text config).

    Attributes:
        layers: decoder layers holding KV.
        kv_heads, head_dim: KV heads and head size (K and V alike).
        q_heads: query heads.
        hidden, intermediate: residual width and MLP width.
        dtype_bytes: bytes per element of the activations and the KV.
    """

    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    hidden: int
    intermediate: int
    dtype_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        config = text_config(model.config)
        q_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim), q_heads, int(config.hidden_size),
                   int(intermediate), torch.empty(0, dtype=dtype).element_size())

    @property
    def kv_bytes_per_column(self) -> int:
        """KV bytes of one column of one row, all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a prompt needs on one rank (see the module docstring)."""

    kv: int
    working: int
    decode: int

    @property
    def total(self) -> int:
        return self.kv + self.working + self.decode

    @property
    def temporaries(self) -> int:
        """The working set without the fixed slack: the bytes of one round's temporaries, which the allocator may
        keep cached from one layer to the next for the next to reuse (see ``PrefillState.release_cached``)."""
        return max(0, self.working - _SLACK_BYTES)


def working_set_bytes(shape: ModelShape, world_size: int, tokens: int) -> int:
    """Peak bytes beyond weights + KV of one prefill round running ``tokens`` (rows x columns) on a rank.

    The larger of the attention phase (the round's fp32 accumulators, one block of states, the workspace: the past
    state's buffers of every rank's queries and states and the ring's two KV blocks) and the MLP phase (gate, up and
    their product, beside the workspace, which the prefill keeps from layer to layer), plus the residual stream and
    a fixed slack for kernels' workspaces."""
    b, q_width = shape.dtype_bytes, shape.q_heads * shape.head_dim
    residual = 4 * tokens * shape.hidden * b
    # Kept from layer to layer (PrefillState.workspace): the past state's gathered queries and states, and the ring's
    # two K/V exchange blocks.
    workspace = (2 * world_size * tokens * q_width * b + 4 * tokens * shape.kv_heads * shape.head_dim * b
                 if world_size > 1 else 0)
    attention = 3 * tokens * q_width * 4 + workspace + tokens * q_width * b
    mlp = workspace + 3 * tokens * shape.intermediate * b + 2 * tokens * shape.hidden * b
    return residual + max(attention, mlp) + _SLACK_BYTES


def memory_need(shape: ModelShape, *, world_size: int, stored_columns: int, rows: int, round_tokens: int,
                suffix_columns: int, decode_columns: int) -> MemoryNeed:
    """Bytes one rank needs.

    Args:
        stored_columns: prompt columns this rank stores (its zigzag share over every round).
        rows: rows those columns are stored for (1 for a prefix shared by every row).
        round_tokens: rows x columns the rank runs through the model at a time.
        suffix_columns: rows x columns prefilled after a shared prefix (placed on one rank: counted on each).
        decode_columns: rows x decode columns this rank may store (the fixed decode buffers).
    """
    per_column = shape.kv_bytes_per_column
    kv = per_column * (rows * stored_columns + suffix_columns)
    return MemoryNeed(kv=kv, working=working_set_bytes(shape, world_size, round_tokens),
                      decode=per_column * decode_columns)


def free_bytes(device: torch.device, info: GroupInfo) -> int:
    """Bytes this rank may still allocate: on CUDA the device's free memory once PyTorch's allocator has handed back
    the segments nothing uses; on CPU the host's available memory shared by the ranks on it.

    Memory the allocator holds but cannot give to one large allocation is not counted: holes in segments that
    also hold live tensors (the weights') and the private pools of recorded CUDA graphs. Counting them admitted
    prompts whose KV then did not fit (4x H100, 1.87M tokens, 2026-11-28)."""
    if device.type == "cuda":
        open_channels(info, device)  # NCCL's buffers exist before the free memory is read
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        return 1 << 62  # unknown: no check
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    return available // max(1, local)


def check_capacity(need: MemoryNeed, free: int, info: GroupInfo, device: torch.device, *, prompt_tokens: int,
                   rows: int, kv_per_token: int) -> None:
    """Share every rank's need and free bytes (ONE all-gather) and raise the same ValueError on every rank when the
    prompt does not fit on one of them.

    Args:
        need: this rank's :class:`MemoryNeed`.
        free: bytes this rank may allocate (:func:`free_bytes`, or the user's ``memory_per_rank``).
        prompt_tokens: the prompt's length (the message's unit); rows: its rows.
        kv_per_token: KV bytes one prompt token costs over all ranks (every row that stores it).
    Raises:
        ValueError: on every rank, when ``need.total > free`` on any rank.
    """
    mine = torch.tensor([need.total, free, need.working + need.decode, need.kv, need.working, need.decode],
                        dtype=torch.long, device=device)
    everyone = [torch.empty_like(mine) for _ in range(info.world_size)]
    if info.world_size == 1:
        everyone = [mine]
    else:
        dist.all_gather(everyone, mine, group=info.group)
    table = [[int(x) for x in t.tolist()] for t in everyone]
    short = [r for r, (total, avail, *_rest) in enumerate(table) if total > avail]
    if not short:
        return
    r = max(short, key=lambda k: table[k][0] - table[k][1])
    total, avail, fixed, kv, working, decode = table[r]
    room = min(avail_r - fixed_r for _, avail_r, fixed_r, *_ in table)
    # A rank stores at most ceil(L / N) + 2 of an L-token prompt's columns (the last round's zigzag rounding).
    longest = max(0, max(0, room) // max(1, kv_per_token) - 2) * info.world_size
    per_gpu = min(t[1] for t in table) - max(t[2] for t in table)
    gpus = -(-prompt_tokens * kv_per_token // per_gpu) if per_gpu > 0 else None
    need_gpus = (f"this one needs about {gpus} GPUs like these" if gpus else
                 "not even the working set fits: free memory first")
    raise ValueError(
        f"context_parallel_inputs: this prompt does not fit. {prompt_tokens:,} tokens x {rows} row(s) need "
        f"{total / GiB:.2f} GiB on rank {r} (KV {kv / GiB:.2f} GiB + prefill working set {working / GiB:.2f} GiB + "
        f"decode buffers {decode / GiB:.2f} GiB) but rank {r} has {avail / GiB:.2f} GiB free. On these "
        f"{info.world_size} rank(s) the longest prompt that fits is about {longest:,} tokens; {need_gpus}. Launch "
        "more processes (one per GPU), shorten the prompt, lower `max_new_tokens`, or pass a smaller "
        "`prefill_chunk_tokens` (a smaller working set). Nothing was run; every rank raises this error."
    )
