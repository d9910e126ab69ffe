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
    monkeypatch.setattr(_backend, "_TRITON_KEY_THREAD", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _backend.warm_triton_key() is None
    assert not any(t.name == "hf_cascade-triton-key" for t in threading.enumerate())


def test_prepare_triton_does_nothing_without_cuda(monkeypatch):
    """Off CUDA (or under the interpreter) the first use's preparation starts nothing and sets nothing."""
    monkeypatch.setattr(_backend, "_TRITON_KEY_THREAD", None)
    monkeypatch.setattr(_backend, "_CACHE_SHARED", False)
    monkeypatch.setattr(_backend.torch.cuda, "is_available", lambda: False)
    env = dict(os.environ)
    assert _backend.prepare_triton() is None
    assert dict(os.environ) == env
    assert not any(t.name == "hf_cascade-triton-key" for t in threading.enumerate())


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
    monkeypatch.setattr(_backend, "_CACHE_SHARED", False)
    env = dict(os.environ)
    try:
        _backend.share_compiler_kernel_cache()
        assert knobs.cache.dir == triton_cache_dir(0)
        assert dict(os.environ) == env and knobs.propagate_env
    finally:
        del knobs.cache.dir  # back to the environment / Triton's default
    monkeypatch.setattr(_backend, "_CACHE_SHARED", False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    _backend.share_compiler_kernel_cache()
    assert knobs.cache.dir == "/somewhere/else"
