"""Run a function on N CPU processes joined by a gloo group (tests and docs; no GPU, no launcher needed), or on N
GPUs joined by an NCCL group (the GPU tests: ``backend="nccl"``, rank r on ``cuda:r``, always spawned).

>>> from hf_cascade.parallel._testing import run_on_gloo
>>> results = run_on_gloo(my_fn, world_size=2, args=(...,))   # my_fn(rank, world_size, *args) -> picklable

``my_fn`` must be defined at the top level of an importable module (the ``spawn`` start method pickles it by
name). Each worker runs with one intra-op thread (CI machines have few cores; forked workers must not use the
parent's OpenMP pool).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import threading
import time
import traceback


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, out_dir, pg_timeout_s, args, backend="gloo"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _failure_report(out_dir: str, failed: list[tuple[int, int]]) -> str:
    """Tracebacks of the failed workers, root causes first (peers of a crashed rank fail with connection errors)."""
    reports = []
    for rank, code in failed:
        path = os.path.join(out_dir, f"rank{rank}.err")
        text = open(path).read() if os.path.exists(path) else f"(exit code {code}, no Python traceback)\n"
        secondary = "Connection closed by peer" in text or "Connection reset" in text
        reports.append((secondary, f"--- rank {rank} (exit code {code}):\n{text}"))
    return "".join(text for _, text in sorted(reports, key=lambda r: r[0]))


def run_on_gloo(
    fn,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 120.0,
    start_method: str | None = None,
    backend: str = "gloo",
):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes with a gloo default group (``backend=
    "nccl"``: an NCCL group, rank r on ``cuda:r``, spawned).

    ``start_method``: "fork" or "spawn". Default: "fork" where available and this process runs no thread but the
    main one (the workers inherit the imported modules: starting them costs milliseconds, not the seconds ``import
    transformers`` takes); else "spawn". Forking after threads started (Inductor's compile workers, a thread pool)
    can leave a child waiting forever on a lock a vanished thread held: workers that compile must use "spawn".

    Returns the list of the workers' return values (rank order). A worker that raises makes this raise (with the
    worker's traceback); workers still alive after ``timeout_s`` seconds are killed and a TimeoutError raised.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if backend == "nccl":
        start_method = "spawn"  # (CUDA cannot be used in a forked child)
    if start_method is None:
        single_threaded = threading.active_count() == 1
        start_method = "fork" if single_threaded and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, free_port(), out_dir, pg_timeout_s, args, backend),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not all(p.exitcode is not None for p in ctx.processes):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_on_gloo: {world_size} workers still running after {timeout_s} s.")
                time.sleep(0.05)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        failed = [(rank, p.exitcode) for rank, p in enumerate(ctx.processes) if p.exitcode != 0]
        if failed:
            raise RuntimeError("run_on_gloo: workers failed:\n" + _failure_report(out_dir, failed))
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
