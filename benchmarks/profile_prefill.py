"""Where a warm shared-prefix generate() call spends the time before its first decode step (GPU).

One warm call of the shared workload (B rows share P tokens, S own each, N new; the default ``hf_cascade.generate``
path), profiled with torch.profiler. The prefill is everything before the first CUDA-graph replay of the decode
step. Written per run (``profile_prefill.jsonl``):

* ``prefill_wall_ms``: from the call's start to the first replay's launch (host);
* ``prefill_gpu_busy_ms`` / ``prefill_gpu_idle_ms``: the union of the kernels launched before it, and the rest of
  the window from the call's start to their end (the GPU waiting for the host);
* ``prefill_syncs``: host waits for the device before the first replay (cudaStreamSynchronize, cudaMemcpy,
  cudaEventSynchronize, ...) with their milliseconds; ``prefill_waits`` / ``prefill_gpu_gaps``: each long wait
  and each stretch the GPU ran dry, with the Python frames running then (``with_stack``: a second profile with
  Python frames, which slow the host);
* ``prefill_top_kernels``: [name, ms, count] by total time; ``host_top``: cProfile of another warm call, by own time;
* floors in the same process: ``sdpa_prefix_forward_ms`` (model.model on the P shared tokens, sdpa) and
  ``sdpa_suffix_forward_ms`` (the B x S own tokens, sdpa, no past): the GEMM work the prefill cannot avoid.

    python benchmarks/profile_prefill.py --layers 32 --batch 32 --prefix 4096 --suffix 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, cuda_time, wall_time  # noqa: E402

import hf_cascade  # noqa: E402

_SYNC_CALLS = ("Synchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaMalloc")


def _union_ms(spans) -> float:
    """Milliseconds covered by the union of (start_us, end_us) spans."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def _frames_at(py_events, t: float, keep=("hf_cascade", "transformers"), depth: int = 4) -> list[str]:
    """The innermost ``depth`` Python frames from files under ``keep`` that were running at time ``t`` (us)."""
    running = [e for e in py_events if e["ts"] <= t <= e["ts"] + e.get("dur", 0)]
    running.sort(key=lambda e: e["ts"])  # outermost first
    names = [e["name"] for e in running if any(k in e["name"] for k in keep)]
    return [n.split("site-packages/")[-1][-110:] for n in names[-depth:]]


def analyse_trace(path: str, top: int = 15) -> dict:
    """The prefill part of a chrome trace of one generate() call (see the module docstring)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "ts" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    py_events = [e for e in events if e.get("cat") == "python_function" and "ts" in e]
    call = [e for e in events if e.get("name") == "profiled_generate_call"]
    t_start = min(e["ts"] for e in call) if call else min(e["ts"] for e in launches)
    graph = [e["ts"] for e in launches if e["name"].startswith("cudaGraphLaunch")]
    t_replay = min(graph) if graph else max(e["ts"] + e.get("dur", 0) for e in launches)
    early = {e["args"].get("correlation") for e in launches if e["ts"] < t_replay}
    pre = sorted((e for e in kernels if e["args"].get("correlation") in early), key=lambda e: e["ts"])
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in pre]
    gpu_end = max((s[1] for s in spans), default=t_start)
    by_name: dict[str, list[float]] = {}
    for e in pre:
        entry = by_name.setdefault(e["name"][:90], [0.0, 0])
        entry[0] += e.get("dur", 0) / 1e3
        entry[1] += 1
    syncs: dict[str, list[float]] = {}
    waits = []
    for e in launches:
        if e["ts"] < t_replay and any(k in e["name"] for k in _SYNC_CALLS):
            entry = syncs.setdefault(e["name"], [0.0, 0])
            entry[0] += e.get("dur", 0) / 1e3
            entry[1] += 1
            if e.get("dur", 0) >= 200:
                waits.append([round((e["ts"] - t_start) / 1e3, 2), round(e["dur"] / 1e3, 2), e["name"],
                              _frames_at(py_events, e["ts"])])
    gaps, end = [], t_start  # GPU idle stretches >= 0.3 ms from the call's start to the last prefill kernel
    for s, e in spans:
        if s - end >= 300:
            gaps.append([round((end - t_start) / 1e3, 2), round((s - end) / 1e3, 2), _frames_at(py_events, end)])
        end = max(end, e)
    busy = _union_ms(spans)
    return {
        "prefill_wall_ms": (t_replay - t_start) / 1e3,
        "prefill_gpu_end_ms": (gpu_end - t_start) / 1e3,
        "prefill_gpu_busy_ms": busy,
        "prefill_gpu_idle_ms": (gpu_end - t_start) / 1e3 - busy,
        "prefill_kernels": len(pre),
        "prefill_syncs": {k: [round(v[0], 3), v[1]] for k, v in sorted(syncs.items(), key=lambda kv: -kv[1][0])},
        "prefill_waits": waits,  # [at ms, ms, call, python frames] for host waits >= 0.2 ms
        "prefill_gpu_gaps": gaps,  # [at ms, idle ms, python frames when the GPU ran dry]
        "prefill_top_kernels": [[k, round(v[0], 3), v[1]] for k, v in
                                sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def ab_schedule_copy(call, rounds: int = 4) -> dict:
    """Warm calls alternating between the default (a prefix plan's schedule copied to the GPU as queued work) and the
    behaviour before 7a1428c (a pageable copy, which waits until the work queued on the stream is done: reproduced
    by a stream synchronisation after the schedule is built). Every generate() call plans its batch anew."""
    import hf_cascade.ops.prefix_attention as prefix_attention

    queued = prefix_attention._build_schedule

    def waiting(*args, **kwargs):
        schedule = queued(*args, **kwargs)
        torch.cuda.current_stream().synchronize()
        return schedule

    times = {"queued_s": [], "waiting_s": []}
    try:
        for _ in range(rounds):
            for name, build in (("waiting_s", waiting), ("queued_s", queued)):
                prefix_attention._build_schedule = build
                times[name].append(round(wall_time(call)[0], 4))
    finally:
        prefix_attention._build_schedule = queued
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ab-schedule-copy", action="store_true",
                        help="also time warm calls that wait for the GPU when the prefix schedule is built (as before "
                             "7a1428c), alternating with the default in this process")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("profile_prefill.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    gen = dict(do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate,
               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    call = lambda: model.generate(ids, attention_mask=mask, **gen)  # noqa: E731
    record = {"bench": "profile_prefill", "peer": "cascade_generate", "layers": args.layers, "batch": args.batch,
              "prefix": args.prefix, "suffix": args.suffix, "new_tokens": args.new_tokens}
    record["first_call_s"], _ = wall_time(call)
    record["warm_calls_s"] = [round(wall_time(call)[0], 4) for _ in range(3)]
    if args.ab_schedule_copy:
        record["ab_schedule_copy"] = ab_schedule_copy(call)
    one = dict(gen, max_new_tokens=1, min_new_tokens=1)
    record["one_token_calls_s"] = [round(wall_time(lambda: model.generate(ids, attention_mask=mask, **one))[0], 4)
                                   for _ in range(3)]

    for with_stack in (False, True):  # the Python frames cost host time: timings from the first, places from both
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], with_stack=with_stack) as prof:
            with torch.profiler.record_function("profiled_generate_call"):
                call()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            found = analyse_trace(trace)
        if with_stack:
            record["with_stack"] = {k: found[k] for k in ("prefill_wall_ms", "prefill_gpu_busy_ms",
                                                          "prefill_waits", "prefill_gpu_gaps")}
        else:
            record.update(found)

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    call()
    torch.cuda.synchronize()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
    record["host_top"] = [[f"{os.path.basename(f)}:{line}:{name}", calls, round(tt * 1e3, 2), round(ct * 1e3, 2)]
                          for (f, line, name), (calls, _, tt, ct, _) in rows]

    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        prefix_ids = ids[:1, : args.prefix]
        suffix_ids = ids[:, args.prefix:]
        record["sdpa_prefix_forward_ms"] = cuda_time(lambda: model.model(prefix_ids), warmup=2, repeat=5)["ms"]
        record["sdpa_suffix_forward_ms"] = cuda_time(lambda: model.model(suffix_ids), warmup=2, repeat=5)["ms"]
    model.set_attn_implementation("cascade")
    print(json.dumps(record, indent=1))
    writer.write(record)


if __name__ == "__main__":
    main()
