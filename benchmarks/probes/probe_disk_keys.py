"""Probe: do two processes key one hf_cascade kernel alike on disk when one of them built with Inductor first?

The stall bench found the calls rebuilding Triton variants equal in every argument to those the background build's
children had built, under another hash on disk (H100, 4e047c3, ``results/stall.jsonl``). Suspected cause: Triton
keys a kernel by the ``ptxas`` version its process read at its first build, and Inductor points Triton at torch's
bundled ``ptxas`` when it first builds; ``hf_cascade.ops._backend.use_compilers_ptxas`` makes every process pick
Inductor's choice before its first kernel. Here, in fresh processes sharing one Triton cache folder:

* ``hf_first``: an hf_cascade kernel (the state merge), then a compiled function (Inductor builds);
* ``inductor_first``: the compiled function first, then the same hf_cascade kernel;
* the same two with ``use_compilers_ptxas`` turned off (``*_unaligned``): what happened before it.

Each reports the merge kernel's disk hash (``variant_log``) and what differs between the cases. About a minute on
one GPU::

    python benchmarks/probes/probe_disk_keys.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import preamble  # noqa: F401  (the repository root and benchmarks/ on sys.path)

CASES = ("hf_first", "inductor_first", "hf_first_unaligned", "inductor_first_unaligned")


def _child(case: str, log: str) -> None:
    import torch

    import variant_log

    variant_log.install(log)
    if case.endswith("_unaligned"):
        from hf_cascade.ops import _backend

        _backend.use_compilers_ptxas = lambda: None
    from hf_cascade.ops.merge import merge_attention_states

    def hf_kernel():
        a, b = torch.randn(64, 128, device="cuda"), torch.randn(64, 128, device="cuda")
        la, lb = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
        merge_attention_states(a, la, b, lb, backend="triton")

    def inductor():
        f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)
        f(torch.randn(1000, device="cuda"))

    steps = (hf_kernel, inductor) if case.startswith("hf_first") else (inductor, hf_kernel)
    for step in steps:
        step()
    torch.cuda.synchronize()
    print(json.dumps({"case": case, "TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH")}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    args = p.parse_args()
    if args.child:
        _child(args.child, args.log)
        return 0
    import torch

    import variant_log

    if not torch.cuda.is_available():
        print("probe_disk_keys: needs a CUDA GPU (the kernels are built for it).")
        return 0
    folder = tempfile.mkdtemp(prefix="probe_disk_keys_")
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(folder, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"))
    env.pop("TRITON_PTXAS_PATH", None)
    hashes, notes = {}, {}
    for case in CASES:
        log = os.path.join(folder, f"{case}.jsonl")
        run = subprocess.run([sys.executable, __file__, "--child", case, "--log", log], env=env,
                             capture_output=True, text=True, timeout=300)
        notes[case] = (run.stdout.strip().splitlines() or [run.stderr[-400:]])[-1]
        merges = [e for e in variant_log.read(log) if e["name"] == "_merge_attention_states_kernel"]
        hashes[case] = merges[-1] if merges else None
    diff = {}
    for left, right in (("hf_first", "inductor_first"), ("hf_first_unaligned", "inductor_first_unaligned")):
        a, b = hashes[left], hashes[right]
        diff[f"{left} vs {right}"] = None if a is None or b is None else variant_log.difference(b, a)
    result = {"probe": "disk_keys", "disk_hash": {c: h and h.get("disk_hash") for c, h in hashes.items()},
              "ptxas": {c: h and h.get("ptxas") for c, h in hashes.items()}, "differences": diff, "children": notes}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
