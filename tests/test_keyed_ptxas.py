"""The background build's children key their kernels by the ``ptxas`` their parent keys by (``_backend.keyed_ptxas``).

Triton keys a kernel on disk by the version of the ``ptxas`` its process read at its first build; a child that reads
another would build under keys the caller never looks up. Here Triton's own version lookup runs against two small
executables that answer ``--version`` as ptxas does (12.8 and 13.0), on the CPU.
"""

from __future__ import annotations

import os
import stat

import pytest

from hf_cascade.ops import _backend

compiler = pytest.importorskip("triton.backends.nvidia.compiler")
knobs = pytest.importorskip("triton.knobs")

ARCH = 80  # Triton reads ``knobs.nvidia.ptxas`` for this arch in every version that has knobs


def _version(arch):  # Triton's own lookup (3.5 and earlier take no arch)
    return _backend._per_arch(compiler.get_ptxas_version, arch)


def _tool(arch):
    return _backend._per_arch(compiler.get_ptxas, arch)


def _fake_ptxas(folder, release: str) -> str:
    path = os.path.join(folder, f"ptxas-{release}")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fresh_triton(monkeypatch):
    """Triton as a process that has built nothing yet; its knobs and version cache restored afterwards."""
    if not hasattr(compiler, "get_ptxas_version") or not hasattr(knobs, "nvidia"):
        pytest.skip("this Triton keeps no ptxas version per process")
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    compiler.get_ptxas_version.cache_clear()
    propagate = knobs.propagate_env
    knobs.propagate_env = False
    yield
    knobs.propagate_env = propagate
    knobs.nvidia.reset()
    compiler.get_ptxas_version.cache_clear()


def test_a_child_gets_the_ptxas_the_parent_keyed_by(tmp_path, monkeypatch, fresh_triton):
    old, new = _fake_ptxas(tmp_path, "12.8"), _fake_ptxas(tmp_path, "13.0")
    monkeypatch.setattr(_backend, "use_compilers_ptxas", lambda: None)  # torch's own ptxas is no part of this test
    monkeypatch.setenv("TRITON_PTXAS_PATH", old)
    assert not _backend._has_built()
    assert _backend.keyed_ptxas(ARCH) == old  # before the first build: what that build will read
    assert "12.8" in _version(ARCH)  # the first build reads the version: keys carry 12.8 from now on
    assert _backend._has_built()
    knobs.nvidia.ptxas = new  # later pointed elsewhere (as Inductor does): the keys still carry 12.8
    assert _tool(ARCH).path == new
    assert _backend.keyed_ptxas(ARCH) == old


def test_no_path_when_no_candidate_has_the_keyed_version(tmp_path, monkeypatch, fresh_triton):
    first, other = _fake_ptxas(tmp_path, "12.4"), _fake_ptxas(tmp_path, "13.1")
    monkeypatch.setattr(_backend, "use_compilers_ptxas", lambda: None)
    knobs.nvidia.ptxas = first
    _version(ARCH)
    knobs.nvidia.ptxas = other
    os.remove(first)  # the binary the keys name is gone: a child cannot build under them
    assert _backend.keyed_ptxas(ARCH) is None


def test_use_compilers_ptxas_leaves_a_process_that_has_built(tmp_path, fresh_triton):
    keyed = _fake_ptxas(tmp_path, "12.8")
    knobs.nvidia.ptxas = keyed
    _version(ARCH)
    _backend.use_compilers_ptxas()
    assert _tool(ARCH).path == keyed
