"""Where a warm shared-workload generate() call waits: host time vs the GPU's progress at each stage (GPU).

A profiler slows the host it measures (each op recorded), and the question here is the host: how long after the
call starts does the GPU get its first kernel, and where does it run dry. So no profiler: the probe wraps the
stages of ``hf_cascade.generate`` (planning, the shared segments' prefill, the first forward, the decode loop's
first steps) and records at each stage's entry and exit the host clock and a CUDA event. After the call, each
mark has ``host_ms`` (since the call started) and ``gpu_ms`` (when the GPU reached that point of the stream; the
start event is recorded while the GPU is idle). Where ``gpu_ms - host_ms`` is ~0 the GPU had caught up with the
host and waited for it; ``first_kernel_ms`` is the first mark's ``gpu_ms`` after which the GPU was busy.

    python benchmarks/probes/probe_call_timeline.py --layers 32 --batch 32 --prefix 4096 --suffix 64 --new-tokens 64

Writes ``probe_call_timeline.jsonl``: per call kind (``one_token``, ``full``), the median call's marks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args  # noqa: E402

import hf_cascade.decode.captured_step as captured_step  # noqa: E402
import hf_cascade.decode.sampling as decoding  # noqa: E402
import hf_cascade.generation as generation  # noqa: E402
import hf_cascade.inputs as inputs  # noqa: E402


class Timeline:
    def __init__(self):
        self.marks: list[tuple[str, float, torch.cuda.Event]] = []
        self.counts: dict[str, int] = {}
        self.t0 = 0.0
        self.start = None

    def begin(self):
        self.marks, self.counts = [], {}
        torch.cuda.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.t0 = time.perf_counter()
        self.start.record()

    def mark(self, name: str, limit: int = 3):
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        if n >= limit:
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((name if n == 0 else f"{name}#{n}", (time.perf_counter() - self.t0) * 1e3, ev))

    def end(self) -> dict:
        self.mark("return")
        host_end = (time.perf_counter() - self.t0) * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - self.t0) * 1e3
        rows = [{"mark": name, "host_ms": round(h, 3), "gpu_ms": round(self.start.elapsed_time(ev), 3)}
                for name, h, ev in self.marks]
        for r in rows:
            r["gpu_behind_ms"] = round(r["gpu_ms"] - r["host_ms"], 3)
        return {"wall_ms": round(wall, 3), "host_return_ms": round(host_end, 3), "marks": rows}


TL = Timeline()


def wrap(owner, name: str, label: str | None = None, limit: int = 3):
    original = getattr(owner, name)
    label = label or name

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        TL.mark(f"{label}>", limit)
        try:
            return original(*args, **kwargs)
        finally:
            TL.mark(f"{label}<", limit)

    setattr(owner, name, wrapper)
    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_workload_args(parser)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--output", default=None)
    parser.add_argument("--cold", action="store_true",
                        help="the process's first calls instead: call 1 and 2 of the full kind, no warm-up first "
                             "(the default options: the built-in tier)")
    parser.add_argument("--profile-first", action="store_true", help="with --cold: call 1 under cProfile too")
    args = parser.parse_args()

    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    wrap(inputs, "_left_aligned")
    wrap(inputs, "find_shared_prefixes")
    wrap(inputs, "prefill_levels")
    wrap(inputs, "plan_cascade_batch")
    wrap(generation, "sample")
    wrap(decoding, "_first_forward")
    wrap(decoding, "greedy_tokens", limit=2)
    wrap(captured_step.CapturedDecodeStep, "__call__", "decode_step", limit=5 if args.cold else 2)
    custom = wrap(generation, "generate", "hf_cascade.generate")
    for name in ("_prefill", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation"):
        wrap(model, name, limit=2)

    def call(new_tokens):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              custom_generate=custom)

    writer = ResultWriter("probe_call_timeline.jsonl", args.output)
    if args.cold:
        os.environ["HF_CASCADE_BACKGROUND"] = "off"  # the calls alone, no child process beside calls 2 and 3
        import cProfile
        import io
        import pstats

        for index in (1, 2, 3):
            profiler = cProfile.Profile() if args.profile_first and index == 1 else None
            TL.begin()
            if profiler is not None:
                profiler.enable()
            call(args.new_tokens)
            if profiler is not None:
                profiler.disable()
            run = TL.end()
            if profiler is not None:  # Python's view of the first call: which calls (and imports) took the time
                for order in ("tottime", "cumulative"):
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(35)
                    run[f"top_{order}"] = [line.strip()[:240] for line in out.getvalue().splitlines()
                                           if line.strip()[:1].isdigit()]
                    print(f"-- first call, top {order}:\n   " + "\n   ".join(run[f"top_{order}"]))
            record = {"bench": "probe_call_timeline", "kind": f"cold_call_{index}", "layers": args.layers,
                      "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix,
                      "new_tokens": args.new_tokens, **run}
            writer.write(record)
            print(f"== call {index} of the process: wall {run['wall_ms']:.1f} ms")
            for m in run["marks"]:
                print(f"   {m['mark']:<48} host {m['host_ms']:8.2f}  gpu {m['gpu_ms']:8.2f}  "
                      f"behind {m['gpu_behind_ms']:7.2f}")
        return
    for kind, new_tokens in (("one_token", 1), ("full", args.new_tokens)):
        for _ in range(2):  # compile / record / warm
            call(new_tokens)
        runs = []
        for _ in range(args.calls):
            TL.begin()
            call(new_tokens)
            runs.append(TL.end())
        runs.sort(key=lambda r: r["wall_ms"])
        median = runs[len(runs) // 2]
        busy_from = next((m for m in median["marks"] if m["gpu_behind_ms"] > 0.5), None)
        record = {"bench": "probe_call_timeline", "kind": kind, "layers": args.layers, "batch": args.batch,
                  "prefix": args.prefix, "suffix": args.suffix, "new_tokens": new_tokens,
                  "wall_ms_runs": [r["wall_ms"] for r in runs], "first_busy_mark": busy_from, **median}
        writer.write(record)
        print(f"== {kind}: wall {median['wall_ms']:.1f} ms (runs {[r['wall_ms'] for r in runs]})")
        for m in median["marks"]:
            print(f"   {m['mark']:<48} host {m['host_ms']:8.2f}  gpu {m['gpu_ms']:8.2f}  "
                  f"behind {m['gpu_behind_ms']:7.2f}")
    record = {"bench": "probe_call_timeline", "kind": "kernels_by_launch", "layers": args.layers,
              "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix, "new_tokens": args.new_tokens,
              **kernels_by_launch(lambda: call(args.new_tokens))}
    writer.write(record)
    print(json.dumps(record, indent=1)[:6000])


def kernels_by_launch(fn) -> dict:
    """GPU time of one profiled call split by what launched it: recorded CUDA graphs (cudaGraphLaunch) or single
    launches (kernels, memcpys, memsets), with the single launches' kernels by name (ms, count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    launcher = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launcher[e["args"]["correlation"]] = e["name"]
    by_api, singles = {}, {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        api = launcher.get(e.get("args", {}).get("correlation"), "?")
        ms = e.get("dur", 0) / 1e3
        by_api[api] = by_api.get(api, 0.0) + ms
        if api != "cudaGraphLaunch":
            name = e["name"][:90]
            t, n = singles.get(name, (0.0, 0))
            singles[name] = (t + ms, n + 1)
    return {"gpu_ms_by_launch_api": {k: round(v, 3) for k, v in sorted(by_api.items(), key=lambda kv: -kv[1])},
            "single_launches": [[k, round(t, 3), n] for k, (t, n) in sorted(singles.items(), key=lambda kv: -kv[1][0])]}


if __name__ == "__main__":
    main()
