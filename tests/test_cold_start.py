"""The first use's Triton preparation (``ops._backend.prepare_triton``): Triton's cache key hashed in the background
on CUDA only, the kernel cache shared with ``torch.compile`` without touching ``os.environ``."""

import os
import threading

import pytest

from hf_cascade.ops import _backend


@pytest.mark.parametrize("env", [{"TRITON_INTERPRET": "1"}, {"HF_CASCADE_WARM_TRITON_KEY": "0"}])
def test_no_triton_key_thread_under_the_interpreter_or_when_turned_off(monkeypatch, env):
    """Under TRITON_INTERPRET=1 (CI) or with HF_CASCADE_WARM_TRITON_KEY=0, no thread starts (the GPU test
    ``test_gpu_first_use_warms_the_triton_key`` checks that one does on CUDA)."""
    _backend.warm_triton_key.cache_clear()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert _backend.warm_triton_key() is None
        assert not any(t.name == "hf_cascade-triton-key" for t in threading.enumerate())
    finally:
        _backend.warm_triton_key.cache_clear()


def test_prepare_triton_does_nothing_without_cuda(monkeypatch):
    """Off CUDA (or under the interpreter) the first use's preparation starts nothing and sets nothing."""
    _backend.warm_triton_key.cache_clear()
    _backend.share_compiler_kernel_cache.cache_clear()
    monkeypatch.setattr(_backend.torch.cuda, "is_available", lambda: False)
    env = dict(os.environ)
    try:
        assert _backend.prepare_triton() is None
        assert dict(os.environ) == env
        assert not any(t.name == "hf_cascade-triton-key" for t in threading.enumerate())
    finally:
        _backend.warm_triton_key.cache_clear()
        _backend.share_compiler_kernel_cache.cache_clear()


def test_kernel_cache_shared_with_the_compiler_through_triton_knobs(monkeypatch):
    """On CUDA with ``TRITON_CACHE_DIR`` unset, hf_cascade's kernels are built in Inductor's Triton directory, told to
    Triton through ``triton.knobs.cache.dir`` (Triton 3.4+): ``os.environ`` is left as it was. Where the variable is
    set, it wins and nothing is touched."""
    knobs = pytest.importorskip("triton.knobs")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(_backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_backend.torch.cuda, "current_device", lambda: 0)
    _backend.share_compiler_kernel_cache.cache_clear()
    env = dict(os.environ)
    try:
        _backend.share_compiler_kernel_cache()
        assert knobs.cache.dir == triton_cache_dir(0)
        assert dict(os.environ) == env and knobs.propagate_env
    finally:
        del knobs.cache.dir  # back to the environment / Triton's default
    _backend.share_compiler_kernel_cache.cache_clear()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    _backend.share_compiler_kernel_cache()
    assert knobs.cache.dir == "/somewhere/else"
    _backend.share_compiler_kernel_cache.cache_clear()


def test_first_kernel_waits_for_the_key_thread_instead_of_hashing_beside_it(monkeypatch):
    """``await_triton_key`` (a kernel module's import, i.e. the first launch) waits for a key thread still running, so
    the launch reads the thread's result instead of hashing Triton's library a second time beside it; it returns at
    once where no thread runs, and from the thread itself."""
    done = threading.Event()
    release = threading.Event()

    def hashing():
        release.wait(5)
        done.set()

    thread = threading.Thread(target=hashing, daemon=True)
    monkeypatch.setattr(_backend, "_key_thread", lambda: thread)
    thread.start()
    threading.Timer(0.2, release.set).start()
    _backend.await_triton_key()
    assert done.is_set() and not thread.is_alive()
    monkeypatch.setattr(_backend, "_key_thread", lambda: None)
    _backend.await_triton_key()  # no thread: nothing to wait for
    own = threading.Thread(target=_backend.await_triton_key)
    monkeypatch.setattr(_backend, "_key_thread", lambda: own)
    own.start()  # the thread itself must not wait for itself
    own.join(5)
    assert not own.is_alive()


def test_every_process_builds_with_the_compilers_ptxas(monkeypatch, tmp_path):
    """``use_compilers_ptxas``: where torch bundles a ``ptxas`` (which Inductor points Triton at when it first builds),
    hf_cascade's kernels are built with it from the first one on, so a process that builds before Inductor and one
    that builds after key their kernels alike; ``os.environ`` is left as it was; a set ``TRITON_PTXAS_PATH`` or no
    bundled ``ptxas`` changes nothing."""
    knobs = pytest.importorskip("triton.knobs")
    fake_torch = tmp_path / "torch"
    (fake_torch / "_inductor" / "bin").mkdir(parents=True)
    monkeypatch.setattr(_backend.torch, "__file__", str(fake_torch / "__init__.py"))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    before = knobs.nvidia.__dict__.get("ptxas")
    env = dict(os.environ)
    try:
        _backend.use_compilers_ptxas()  # no bundled ptxas: nothing
        assert "ptxas" not in knobs.nvidia.__dict__ or knobs.nvidia.__dict__["ptxas"] == before
        ptxas = fake_torch / "_inductor" / "bin" / "ptxas"
        ptxas.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
        ptxas.chmod(0o755)
        _backend.use_compilers_ptxas()
        assert knobs.nvidia.__dict__["ptxas"] == str(ptxas) and dict(os.environ) == env and knobs.propagate_env
        del knobs.nvidia.ptxas
        ptxas.unlink()  # another torch layout: torch/bin/ptxas
        (fake_torch / "bin").mkdir()
        other = fake_torch / "bin" / "ptxas"
        other.write_text("#!/bin/sh\n")
        other.chmod(0o755)
        _backend.use_compilers_ptxas()
        assert knobs.nvidia.__dict__["ptxas"] == str(other)
        del knobs.nvidia.ptxas
        monkeypatch.setenv("TRITON_PTXAS_PATH", "/the/users/ptxas")  # the user's (or Inductor's) choice stands
        _backend.use_compilers_ptxas()
        assert "ptxas" not in knobs.nvidia.__dict__
    finally:
        knobs.nvidia.__dict__.pop("ptxas", None)
        if before is not None:
            knobs.nvidia.__dict__["ptxas"] = before
