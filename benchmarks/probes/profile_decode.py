"""Where does a decode step's time go? torch.profiler over a few generate() steps, cascade vs sdpa.

Prints, per peer: wall ms per decode step, GPU-busy ms per step (sum of kernel times), kernel launches per step,
and the top kernels. A step whose wall time is far above its GPU time is launch/host-bound.

    python benchmarks/probes/profile_decode.py --batch 32 --prefix 4096
    python benchmarks/probes/profile_decode.py --peers cascade_generate --host-profile   # + where the host time goes

Peers: ``cascade_generate`` (the default path: ``generate(..., custom_generate=hf_cascade.generate)``; on CUDA its
decode steps replay recorded CUDA graphs since 2178092, compiled before), ``cascade_generate_graphs`` /
``cascade_generate_compile`` (``decode_step`` named; records carry ``decode_step``), ``cascade_compiled`` /
``cascade`` (``shared_prefix_inputs`` with / without fixed buffers), ``sdpa``.
``--host-profile`` runs cProfile over an unprofiled decode and prints the functions with the most own time and the
most time below them: the time a step spends waiting for the GPU shows up where generate() synchronises.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args, timed_with_compile_breakdown, wall_time  # noqa: E402

import hf_cascade  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_workload_args(parser)
    parser.add_argument("--steps", type=int, default=8)
    peers = ["cascade_generate", "cascade_generate_synced", "cascade_generate_eager", "cascade_generate_graphs",
             "cascade_generate_compile", "cascade_compiled", "cascade", "sdpa"]
    parser.add_argument("--peers", nargs="+", default=["cascade_generate", "cascade_compiled", "cascade", "sdpa"],
                        choices=peers, help="cascade_generate_synced: the default path with the stop flag read "
                        "at every step (cascade_options=dict(defer_stop_check=False)), as transformers' _sample does; "
                        "cascade_generate_eager: the default path's opt-out of compilation (disable_compile=True); "
                        "cascade_generate_graphs: the eager step recorded into CUDA graphs (decode_step='graphs')")
    parser.add_argument("--host-profile", action="store_true", help="cProfile an unprofiled decode per peer")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("profile_decode.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    gen = dict(do_sample=False, pad_token_id=0)
    def profiled(fn):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds, _ = wall_time(fn)
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        return seconds, events, sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events)

    for peer in args.peers:
        steps = 1 + args.steps
        model.set_attn_implementation("sdpa" if peer == "sdpa" else "cascade")
        call = dict(gen)
        if peer.startswith("cascade_generate"):
            inputs = dict(input_ids=ids, attention_mask=mask)
            call["custom_generate"] = hf_cascade.generate
            call["cascade_options"] = dict(defer_stop_check=peer != "cascade_generate_synced")
            if peer == "cascade_generate_eager":
                call["disable_compile"] = True
            if peer in ("cascade_generate_graphs", "cascade_generate_compile"):
                call["cascade_options"]["decode_step"] = peer.rsplit("_", 1)[1]
        elif peer.startswith("cascade"):
            max_new = steps if peer == "cascade_compiled" else None
            inputs = hf_cascade.shared_prefix_inputs(model, ids, mask, max_new_tokens=max_new)
        else:
            inputs = dict(input_ids=ids, attention_mask=mask)
        run_steps = lambda n: model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **call)  # noqa: E731
        # Warm-up (compiled: compile, then CUDA-graph capture); the first call's torch.compile phases recorded.
        first_call_s, first_call_compile_s, _ = timed_with_compile_breakdown(lambda: run_steps(steps))
        run_steps(steps)
        # Unprofiled: wall ms per decode step (a long call minus a one-token call, medians of 3).
        long_steps = 4 * steps
        t_ones = [wall_time(lambda: run_steps(1))[0] for _ in range(3)]
        t_longs = [wall_time(lambda: run_steps(long_steps))[0] for _ in range(3)]
        wall_step = (sorted(t_longs)[1] - sorted(t_ones)[1]) / (long_steps - 1) * 1e3
        host_top = None
        if args.host_profile:
            profiler = cProfile.Profile()
            profiler.enable()
            wall_time(lambda: run_steps(long_steps))
            profiler.disable()
            stats = pstats.Stats(profiler)
            rows = [
                (f"{os.path.basename(func[0])}:{func[1]}({func[2]})", calls, tottime, cumtime)
                for func, (_, calls, tottime, cumtime, _) in stats.stats.items()
            ]
            host_top = {
                "by_own_ms_per_step": [
                    (name, calls, round(own / long_steps * 1e3, 3))
                    for name, calls, own, _ in sorted(rows, key=lambda r: -r[2])[:25]
                ],
                "by_cumulative_ms_per_step": [
                    (name, calls, round(cum / long_steps * 1e3, 3))
                    for name, calls, _, cum in sorted(rows, key=lambda r: -r[3])[:40]
                ],
            }
        t1, events1, gpu1, launches1 = profiled(lambda: run_steps(1))
        tn, events, gpun, launchesn = profiled(lambda: run_steps(steps))
        per_step = (tn - t1) / args.steps * 1e3  # both runs profiled; the difference is the decode steps
        gpu_step = (gpun - gpu1) / args.steps
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        # Per decode step, by kernel: the long call's kernels minus the one-token call's (prefill, planning).
        before = {e.key: (e.self_device_time_total, e.count) for e in events1}
        kernel_rows = []
        for e in events:
            us, count = before.get(e.key, (0.0, 0))
            if e.count - count > 0:
                kernel_rows.append((e.key[:90], round((e.self_device_time_total - us) / args.steps, 2),
                                 round((e.count - count) / args.steps, 2)))
        kernel_rows.sort(key=lambda row: -row[1])
        record = dict(
            bench="profile_decode", peer=peer, batch=args.batch, prefix=args.prefix, layers=args.layers,
            wall_ms_per_step=wall_step, first_call_s=first_call_s, first_call_compile_s=first_call_compile_s, one_token_calls_s=t_ones, long_calls_s=t_longs, long_steps=long_steps,
            wall_ms_per_step_profiled=per_step, gpu_ms_per_step=gpu_step,
            kernel_launches_per_step=(launchesn - launches1) / args.steps, steps=args.steps,
            top_kernels=[(e.key[:80], round(e.self_device_time_total / 1e3, 3), e.count) for e in top],
            host_profile=host_top,
            kernels_per_step_us_count=kernel_rows,
        )
        if peer.startswith("cascade_generate"):
            record["decode_step"] = call["cascade_options"].get("decode_step", "default")
        writer.write(record)
        print(f"\n== {peer}: wall {wall_step:.2f} ms/step ({per_step:.1f} profiled), GPU busy {gpu_step:.1f} ms/step, "
              f"{record['kernel_launches_per_step']:.0f} kernels/step")
        for name, ms, count in record["top_kernels"]:
            print(f"   {ms:9.3f} ms  x{count:<6} {name}")
        print("   per decode step (us, launches):")
        for name, us, count in kernel_rows[:30]:
            print(f"     {us:9.1f} us  x{count:<6} {name}")
        if host_top:
            for title, key in (("own", "by_own_ms_per_step"), ("cumulative", "by_cumulative_ms_per_step")):
                print(f"   host, by {title} time (ms per step, cProfile):")
                for name, calls, ms in host_top[key]:
                    print(f"     {ms:8.3f}  x{calls:<7} {name}")

if __name__ == "__main__":
    main()
