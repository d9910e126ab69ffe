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
* ``prefill_idle_by_phase``: {phase: [GPU idle ms, GPU busy ms, kernels, host ms]}, each kernel's idle-before and
  time charged to the host phase that launched it (``plan``: hf_cascade's planning; ``prefix_forward``: the shared
  nodes' prefill; ``forward``: generate()'s forwards, the first being the suffix prefill; ``other``);
  ``host_phases``: cProfile of the planning and of generate()'s first forward (another warm call);
* ``prefill_top_kernels``: [name, ms, count] by total time; ``host_top``: cProfile of another warm call, by own time;
* floors in the same process: ``sdpa_prefix_forward_ms`` (model.model on the P shared tokens, sdpa) and
  ``sdpa_suffix_forward_ms`` (the B x S own tokens, sdpa, no past): the GEMM work the prefill cannot avoid.

    python benchmarks/probes/profile_prefill.py --layers 32 --batch 32 --prefix 4096 --suffix 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import tempfile

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args, cuda_time, wall_time  # noqa: E402

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
    idle_by_phase = _idle_by_phase(events, launches, pre, t_start)
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
        "prefill_idle_by_phase": idle_by_phase,
        "prefill_top_kernels": [[k, round(v[0], 3), v[1]] for k, v in
                                sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _idle_by_phase(events, launches, kernels, t_start) -> dict:
    """GPU idle before each prefill kernel (from the end of the previous one, or the call's start), summed by the
    phase its launch was made in (``phase:*`` ranges of :func:`mark_phases`; innermost wins; ``other`` outside them):
    {phase: [idle ms, busy ms, kernels, host ms in the phase]}. Idle charged to a phase is the GPU waiting for that
    phase's host work."""
    phases = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"][6:]) for e in events
                     if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase:")),
                    key=lambda p: p[0])
    launch_ts = {e["args"].get("correlation"): e["ts"] for e in launches}

    def phase_of(t):
        inside = [p for p in phases if p[0] <= t <= p[1]]
        return min(inside, key=lambda p: p[1] - p[0])[2] if inside else "other"

    out: dict[str, list[float]] = {}
    for name in {p[2] for p in phases}:
        host = sum(p[1] - p[0] for p in phases if p[2] == name) / 1e3
        out[name] = [0.0, 0.0, 0, round(host, 2)]
    out.setdefault("other", [0.0, 0.0, 0, 0.0])
    end = t_start
    for k in kernels:
        entry = out[phase_of(launch_ts.get(k["args"].get("correlation"), k["ts"]))]
        entry[0] += max(k["ts"] - end, 0) / 1e3
        entry[1] += k.get("dur", 0) / 1e3
        entry[2] += 1
        end = max(end, k["ts"] + k.get("dur", 0))
    return {k: [round(v[0], 2), round(v[1], 2), v[2], v[3]] for k, v in out.items()}


@contextlib.contextmanager
def _replaced(owner, name: str, value, hooks=()):
    """``owner.name`` is ``value`` inside the block (and the forward hooks ``(module, pre, post)`` in ``hooks`` are
    registered); both undone on the way out."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    handles = [h for module, pre, post in hooks
               for h in (module.register_forward_pre_hook(pre), module.register_forward_hook(post))]
    try:
        yield
    finally:
        setattr(owner, name, old)
        for h in handles:
            h.remove()


def marked_phases(model):
    """Inside the block, the host phases of a generate() call are named in the profiler trace: ``phase:plan``
    (hf_cascade's planning, its prefill included), ``phase:prefix_forward`` (the base model run over shared nodes),
    ``phase:forward`` (each forward of the whole model: generate()'s first forward is the suffix prefill)."""
    import hf_cascade.inputs as inputs

    plan = inputs.plan_cascade_batch
    open_ranges = []

    def planned(*args, **kwargs):
        with torch.profiler.record_function("phase:plan"):
            return plan(*args, **kwargs)

    def enter(module, args, kwargs=None):
        # The whole model's forward is generate()'s; the base model's own, outside it, is the prefill of shared nodes.
        whole = module is model
        inside = any(name == "phase:forward" for name, _ in open_ranges)
        name = "phase:forward" if whole else (None if inside else "phase:prefix_forward")
        rf = torch.profiler.record_function(name) if name else None
        if rf is not None:
            rf.__enter__()
        open_ranges.append((name, rf))

    def leave(module, args, output):
        _, rf = open_ranges.pop()
        if rf is not None:
            rf.__exit__(None, None, None)

    return _replaced(inputs, "plan_cascade_batch", planned, [(model, enter, leave), (model.model, enter, leave)])


def profile_host_phases(model, call) -> dict:
    """cProfile (by own time, top 20) of hf_cascade's planning and of generate()'s first forward, in one warm call."""
    import hf_cascade.inputs as inputs

    plan = inputs.plan_cascade_batch
    profilers = {"plan": cProfile.Profile(), "first_forward": cProfile.Profile()}
    state = {"forwards": 0}

    def planned(*args, **kwargs):
        profilers["plan"].enable()
        try:
            return plan(*args, **kwargs)
        finally:
            profilers["plan"].disable()

    def pre(module, args):
        state["forwards"] += 1
        if state["forwards"] == 1:
            profilers["first_forward"].enable()

    def post(module, args, output):
        if state["forwards"] == 1:
            profilers["first_forward"].disable()

    with _replaced(inputs, "plan_cascade_batch", planned, [(model, pre, post)]):
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
    out = {}
    for name, profiler in profilers.items():
        stats = pstats.Stats(profiler, stream=io.StringIO())
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:20]
        out[name] = {"total_ms": round(stats.total_tt * 1e3, 2),
                     "top": [[f"{os.path.basename(f)}:{line}:{fn}", calls, round(tt * 1e3, 2), round(ct * 1e3, 2)]
                             for (f, line, fn), (calls, _, tt, ct, _) in rows]}
    return out


def ab_schedule_copy(call, rounds: int = 4) -> dict:
    """Warm calls alternating between the default (a prefix plan's schedule copied to the GPU as queued work) and the
    behaviour before 7a1428c (a pageable copy, which waits until the work queued on the stream is done: reproduced
    by a stream synchronisation after the schedule is built). Every generate() call plans its batch anew."""
    import hf_cascade.ops.plan as plan_module

    queued = plan_module._build_schedule

    def waiting(*args, **kwargs):
        schedule = queued(*args, **kwargs)
        torch.cuda.current_stream().synchronize()
        return schedule

    times = {"queued_s": [], "waiting_s": []}
    for _ in range(rounds):
        for name, build in (("waiting_s", waiting), ("queued_s", queued)):
            with _replaced(plan_module, "_build_schedule", build):
                times[name].append(round(wall_time(call)[0], 4))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add_shared_workload_args(parser)
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
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with marked_phases(model), torch.profiler.profile(activities=activities, with_stack=with_stack) as prof:
            with torch.profiler.record_function("profiled_generate_call"):
                call()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            found = analyse_trace(trace)
        if with_stack:
            record["with_stack"] = {k: found[k] for k in ("prefill_wall_ms", "prefill_gpu_busy_ms",
                                                          "prefill_waits", "prefill_gpu_gaps", "prefill_idle_by_phase")}
        else:
            record.update(found)

    record["host_phases"] = profile_host_phases(model, call)
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
