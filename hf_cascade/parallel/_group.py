"""The process group context parallelism runs on: lookup, launch errors, device checks.

torch.distributed is the only transport. The group is the default group (the one ``torchrun`` /
``accelerate launch`` + ``accelerate.PartialState()`` / ``torch.distributed.init_process_group`` set up)
unless a sub-group is passed explicitly.

Failure behaviour: every collective and P2P transfer here waits at most the group's timeout, set where the
group is created: ``init_process_group(..., timeout=datetime.timedelta(seconds=60))``, or with Accelerate
``PartialState(timeout=datetime.timedelta(seconds=60))`` / ``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(
timeout=...)])`` (torch's defaults: 10 min for NCCL, 30 min for gloo). gloo raises once it expires, or as soon as a
dead peer's connection closes; for NCCL the watchdog aborts the communicator and fails the process when an operation
exceeds the timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default). A rank that errors or dies therefore makes
the others fail within the timeout instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAUNCH_HELP = (
    "Launch one process per GPU with `torchrun --nproc_per_node N your_script.py` or "
    "`accelerate launch --num_processes N your_script.py`, and create the process group first: "
    "`accelerate.PartialState()` (on CPU: `PartialState(cpu=True)`, gloo backend) or "
    "`torch.distributed.init_process_group(backend='nccl' or 'gloo')`. Note that `accelerate launch --cpu` "
    "starts a single process; on CPU use `torchrun --nproc_per_node N`."
)


@dataclass(frozen=True)
class GroupInfo:
    """A resolved process group.

    Attributes:
        group: the ``ProcessGroup`` (None = the default group, as torch.distributed accepts).
        rank: this process's rank in ``group``.
        world_size: number of ranks in ``group``.
        global_ranks: ``global_ranks[i]`` is the default-group rank of group rank ``i`` (what P2P ops take).
        backend: the group's backend string, e.g. ``"nccl"``, ``"gloo"``.
    """

    group: object
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    backend: str

    def peer(self, group_rank: int) -> int:
        """Default-group rank of ``group_rank`` (modulo the world size)."""
        return self.global_ranks[group_rank % self.world_size]


def resolve_group(group=None, *, caller: str = "context_parallel_inputs") -> GroupInfo:
    """Return the :class:`GroupInfo` of ``group`` (default: the default group).

    Raises:
        ValueError: torch.distributed is not available or no process group is initialised (explains how to launch).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError(
            f"{caller}: this torch build has no torch.distributed support, which context parallelism needs. "
            "Install a torch build with distributed support (the PyPI wheels have it)."
        )
    if not dist.is_initialized():
        raise ValueError(
            f"{caller}: no torch.distributed process group is initialised, so there are no ranks to shard the "
            f"prompt over. {LAUNCH_HELP}"
        )
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member of `group`.")
    if group is None:
        global_ranks = tuple(range(world_size))
    else:
        global_ranks = tuple(dist.get_global_rank(group, r) for r in range(world_size))
    return GroupInfo(group, rank, world_size, global_ranks, str(dist.get_backend(group)))


def check_device(info: GroupInfo, device: torch.device, caller: str) -> None:
    """Raise a ValueError if the group's backend cannot move tensors on ``device``."""
    backend = info.backend.lower()
    if device.type == "cuda" and "nccl" not in backend:
        raise ValueError(
            f"{caller}: the model is on {device} but the process group backend is {info.backend!r}; GPU context "
            "parallelism needs NCCL (`accelerate.PartialState()` without `cpu=True`, or "
            "`init_process_group('nccl')`)."
        )
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(
            f"{caller}: the model is on the CPU but the process group backend is {info.backend!r}, which cannot move "
            "CPU tensors. On CPU create a gloo group: `accelerate.PartialState(cpu=True)` or "
            "`init_process_group('gloo')`; on GPUs move the model to `PartialState().device`."
        )


def sync_rng(info: GroupInfo, device: torch.device) -> None:
    """Give every rank rank 0's RNG state (CPU, and ``device``'s CUDA generator): one broadcast each.

    Rank 0's own state is left as it was (nothing is drawn), so a seed the user set (``torch.manual_seed(7)``)
    gives the draws a single-process run with that seed makes, on every rank."""
    import torch.distributed as dist

    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    for index, state in enumerate(states):
        size = torch.tensor([state.numel()], dtype=torch.long, device=device)
        dist.broadcast(size, src=info.global_ranks[0], group=info.group)
        moved = state.to(device) if info.rank == 0 else torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.broadcast(moved, src=info.global_ranks[0], group=info.group)
        if info.rank != 0:
            if index == 0:
                torch.set_rng_state(moved.cpu())
            else:
                torch.cuda.set_rng_state(moved.cpu(), device)


def open_channels(info: GroupInfo, device: torch.device) -> None:
    """Run each kind of exchange the context-parallel prefill makes once, on a few bytes: the ring's send/receive to
    the neighbours, an all-gather and an all-to-all.

    NCCL sets up its buffers for a kind of exchange (and each peer) on first use, outside PyTorch's allocator: on
    4x H100 they took 1.6 GiB per GPU during the first prefill that ran in several rounds. Opened before free
    memory is read, they are counted by the capacity check instead of surprising it."""
    import torch.distributed as dist

    if info.world_size == 1:
        return
    n = info.world_size
    mine = torch.zeros(n, device=device)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine, group=info.group)
    dist.all_to_all_single(torch.empty_like(mine), mine, group=info.group)
    received = torch.empty(1, device=device)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, mine[:1], info.peer(info.rank + 1), info.group),
        dist.P2POp(dist.irecv, received, info.peer(info.rank - 1), info.group),
    ])
    for work in works:
        work.wait()
