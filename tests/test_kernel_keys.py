"""Every process keys hf_cascade's Triton kernels alike, whichever kernel it hashes first (``_jit.settle_cache_keys``).

Triton 3.6 folds a callee's global constants into its caller's key only where the callee was hashed first, so the
background build's children and the calling process keyed the same kernels apart and the calls built them again.
Keys need no GPU: fresh processes (``TRITON_INTERPRET=0``) hash the kernels in two orders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
settle = sys.argv[1] == "settle"
if not settle:  # the kernels as Triton alone would key them
    import hf_cascade.ops._jit as jit
    jit.settle_cache_keys = lambda namespace: None
from hf_cascade.ops import _cascade_kernel, _prefix_kernel, _suffix_kernel
from triton.runtime.jit import JITFunction
fns = {n: f for m in (_prefix_kernel, _suffix_kernel, _cascade_kernel) for n, f in vars(m).items()
       if isinstance(f, JITFunction)}
order = sorted(fns) if sys.argv[2] == "callers_first" else sorted(fns, reverse=True)
for name in order:
    fns[name].cache_key
print(json.dumps({n: fns[n].cache_key for n in fns}))
"""


def _keys(settle: bool, order: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", CHILD, "settle" if settle else "raw", order], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_kernel_keys_do_not_depend_on_which_kernel_is_hashed_first():
    settled = [_keys(True, order) for order in ("callers_first", "callees_first")]
    assert settled[0] == settled[1]
    # Settled keys are the keys of a process that hashed every callee before its callers.
    assert settled[0] == _keys(False, "callees_first")
    assert {"_cascade_fwd_kernel", "_prefix_fwd_kernel", "_suffix_fwd_kernel"} <= set(settled[0])
