"""Shared helpers for the benchmarks: machine/version record, JSON-lines output, CUDA timing."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_sha() -> str:
    """$HF_CASCADE_GIT_SHA when set (the device copy's .git may not be the commit that runs), else git's HEAD."""
    if os.environ.get("HF_CASCADE_GIT_SHA"):
        return os.environ["HF_CASCADE_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def machine_info() -> dict:
    """GPU name, driver-visible memory, and the versions a result depends on."""
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    return info


class ResultWriter:
    """Appends one JSON object per line to ``path`` (and to $OUT/<name> when run on the device machine)."""

    def __init__(self, name: str, path: str | Path | None = None):
        self.path = Path(path) if path else RESULTS_DIR / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.mirror = Path(os.environ["OUT"]) / name if os.environ.get("OUT") else None
        if self.mirror is not None and self.mirror.resolve() == self.path.resolve():
            self.mirror = None  # --output already points into $OUT
        self.info = machine_info()

    def write(self, record: dict) -> None:
        line = json.dumps({**self.info, **record}, default=str)
        for path in filter(None, (self.path, self.mirror)):
            with open(path, "a") as f:
                f.write(line + "\n")


RESULT_PREFIX = "RESULT "


def print_child_result(record: dict) -> None:
    """A benchmark's child process hands its record to the parent: one ``RESULT {json}`` line on stdout."""
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def child_result(stdout: str) -> dict | None:
    """The record of :func:`print_child_result` in a child's stdout (its last one), or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def fresh_cache_env(folder: str) -> dict:
    """The environment with every compile cache (Triton, Inductor, hf_cascade's records) in ``folder``."""
    return {**os.environ, "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
            "HF_CASCADE_CACHE": os.path.join(folder, "hf_cascade")}


def compile_bytecode_ahead(prefix: str) -> dict:
    """Compile the Python bytecode of the installed packages and of this checkout into ``prefix`` and point this
    process's environment at it (``PYTHONPYCACHEPREFIX``, bytecode writing on), so that every child process started
    after reads it, as `pip install` leaves a machine (the device image has no bytecode and writes none). Returns
    ``{"mode": "compiled", "seconds", "folders"}``."""
    import sysconfig

    folders = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                      os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders], capture_output=True)
    return {"mode": "compiled", "seconds": round(time.perf_counter() - t, 1), "folders": folders}


def add_shared_workload_args(parser, layers: int = 32, batch: int = 32) -> None:
    """The shared workload's size flags (``bench_generate.make_batch``: ``--batch`` rows sharing ``--prefix`` tokens,
    ``--suffix`` own tokens each, a Llama-3-8B-shaped model of ``--layers`` layers)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=64)


def cuda_time(fn, *, warmup: int = 3, repeat: int = 20) -> dict:
    """Median / p20 / p80 milliseconds of ``fn()`` timed with CUDA events (after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"ms": pick(0.5), "ms_p20": pick(0.2), "ms_p80": pick(0.8)}


def wall_time(fn) -> tuple[float, object]:
    """Seconds of ``fn()`` including device work (synchronised), and its result."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


# torch.compile phases worth reporting (torch._dynamo.utils.compile_times keys), in the order they run.
_COMPILE_PHASES = {
    "_compile.compile_inner": "dynamo_total_s",  # everything torch.compile does for a frame (tracing to code)
    "bytecode_tracing": "dynamo_trace_s",
    "create_aot_dispatcher_function": "aot_s",
    "GraphLowering.run": "inductor_lowering_s",
    "Scheduler.__init__": "inductor_scheduling_s",
    "GraphLowering.codegen": "inductor_codegen_s",
    "async_compile.wait": "triton_build_wait_s",
    "build_guards": "guards_s",
}


def compile_seconds() -> dict:
    """Seconds spent so far in each torch.compile phase of :data:`_COMPILE_PHASES` (process totals)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: round(sum(compilation_time_metrics.get(key, ())), 3) for key, name in _COMPILE_PHASES.items()}


def timed_with_compile_breakdown(fn) -> tuple[float, dict, object]:
    """``wall_time(fn)`` plus the seconds each torch.compile phase took during it (cudagraph recording and
    Triton builds of custom ops are the rest of a compiling call's time)."""
    before = compile_seconds()
    seconds, result = wall_time(fn)
    after = compile_seconds()
    return seconds, {k: round(after[k] - before[k], 3) for k in after}, result


def triton_variants() -> int | None:
    """Compiled variants of hf_cascade's Triton kernels in this process (one per specialisation Triton built), or
    None where Triton's cache cannot be read (interpreter, another Triton)."""
    try:
        from triton.runtime.jit import JITFunction

        from hf_cascade.ops import _cascade_kernel, _merge_kernel, _prefix_kernel, _suffix_kernel
    except Exception:
        return None
    total = 0
    for module in (_cascade_kernel, _merge_kernel, _prefix_kernel, _suffix_kernel):
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None) if isinstance(value, JITFunction) else None
            if caches is None:
                continue
            try:
                total += sum(len(cache[0]) for cache in caches.values())
            except (TypeError, IndexError):
                return None
    return total


class TritonBuilds:
    """Triton compilations in this process, through Triton's compilation listener (``triton.knobs``): each kernel
    build (a miss of Triton's on-disk cache) and its seconds, and each load from that cache. ``snapshot()`` gives the
    totals so far; None fields where this Triton has no listener."""

    def __init__(self):
        self.builds, self.build_s, self.cache_hits = 0, 0.0, 0
        self.available = False
        try:
            from triton import knobs

            previous = knobs.compilation.listener
        except Exception:
            return

        def listener(*args, **kwargs):
            times, hit = kwargs.get("times"), kwargs.get("cache_hit")
            if hit:
                self.cache_hits += 1
            else:
                self.builds += 1
                self.build_s += (times.total if times is not None else 0) / 1e6
            if previous is not None:
                previous(*args, **kwargs)

        knobs.compilation.listener = listener
        self.available = True

    def snapshot(self) -> dict:
        if not self.available:
            return {"triton_builds": None, "triton_build_s": None, "triton_cache_hits": None}
        return {"triton_builds": self.builds, "triton_build_s": round(self.build_s, 3),
                "triton_cache_hits": self.cache_hits}


def triton_cache_dir() -> str | None:
    """The directory Triton builds kernels in now: ``triton.knobs.cache.dir`` on Triton 3.4+ (``TRITON_CACHE_DIR``,
    the directory hf_cascade chose at its first launch, or Triton's default), else ``TRITON_CACHE_DIR`` (None where
    it is unset: Triton's default)."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except Exception:  # no Triton, or one without knobs (< 3.4)
        return os.environ.get("TRITON_CACHE_DIR")


def triton_cache_files() -> int | None:
    """Files in Triton's on-disk kernel caches now (0 on a machine that never built a Triton kernel): the directory
    in effect (:func:`triton_cache_dir`), Triton's default one and Inductor's (which ``torch.compile`` and
    hf_cascade's kernels use where ``TRITON_CACHE_DIR`` is unset, see
    ``hf_cascade.ops._backend.share_compiler_kernel_cache``)."""
    roots = {triton_cache_dir(), os.path.join(os.path.expanduser("~"), ".triton", "cache")}
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        roots.add(os.path.join(cache_dir(), "triton"))
    except Exception:
        pass
    roots = {os.path.realpath(r) for r in roots if r and os.path.isdir(r)}
    roots = [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]  # counted once
    return sum(len(files) for root in roots for _, _, files in os.walk(root))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s), measured now."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, repeat=20)["ms"]
    del src, dst
    return nbytes / (t * 1e-3) / 1e9
