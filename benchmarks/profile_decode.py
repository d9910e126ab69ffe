"""Where does a decode step's time go? torch.profiler over a few generate() steps, cascade vs sdpa.

Prints, per peer: wall ms per decode step, GPU-busy ms per step (sum of kernel times), kernel launches per step,
and the top kernels. A step whose wall time is far above its GPU time is launch/host-bound.

    python benchmarks/profile_decode.py --batch 32 --prefix 4096
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, wall_time  # noqa: E402

import hf_cascade  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("profile_decode.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    gen = dict(do_sample=False, pad_token_id=0)
    for peer in ("cascade", "sdpa"):
        model.set_attn_implementation(peer)
        if peer == "cascade":
            inputs = hf_cascade.shared_prefix_inputs(model, ids, mask)
        else:
            inputs = dict(input_ids=ids, attention_mask=mask)
        model.generate(**inputs, max_new_tokens=2, **gen)  # warm-up
        t1, _ = wall_time(lambda: model.generate(**inputs, max_new_tokens=1, **gen))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tn, _ = wall_time(lambda: model.generate(**inputs, max_new_tokens=1 + args.steps, min_new_tokens=1 + args.steps, **gen))
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        launches = sum(e.count for e in events)
        per_step = (tn - t1) / args.steps * 1e3  # profiled run includes prefill; subtract the unprofiled one
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        record = dict(
            bench="profile_decode", peer=peer, batch=args.batch, prefix=args.prefix, layers=args.layers,
            wall_ms_per_step_profiled=per_step, gpu_ms_total=gpu_ms, kernel_launches=launches, steps=args.steps,
            top_kernels=[(e.key[:80], round(e.self_device_time_total / 1e3, 3), e.count) for e in top],
        )
        writer.write(record)
        print(f"\n== {peer}: wall {per_step:.1f} ms/step (profiled), GPU busy {gpu_ms:.1f} ms over prefill+{args.steps} steps, {launches} kernels")
        for name, ms, count in record["top_kernels"]:
            print(f"   {ms:9.3f} ms  x{count:<6} {name}")


if __name__ == "__main__":
    main()
