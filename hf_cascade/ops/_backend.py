"""Backend dispatch for the attention ops: is Triton usable, which backend runs a call.

Triton is an optional extra. Nothing here imports it at module import time; the kernel modules
(``_*_kernel.py``) are imported only when a Triton launch actually happens. ``import hf_cascade`` neither imports
Triton nor starts anything: :func:`prepare_triton` (the first use's preparation: the kernel cache shared with
``torch.compile``, Triton's cache key hashed in the background) is called by the code that is about to use the
kernels, and leaves ``os.environ`` as it found it where Triton has its ``knobs`` (3.4 and later).
"""

from __future__ import annotations

import functools
import os
import threading

import torch

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (cached; never raises)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install must not break `import hf_cascade.ops`
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel module is first imported, so set it before the first
    Triton call of the process.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def share_compiler_kernel_cache() -> None:
    """Where ``TRITON_CACHE_DIR`` is unset, build hf_cascade's kernels in the directory ``torch.compile`` (Inductor)
    uses for its own, before the first one is built. Inductor sets ``TRITON_CACHE_DIR`` the first time it loads a
    Triton kernel in a process; without this, the kernels built before that moment are cached in Triton's default
    directory and those built after it in Inductor's, so a later process (which may load its compiled code without
    setting the variable) finds neither half and builds them again (measured: 9.4 s of a process's first stream of
    batches, ``benchmarks/results/generate.jsonl``, 1ee2477).

    Called when a kernel module is imported, i.e. at the first Triton launch (and by :func:`prepare_triton`); once
    per process. Does nothing under the interpreter or where the variable is set. With Triton 3.4 or later the
    directory goes to ``triton.knobs.cache.dir`` and the environment is left as it is; an older Triton reads only the
    environment, so there the variable is set, as Inductor itself would set it."""
    if interpret_mode() or not torch.cuda.is_available():
        return
    use_compilers_ptxas()
    if os.environ.get("TRITON_CACHE_DIR"):
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    except Exception:  # another torch layout: leave Triton's default
        return
    directory = triton_cache_dir(torch.cuda.current_device())
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 (or none: then nothing reads it)
        os.environ["TRITON_CACHE_DIR"] = directory
        return
    propagate = knobs.propagate_env  # a knob set is copied into os.environ unless this is off
    knobs.propagate_env = False
    try:
        knobs.cache.dir = directory
    finally:
        knobs.propagate_env = propagate


def _nvidia_compiler():
    """Triton's NVIDIA backend compiler module, or None where this Triton has none (CPU builds, other layouts)."""
    try:
        from triton.backends.nvidia import compiler
    except Exception:  # noqa: BLE001 (no Triton, or one without the NVIDIA backend)
        return None
    return compiler if hasattr(compiler, "get_ptxas_version") and hasattr(compiler, "get_ptxas") else None


def _executables(paths) -> list[str]:
    """``paths`` that are executable files, each once, in order."""
    seen = []
    for path in paths:
        if path and path not in seen and os.path.isfile(path) and os.access(path, os.X_OK):
            seen.append(path)
    return seen


def _torch_ptxas() -> list[str]:
    """The ``ptxas`` bundled with torch, where the wheel has one (``torch/_inductor/bin`` or ``torch/bin``, by torch
    version): the one Inductor points Triton at."""
    root = os.path.dirname(os.path.abspath(torch.__file__))
    return _executables([os.path.join(root, "_inductor", "bin", "ptxas"), os.path.join(root, "bin", "ptxas")])


def _ptxas_candidates(current: str | None) -> list[str]:
    """Every ``ptxas`` a process of this install may build with: the one Triton points at now, the one
    ``TRITON_PTXAS_PATH`` names, torch's bundled one and Triton's own."""
    compiler = _nvidia_compiler()
    own = None if compiler is None else os.path.join(os.path.dirname(os.path.abspath(compiler.__file__)), "bin",
                                                     "ptxas")
    return _executables([current, os.environ.get("TRITON_PTXAS_PATH"), *_torch_ptxas(), own])


def _per_arch(fn, arch: int):
    """``fn(arch)``, or ``fn()`` where this Triton's function takes no arch (3.5 and earlier: one ``ptxas``)."""
    import inspect

    return fn(arch) if inspect.signature(fn).parameters else fn()


def _ptxas_version(path: str) -> str | None:
    import subprocess

    try:
        return subprocess.check_output([path, "--version"], timeout=30).decode("utf-8")
    except (OSError, subprocess.SubprocessError):
        return None


def _has_built() -> bool:
    """Whether this process's Triton has read its ``ptxas`` version (it does at the first build, once: the version
    is part of every kernel's key on disk from then on)."""
    compiler = _nvidia_compiler()
    cache_info = getattr(getattr(compiler, "get_ptxas_version", None), "cache_info", None)
    return cache_info is not None and cache_info().currsize > 0


def use_compilers_ptxas() -> None:
    """Before this process's first Triton build: build with the ``ptxas`` that ``torch.compile`` (Inductor) builds
    with, torch's bundled one (``torch/bin/ptxas`` or ``torch/_inductor/bin/ptxas`` by torch version), so that a later
    process keys hf_cascade's kernels alike whichever of the two builds first in it.

    Triton keys every kernel on disk by the version of its ``ptxas``, read once per process at its first build.
    Inductor sets ``TRITON_PTXAS_PATH`` to torch's ``ptxas`` where it builds in the process (and in its compile
    workers): measured on the device (torch 2.11, ``benchmarks/probes/probe_disk_keys.py``), Triton's own is CUDA
    12.8's, torch's CUDA 13.0's. Nothing where ``TRITON_PTXAS_PATH`` is set, torch bundles none, or the process has
    built already (changing the binary then would build under a key that names the other); through ``triton.knobs``
    (3.4 and later, ``os.environ`` untouched) or else the variable."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None or _has_built():
        return
    found = _torch_ptxas()
    if not found:
        return
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4 reads the environment only
        os.environ["TRITON_PTXAS_PATH"] = found[0]
        return
    propagate = knobs.propagate_env
    knobs.propagate_env = False
    try:
        knobs.nvidia.ptxas = found[0]
    finally:
        knobs.propagate_env = propagate


def keyed_ptxas(arch: int | None = None) -> str | None:
    """The ``ptxas`` binary whose version this process's Triton keys its kernels by on disk (or, before its first
    build, the one that build will read), for a child process that must build under the same keys: the background
    build's children get it as ``TRITON_PTXAS_PATH``. Without it, a child keys its kernels by whatever ``ptxas`` it
    reads first, and the caller builds the same variants again under its own key (measured: the stall bench's calls
    rebuilt variants the children had built, 1-2.4 s each, ``benchmarks/results/stall.jsonl``). ``arch``: the
    compute capability as Triton writes it (90 for sm_90; default: the current device's). None where this Triton
    has no NVIDIA backend or no version matches."""
    compiler = _nvidia_compiler()
    if compiler is None or (arch is None and not torch.cuda.is_available()):
        return None
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
    built = _has_built()
    if not built:
        use_compilers_ptxas()  # what this process's first build will read
    try:
        current = _per_arch(compiler.get_ptxas, arch).path
    except Exception:  # noqa: BLE001 (no ptxas found: a child finds none either)
        return None
    if not built:
        return current
    try:
        keyed = _per_arch(compiler.get_ptxas_version, arch)  # cached: the version the first build read
    except Exception:  # noqa: BLE001 (another Triton's signature: the child reads its own, as before)
        return None
    for path in _ptxas_candidates(current):
        if _ptxas_version(path) == keyed:
            return path
    return None


def _triton_key_function():
    """Triton's ``triton_key`` (the hash of its sources and ``libtriton``, part of every kernel's cache key), or
    None where this Triton has none."""
    for module in ("triton.compiler.compiler", "triton.runtime.cache"):
        try:
            return getattr(__import__(module, fromlist=["triton_key"]), "triton_key")
        except (ImportError, AttributeError):
            continue
    return None


@functools.cache
def warm_triton_key() -> threading.Thread | None:
    """Start computing Triton's cache key in a daemon thread; returns the thread (None where nothing starts).

    Why. The first kernel a process launches (hf_cascade's or ``torch.compile``'s) waits for Triton to hash its own
    sources and its shared library, even when every kernel is on disk already: 0.53 s on the H100 machine
    (``benchmarks/results/first_call.jsonl``). Started ahead of the first launch (it used to start when
    transformers' attention registry loaded, and ran while the model loaded: the hashing releases the GIL), the
    result lands in Triton's own ``lru_cache``: a new process's time until its first decode step went from 1.14 to
    0.86 s (989ad8e, b4adee6). A launch that comes first computes the key itself, as without this. Only on CUDA,
    not under the interpreter; ``HF_CASCADE_WARM_TRITON_KEY=0`` turns it off. Called by :func:`prepare_triton`;
    once per process (cached)."""
    if (os.environ.get("HF_CASCADE_WARM_TRITON_KEY", "1").strip() == "0" or interpret_mode()
            or not torch.cuda.is_available() or not triton_available()):
        return None
    triton_key = _triton_key_function()
    if triton_key is None:
        return None

    def compute():
        try:
            triton_key()
        except Exception:  # noqa: BLE001 (a launch computes it again and reports any error itself)
            pass

    thread = threading.Thread(target=compute, name="hf_cascade-triton-key", daemon=True)
    thread.start()
    return thread


def _key_thread() -> threading.Thread | None:
    """:func:`warm_triton_key`'s thread where it was started in this process (never starts one)."""
    return warm_triton_key() if warm_triton_key.cache_info().currsize else None


def await_triton_key() -> None:
    """Before a process's first kernel launch: where :func:`warm_triton_key`'s thread is still hashing, wait for it.

    Triton's ``lru_cache`` holds no lock: a launch that comes while the thread runs would hash the same 0.5 GB again
    beside it (measured on the H100: the first Triton-tier call's launch took 0.47 s hashing while the thread ran).
    Waiting costs only what the thread has left (bounded: after 10 s the launch goes on and hashes itself). Called
    when a kernel module is imported (the first launch)."""
    thread = _key_thread()
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=10.0)


def before_first_kernel() -> None:
    """What a kernel module does when it is imported, i.e. just before the process's first launch of its kernels:
    :func:`share_compiler_kernel_cache` and :func:`await_triton_key`."""
    share_compiler_kernel_cache()
    await_triton_key()


def prepare_triton() -> threading.Thread | None:
    """Get Triton ready for hf_cascade's first launches, without waiting for anything: share the kernel cache with
    ``torch.compile`` (:func:`share_compiler_kernel_cache`) and start hashing Triton's cache key in the background
    (:func:`warm_triton_key`; returns its thread, or None where none starts). Idempotent and cheap after the first
    call; does nothing on a machine without CUDA or under the interpreter.

    ``import hf_cascade`` does none of this (it registers the attention name and nothing else): call it where a
    process first commits to hf_cascade's kernels, as early as possible (the sooner, the more of the 0.5 s of
    hashing overlaps the host's own work), e.g. at the start of ``hf_cascade.generate`` or of a warm-up."""
    share_compiler_kernel_cache()
    return warm_triton_key()


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (built on the host) copied to ``device`` without waiting for the work already queued there.

    A copy to CUDA from pageable memory synchronises the stream: the host would wait for, e.g., a prefill in flight
    before it can queue the next launches. From pinned memory the copy is queued like a kernel (the caching host
    allocator keeps the pinned block until the copy is done). A ``tensor`` already pinned is copied from as it is, so
    it must not be changed afterwards.
    """
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def resolve_backend(backend: str, device: torch.device, op: str) -> str:
    """Map the user's ``backend`` argument to ``"triton"`` or ``"torch"`` for tensors on ``device``.

    ``"auto"``: Triton when the tensors are on CUDA and Triton imports, else the fp32 PyTorch path.
    ``"triton"``: forced; needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}; got {backend!r}.")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError(
            f"{op}: backend='triton' but triton is not importable. Install it with "
            "`pip install triton` (or `pip install -e '.[triton]'` in the hf_cascade checkout) or pass backend='torch'."
        )
    if device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"{op}: backend='triton' got tensors on {device}; Triton kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 in the environment (set before the first Triton call) to run them "
            "on the CPU interpreter. Or pass backend='torch'."
        )
    return "triton"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def padded_head_dim(d: int) -> int:
    """BLOCK_D for head_dim ``d``: next power of two, at least 16 (``tl.dot`` needs K >= 16)."""
    return max(16, next_power_of_2(d))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs_target(device: torch.device) -> int:
    """How many programs a split-KV launch should have: one per SM on CUDA.

    On the CPU interpreter a small number keeps the split-KV path exercised without slowing tests.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _sm_count(index)
    return 8


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact "ieee" for fp32 operands (no silent tf32), default else."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_float_dtype(name: str, t: torch.Tensor, op: str) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"{op}: {name} must be float32, float16 or bfloat16; got {t.dtype} "
            f"(shape {tuple(t.shape)}). Cast it with .to(torch.float16) or similar."
        )


def check_lse(name: str, t: torch.Tensor, shape: tuple[int, ...], op: str) -> None:
    """LSE tensors are fp32 natural log with the given shape."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}; got {tuple(t.shape)}.")
    if t.dtype != torch.float32:
        raise ValueError(
            f"{op}: {name} must be float32 (natural-log LSE); got {t.dtype}. "
            "Pass the fp32 LSE returned by the attention op (do not down-cast it)."
        )
