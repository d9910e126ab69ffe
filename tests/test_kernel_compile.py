"""The Triton kernels compile for an H100 (sm_90) on this CPU-only machine.

The other CPU tests run the kernels under Triton's interpreter, which never compiles them: a kernel that only the
compiler rejects (two branches of a runtime ``if`` naming tensors of different shapes alike, a non-constexpr in a
static loop, ...) would pass them and fail on the GPU. ``benchmarks/check_kernel_compile.py`` compiles every kernel at
the launch choices the H100 uses, in a process without ``TRITON_INTERPRET``.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "check_kernel_compile.py"


def _ptxas_path():
    """The script's own lookup (importing it only puts the repository on sys.path; its ``main`` clears
    TRITON_INTERPRET)."""
    spec = importlib.util.spec_from_file_location("check_kernel_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ptxas_path()


@pytest.mark.skipif(_ptxas_path() is None, reason="this Triton has no ptxas for sm_90")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    done = re.search(r"compiled (\d+) of (\d+)", out.stdout)
    assert done and done.group(1) == done.group(2) and int(done.group(2)) >= 9, out.stdout
