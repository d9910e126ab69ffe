"""Probe: what a fresh process pays for its first compiled (or Triton-tier) generate() call when the caches are warm.

A first child fills fresh Triton / Inductor cache folders (one ``compile="now"`` call of the shared workload: 32 rows
x 4,096 shared tokens, Llama-3-8B shape); a second child, with the same folders, times its first ``compile="now"``
call under cProfile: the call's seconds, torch.compile's phases (``common.compile_seconds``), the modules imported
during the call, and the functions with the most cumulative time. ``--tier triton``: the same for the Triton tier
(``compile="never"``, the tier forced ready): the fill child builds the kernels; the measuring child runs one
built-in call first (the process's own first-use costs), then its first Triton call under cProfile.
``--bytecode``: the packages' bytecode compiled ahead (``common.compile_bytecode_ahead``), as pip leaves a machine.
``--parts``: more measuring children, each in a fresh process on the same warm folders, that split a first call's
seconds: the process's generic GPU first use (a bf16 matmul and a tiny SDPA call), Triton's per-process key (it hashes
``libtriton.so``), then three calls of one path (the first under cProfile): the Triton tier, the built-in tier, or
sdpa (no hf_cascade).

    python benchmarks/probes/probe_warm_compile.py --layers 32 [--tier triton] [--bytecode]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time

import preamble  # noqa: F401  (the repository root and benchmarks/ on sys.path)

from common import (  # noqa: E402
    ResultWriter,
    child_result,
    compile_bytecode_ahead,
    fresh_cache_env,
    print_child_result,
)


def _child(args) -> dict:
    import torch

    from bench_generate import build_model, make_batch
    from common import compile_seconds, wall_time

    import hf_cascade

    model = build_model(args.layers)
    ids, mask = make_batch(32, 4096, 64, model.config.vocab_size)

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              pad_token_id=0, custom_generate=hf_cascade.generate,
                              cascade_options={"compile": "now" if args.tier == "compiled" else "never"})

    record = {"role": args.child, "tier": args.tier}
    if args.child.startswith("parts-"):
        return _parts(args, model, call, ids, mask, record)
    if args.tier == "triton":
        from hf_cascade.tiers import tier_state
        from hf_cascade.tiers import tier_report

        if args.child == "measure":
            record["builtin_call_s"] = round(wall_time(call)[0], 3)
        tier_state(model).ready["triton"] = True  # (the ski rental would wait for its regret)
    if args.child == "fill":
        record["seconds"] = round(wall_time(call)[0], 3)
        return record
    t = time.perf_counter()
    import torch._dynamo.utils  # noqa: F401  (compile_seconds reads it: its import timed apart, part of the cost)

    record["dynamo_import_s"] = round(time.perf_counter() - t, 3)
    modules = len(sys.modules)
    before = compile_seconds()
    profiler = cProfile.Profile()
    profiler.enable()
    seconds, _ = wall_time(call)
    profiler.disable()
    after = compile_seconds()
    record.update(seconds=round(seconds, 3), second_call_s=round(wall_time(call)[0], 3),
                  modules_imported=len(sys.modules) - modules,
                  compile_phases={k: round(after[k] - before[k], 3) for k in after})
    if args.tier == "triton":
        record["tiers"] = [tier for tier, _ in tier_report(model)["calls"]]
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(45)
        record[f"top_{order}"] = [line.strip()[:200] for line in out.getvalue().splitlines()
                                  if line.strip()[:1].isdigit()]
    torch.cuda.synchronize()
    return record


def _parts(args, model, call, ids, mask, record) -> dict:
    """One measuring child of ``--parts``: the generic first use, Triton's key, then two calls of one path."""
    import torch
    import torch.nn.functional as F

    from common import wall_time

    path = args.child.removeprefix("parts-")

    def generic():
        a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()

    record["generic_first_use_s"] = round(wall_time(generic)[0], 3)
    t = time.perf_counter()
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    triton_key()
    record["triton_key_s"] = round(time.perf_counter() - t, 3)
    if path == "triton":
        from hf_cascade.tiers import tier_state

        tier_state(model).ready["triton"] = True
    elif path == "sdpa":
        model.set_attn_implementation("sdpa")

        def call():  # noqa: F811  (the same batch through transformers' own path)
            return model.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  pad_token_id=0)
    record["path"] = path
    profiler = cProfile.Profile()
    profiler.enable()
    first = wall_time(call)[0]
    profiler.disable()
    record["calls_s"] = [round(first, 3)] + [round(wall_time(call)[0], 3) for _ in range(2)]
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    record["first_call_top_tottime"] = [line.strip()[:200] for line in out.getvalue().splitlines()
                                        if line.strip()[:1].isdigit()]
    if path != "sdpa":
        from hf_cascade.tiers import tier_report

        record["tiers"] = [tier for tier, _ in tier_report(model)["calls"]]
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tier", choices=["compiled", "triton"], default="compiled")
    parser.add_argument("--bytecode", action="store_true")
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--output", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print_child_result(_child(args))
        return
    root = tempfile.mkdtemp(prefix="hf_cascade_warm_compile_")
    bytecode = compile_bytecode_ahead(root + "/pycache") if args.bytecode else {"mode": "as-is"}
    env = {**fresh_cache_env(root), "HF_CASCADE_RECORDS": "off"}
    writer = ResultWriter("probe_warm_compile.jsonl", args.output)
    roles = ["fill", "measure"] + (["parts-triton", "parts-builtin", "parts-sdpa"] if args.parts else [])
    for role in roles:
        t = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", role, "--layers", str(args.layers),
                               "--tier", args.tier], env=env,
                              capture_output=True, text=True)
        record = {"bench": "probe_warm_compile", "layers": args.layers, "bytecode": bytecode,
                  "child_wall_s": round(time.perf_counter() - t, 2),
                  **(child_result(done.stdout) or {"role": role, "error": done.stderr[-1500:]})}
        writer.write(record)
        print(json.dumps({k: v for k, v in record.items() if not k.startswith("top_")}))
        for order in ("cumulative", "tottime"):
            for line in record.get(f"top_{order}", []):
                print("  ", order[:3], line)


if __name__ == "__main__":
    main()
