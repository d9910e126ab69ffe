"""On a busy CPU, the cascade call runs single-threaded; on a quiet one, nothing changes.

A cascade decode step on CPU is many small ops (per level and per row: slices, cats, small matmuls against a few
hundred cached keys, the merge), and so are the model's own ops at one token per row. With intra-op parallelism
each of them hands work to OpenMP's other threads and waits for them; when other processes use the cores, a
waited-for thread is often not running and the step stalls; the prefill's larger ops stall too, less often. On a
quiet CPU the threads pay. So the call measures, twice, whether torch's threads get their cores (this process's
CPU time over wall time, all threads, against ``BUSY_FRACTION`` of the threads):

1. before the prefill, ``PROBE_S`` (15 ms) of small matmuls: if busy, the whole call runs with one thread;
2. over the shared prefill itself: if busy, the rows' first forward and the decode steps run with one thread.

Measured on a 2-core machine (SmolLM2-135M, the demo's 12 chat rows, whole generate() calls, the policies
interleaved in one process): quiet, 1.75 s with two threads against 2.13 s with one-thread steps; beside 3 busy
processes, 45 s with two threads, 12.8 s with one-thread steps, 5.9 s with one thread for the whole call. The probe
of 1. reads 1.94-1.99 (of 2 threads) on the quiet machine and 0.65-1.0 beside 3 busy processes.

``torch.set_num_threads`` is process-wide: other torch work in the process during the decode steps of such a call
also runs single-threaded until the steps end. ``cascade_options=dict(cpu_decode_threads=...)``: ``"auto"``
(default, the above), an int (always at most that many threads for the steps), or None (never change them).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

DEFAULT_CPU_DECODE_THREADS = "auto"
BUSY_FRACTION = 0.75  # of torch's threads that must have been running during the prefill, for the CPU to be quiet
MIN_PROBE_S = 0.05  # a shorter prefill says nothing: the threads are left as they are
PROBE_S = 0.015  # the probe before the prefill: enough ~1 ms matmuls to tell 2 threads running from 0.7


def check_threads(value):
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"`cascade_options['cpu_decode_threads']` must be 'auto', None or an int >= 1; got {value!r}.")


class ContentionProbe:
    """Times a block (wall clock and this process's CPU time, all threads); :meth:`decode_threads` then gives the
    thread count for the decode steps under ``policy``."""

    def __init__(self, device: torch.device | str, policy):
        self.cpu = torch.device(device).type == "cpu"
        self.policy = policy
        self.wall_s = self.cpu_s = None
        self.busy_before = False  # the probe before the prefill found the CPU busy: the whole call single-threaded
        self._threads = contextlib.nullcontext()

    def probe_before(self) -> bool:
        """``PROBE_S`` of small parallel matmuls: True when torch's threads did not get their cores."""
        threads = torch.get_num_threads()
        if not self.cpu or self.policy != "auto" or threads <= 1:
            return False
        m = torch.ones(256, 256)
        torch.mm(m, m)  # wake the thread pool
        wall, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - wall < PROBE_S:
            torch.mm(m, m)
        used = (time.process_time() - cpu) / (time.perf_counter() - wall)
        return used < BUSY_FRACTION * min(threads, os.cpu_count() or threads)

    def __enter__(self):
        self.busy_before = self.probe_before()
        self._threads = cpu_decode_threads("cpu", 1 if self.busy_before else None)
        self._threads.__enter__()
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu
        self._threads.__exit__(*exc)
        return False

    def busy(self) -> bool:
        """True when torch's threads got less than ``BUSY_FRACTION`` of a core each during the block."""
        threads = torch.get_num_threads()
        if not self.cpu or threads <= 1 or self.wall_s is None or self.wall_s < MIN_PROBE_S:
            return False
        return self.cpu_s / self.wall_s < BUSY_FRACTION * min(threads, os.cpu_count() or threads)

    def decode_threads(self) -> int | None:
        if not self.cpu or self.policy is None:
            return None
        if self.policy == "auto":
            return 1 if self.busy_before or self.busy() else None
        return self.policy


@contextlib.contextmanager
def cpu_decode_threads(device: torch.device | str, threads: int | None):
    """Run the block with at most ``threads`` intra-op threads when ``device`` is a CPU (restored after)."""
    before = torch.get_num_threads()
    if threads is None or torch.device(device).type != "cpu" or before <= threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
