"""The process-start helpers: Triton's cache key hashed in the background on CUDA only."""

import threading

import pytest

from hf_cascade.ops import _backend


@pytest.mark.parametrize("env", [{"TRITON_INTERPRET": "1"}, {"HF_CASCADE_WARM_TRITON_KEY": "0"}])
def test_no_triton_key_thread_under_the_interpreter_or_when_turned_off(monkeypatch, env):
    """Under TRITON_INTERPRET=1 (CI) or with HF_CASCADE_WARM_TRITON_KEY=0, no thread starts (the GPU test
    ``test_gpu_import_warms_the_triton_key`` checks that one does on CUDA)."""
    monkeypatch.setattr(_backend, "_TRITON_KEY_THREAD", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _backend.warm_triton_key() is None
    assert not any(t.name == "hf_cascade-triton-key" for t in threading.enumerate())
