"""One decode step of attention: cascade kernels vs SDPA over per-row (replicated) KV, on the GPU.

For each (heads, B, P, S): every row has one new query token, a P-token prefix shared by all rows and its own
S-token suffix. Cascade = ``hf_cascade.ops.cascade_attention`` (shared-prefix kernel + suffix kernel with the KV-split
combine and the prefix merge fused: 2 launches). The peer is ``torch.nn.functional.scaled_dot_product_attention`` on
KV replicated per row ``[B, Hkv, P + S, D]`` (what transformers' sdpa path reads). Each point is checked against a
float64 reference before it is timed.

Timing: device time from CUDA-graph replays (launch gaps drop out; in a decode step the launches overlap earlier
layers' work), cycling over enough copies of the inputs that they do not sit in the 50 MB L2 between calls (a real
decode step streams every layer's weights through L2 in between). ``eager ms`` is one plain Python call.

Reported: median ms (p20/p80), achieved GB/s on *unique* bytes (prefix once + suffixes + q + out), that as a % of
the device-to-device copy bandwidth measured in the same run, and the speedup over SDPA.

    python benchmarks/bench_kernels.py               # the issue's grid
    python benchmarks/bench_kernels.py --quick       # a few points
    python benchmarks/bench_kernels.py --tune        # sweep kernel configs / KV splits per shape (NOTES.md)
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ResultWriter, copy_bandwidth_gbs  # noqa: E402

from hf_cascade.ops import cascade_attention, plan_shared_prefix  # noqa: E402

D = 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 160e6  # cycle over input copies totalling at least this (> 3x the H100's 50 MB L2)


def unique_bytes(b, hq, hkv, p, s):
    e = 2  # bf16
    return 2 * hkv * D * e * (p + b * s) + 2 * b * hq * D * e  # K+V once each, q in, out


def replicated_bytes(b, hq, hkv, p, s):
    return 2 * hkv * D * 2 * b * (p + s) + 2 * b * hq * D * 2


def copies_for(nbytes):
    """How many input copies to cycle over so that one pass does not fit in L2."""
    return max(1, min(8, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def _stats(times):
    times = sorted(times)
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"ms": pick(0.5), "ms_p20": pick(0.2), "ms_p80": pick(0.8)}


def graph_time(calls, *, repeat=20, target_ms=2.0):
    """Median / p20 / p80 device ms per call of ``calls`` (callables cycled in order) from CUDA-graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compile, allocator pools
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for fn in calls:
            fn()
        end.record(stream)
    end.synchronize()
    est = max(start.elapsed_time(end) / len(calls), 1e-3)
    per_sample = len(calls) * max(1, min(200 // len(calls), round(target_ms / est / len(calls))))
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(per_sample):
                calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_sample)
    del graph
    return _stats(times)


def eager_time(calls, *, repeat=20):
    """Median ms of one plain (Python, eager) call, cycling over ``calls``; includes launch overhead."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _stats(times)


def rnd(*shape, gen):
    return torch.randn(*shape, device="cuda", dtype=DTYPE, generator=gen)


def reference(q, kp, vp, ks, vs, rows=4):
    """float64 attention of the first ``rows`` rows over [prefix | suffix]."""
    b = min(rows, q.shape[0])
    g = q.shape[1] // kp.shape[0]
    k = torch.cat([kp.expand(b, -1, -1, -1), ks[:b]], dim=2).double().repeat_interleave(g, dim=1)
    v = torch.cat([vp.expand(b, -1, -1, -1), vs[:b]], dim=2).double().repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q[:b].double(), k, v, scale=D**-0.5).float()


def bench_point(writer, copy_gbs, heads, b, p, s, repeat):
    hq, hkv = (int(x) for x in heads.split("/"))
    gen = torch.Generator(device="cuda").manual_seed(b * 7 + p + s)
    ub = unique_bytes(b, hq, hkv, p, s)
    n = copies_for(ub)
    q = rnd(b, hq, 1, D, gen=gen)
    sets = [(rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen), rnd(b, hkv, s, D, gen=gen), rnd(b, hkv, s, D, gen=gen))
            for _ in range(n)]
    plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
    scale = D**-0.5

    def step(kp, vp, ks, vs):
        return cascade_attention(q, ks, vs, [(kp, vp, plan)], scale=scale, causal=False)[0]

    calls = [lambda st=st: step(*st) for st in sets]
    out = step(*sets[0])
    ref = reference(q, *sets[0])
    err = ((out[: ref.shape[0]].float() - ref).norm() / ref.norm()).item()
    bf16_err = ((ref.to(DTYPE).float() - ref).norm() / ref.norm()).item()
    from hf_cascade.ops._launch import _fuse_suffix

    form = "fused" if _fuse_suffix(q, sets[0][2], [(sets[0][0], sets[0][1], plan)]) else "two-pass"
    record = dict(bench="decode_step", op="cascade_attention", form=form, launches=2, heads=heads, batch=b, prefix=p,
                  suffix=s, head_dim=D, dtype="bf16", input_copies=n)
    record.update(rel_err=err, rel_err_bf16_rounding=bf16_err, check_ok=err <= 2 * bf16_err + 1e-3)
    if not record["check_ok"]:  # verification gates timing: a wrong answer has no speed
        record["status"] = f"check failed: relative error {err:.2e} > 2 x bf16 rounding {bf16_err:.2e} + 1e-3"
        writer.write(record)
        return record
    record.update({f"cascade_eager_{k}": v for k, v in eager_time(calls, repeat=repeat).items()})
    t = graph_time(calls, repeat=repeat)
    record.update({f"cascade_{k}": v for k, v in t.items()})
    record["unique_bytes"] = ub
    record["unique_gbs"] = ub / (t["ms"] * 1e-3) / 1e9
    record["pct_of_copy"] = 100 * record["unique_gbs"] / copy_gbs
    record["unique_roofline_ms"] = ub / (copy_gbs * 1e9) * 1e3
    # Peer: SDPA over per-row KV (skipped when it would not fit comfortably).
    rb = replicated_bytes(b, hq, hkv, p, s)
    n_sdpa = copies_for(rb)
    if rb * n_sdpa < 0.5 * torch.cuda.mem_get_info()[0]:
        peers = []
        for kp, vp, ks, vs in sets[:n_sdpa]:
            peers.append((torch.cat([kp.expand(b, -1, -1, -1), ks], dim=2), torch.cat([vp.expand(b, -1, -1, -1), vs], dim=2)))
        while len(peers) < n_sdpa:  # same data, other buffers: still out of L2
            peers.append((peers[0][0].clone(), peers[0][1].clone()))
        sd_calls = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv) for k, v in peers]
        sd = graph_time(sd_calls, repeat=repeat)
        record.update({f"sdpa_{k_}": v_ for k_, v_ in sd.items()})
        record["sdpa_input_copies"] = n_sdpa
        record["speedup_vs_sdpa"] = sd["ms"] / t["ms"]
        del peers, sd_calls
    else:
        record["sdpa_status"] = "skipped: replicated KV would not fit"
    writer.write(record)
    del q, sets, calls
    torch.cuda.empty_cache()
    return record


def run_grid(args):
    writer = ResultWriter("kernels.jsonl", args.output)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s", flush=True)
    writer.write({"bench": "copy_bandwidth", "gbs": copy_gbs})
    header = (f"{'H':>6} {'B':>4} {'P':>6} {'S':>5} {'eager ms':>8} {'cascade ms':>10} {'floor ms':>8} {'GB/s':>6} "
              f"{'%copy':>6} {'sdpa ms':>8} {'speedup':>7} {'err':>8}")
    print(header, flush=True)
    rows = []
    for heads, b, p, s in itertools.product(args.heads, args.batches, args.prefixes, args.suffixes):
        r = bench_point(writer, copy_gbs, heads, b, p, s, args.repeat)
        rows.append(r)
        if not r["check_ok"]:
            print(f"{heads:>6} {b:>4} {p:>6} {s:>5} FAIL ({r['status']}): not timed", flush=True)
            continue
        sd_ms = r.get("sdpa_ms")
        sd_txt = f"{sd_ms:.4f}" if sd_ms else "-"
        speedup_txt = f"{r['speedup_vs_sdpa']:.1f}x" if sd_ms else "-"
        line = (f"{heads:>6} {b:>4} {p:>6} {s:>5} {r['cascade_eager_ms']:>8.4f} {r['cascade_ms']:>10.4f} "
                f"{r['unique_roofline_ms']:>8.4f} {r['unique_gbs']:>6.0f} {r['pct_of_copy']:>6.1f} "
                f"{sd_txt:>8} {speedup_txt:>7} {r['rel_err']:>8.1e} {r['form']}{'' if r['check_ok'] else ' FAIL'}")
        print(line, flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- tuning sweep
PREFIX_CFGS = {  # BLOCK_M -> [(BLOCK_N, num_warps, num_stages)]
    16: [(64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 4, 4)],
    32: [(64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 4, 4)],
    64: [(64, 4, 3), (64, 4, 2), (128, 4, 2), (64, 4, 4), (32, 4, 4)],
    128: [(64, 8, 3), (64, 8, 2), (128, 8, 2), (32, 8, 4)],
}
SUFFIX_CFGS = [(64, 4, 3), (64, 4, 2), (128, 4, 2), (128, 4, 3), (32, 4, 4), (64, 2, 3)]


def tune(args):
    """Time the prefix kernel (partials out) and the suffix kernel (8 prefix states in) per config and split."""
    from hf_cascade.ops._launch import launch_prefix, partial_strides, prefix_launch_config
    from hf_cascade.ops._launch import launch_suffix

    writer = ResultWriter("kernels_tune.jsonl", args.output)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = D**-0.5
    summary = []
    for heads, b, p in itertools.product(args.heads, args.batches, args.prefixes) if "prefix" in args.sections else ():
        hq, hkv = (int(x) for x in heads.split("/"))
        g = hq // hkv
        kv_bytes = 2 * hkv * p * D * 2
        n = copies_for(kv_bytes)
        q = rnd(b, hq, 1, D, gen=gen)
        kvs = [(rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen)) for _ in range(n)]
        plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
        heur = prefix_launch_config(q, kvs[0][0], plan, None, None, None)
        bm_auto = min(128, max(16, 1 << (b * g - 1).bit_length()))
        results = []
        for bm in sorted({bm_auto, min(bm_auto, 64)}):
            sched = plan.schedule(g, bm)
            for bn, w, st in PREFIX_CFGS[bm]:
                for ns in (1, 2, 4, 8, 16, 32, 64):
                    if p // ns < 128 or sched.num_tiles * hkv * ns > 4096:
                        continue
                    po = torch.empty((ns, hkv, b * g, D), dtype=torch.float32, device="cuda")
                    pl = torch.empty((ns, hkv, b * g), dtype=torch.float32, device="cuda")
                    strides = partial_strides(po, pl, 1, g, D)
                    cfg = (sched, ns, bm, bn, w, st)
                    calls = [lambda k=k, v=v, cfg=cfg, po=po, pl=pl, strides=strides: launch_prefix(
                        q, k, v, plan, cfg, po, pl, *strides, 0, scale=scale, softcap=None) for k, v in kvs]
                    try:
                        t = graph_time(calls, repeat=10, target_ms=1.5)["ms"]
                    except Exception as e:  # a config that does not compile / fit: note and go on
                        print(f"  skip bm={bm} bn={bn} w={w} st={st}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        break
                    results.append((t, bm, bn, w, st, ns))
                    writer.write(dict(bench="tune_prefix", heads=heads, batch=b, prefix=p, block_m=bm, block_n=bn,
                                      num_warps=w, num_stages=st, splits=ns, ms=t,
                                      kv_gbs=kv_bytes / (t * 1e-3) / 1e9))
        results.sort()
        h = next((r for r in results if r[1:] == tuple(heur[2:]) + (heur[1],)), None)
        floor = kv_bytes / (copy_gbs * 1e9) * 1e3
        best = results[0]
        line = (f"prefix {heads:>5} B={b:<4} P={p:<6} floor {floor:.4f}  best {best[0]:.4f} ms "
                f"(bm={best[1]} bn={best[2]} w={best[3]} st={best[4]} ns={best[5]}, {100 * floor / best[0]:.0f}% copy)  "
                f"heuristic {h[0] if h else float('nan'):.4f} (ns={heur[1]})  next: "
                + "; ".join(f"{r[0]:.4f} bm{r[1]} bn{r[2]} w{r[3]} st{r[4]} ns{r[5]}" for r in results[1:4]))
        print(line, flush=True)
        summary.append(line)
        del q, kvs
        torch.cuda.empty_cache()
    # Suffix kernel: decode rows, 8 prefix state slots seeded in the prologue.
    for heads, b, s in itertools.product(args.heads, args.batches, args.suffixes) if "suffix" in args.sections else ():
        hq, hkv = (int(x) for x in heads.split("/"))
        g = hq // hkv
        kv_bytes = 2 * b * hkv * s * D * 2
        n = copies_for(kv_bytes)
        q = rnd(b, hq, 1, D, gen=gen)
        kvs = [(rnd(b, hkv, s, D, gen=gen), rnd(b, hkv, s, D, gen=gen)) for _ in range(n)]
        ns = 8
        po = torch.randn((ns, hkv, b * g, D), dtype=torch.float32, device="cuda")
        pl = torch.randn((ns, hkv, b * g), dtype=torch.float32, device="cuda")
        o_str, l_str = partial_strides(po, pl, 1, g, D)
        states = (po, pl, ns, (*o_str, 1), l_str)
        results = []
        for bn, w, st in SUFFIX_CFGS:
            calls = [lambda k=k, v=v, bn=bn, w=w, st=st: launch_suffix(
                q, k, v, scale=scale, mask=None, causal=True, softcap=None, states=states, block_n=bn,
                num_warps=w, num_stages=st) for k, v in kvs]
            t = graph_time(calls, repeat=10, target_ms=1.5)["ms"]
            results.append((t, bn, w, st))
            writer.write(dict(bench="tune_suffix", heads=heads, batch=b, suffix=s, block_n=bn, num_warps=w,
                              num_stages=st, prefix_states=ns, ms=t, kv_gbs=kv_bytes / (t * 1e-3) / 1e9))
        results.sort()
        floor = (kv_bytes + ns * hkv * b * g * D * 4) / (copy_gbs * 1e9) * 1e3
        line = (f"suffix {heads:>5} B={b:<4} S={s:<5} floor {floor:.4f}  "
                + "; ".join(f"{r[0]:.4f} bn{r[1]} w{r[2]} st{r[3]}" for r in results))
        print(line, flush=True)
        summary.append(line)
        del q, kvs
        torch.cuda.empty_cache()
    if "cascade" in args.sections:
        summary += compare_cascade(args, writer, copy_gbs)
    if "decode" in args.sections:
        summary += tune_decode(args, writer, copy_gbs)
    print("\n".join(["", "== tune summary =="] + summary), flush=True)


CASCADE_POINTS = [(8, 4096, 128), (8, 16384, 1024), (32, 4096, 128), (32, 16384, 256), (64, 4096, 256),
                  (64, 16384, 256), (64, 16384, 1024), (128, 16384, 128), (256, 4096, 128)]


def compare_cascade(args, writer, copy_gbs):
    """cascade_attention with the suffix fused into the last prefix launch vs the two-pass form."""
    import functools
    import time

    from hf_cascade.ops._launch import cascade_triton

    lines = []
    heads = "32/8"
    hq, hkv = 32, 8
    for b, p, s in CASCADE_POINTS:
        gen = torch.Generator(device="cuda").manual_seed(b + p + s)
        ub = unique_bytes(b, hq, hkv, p, s)
        n = copies_for(ub)
        q = rnd(b, hq, 1, D, gen=gen)
        sets = [(rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen), rnd(b, hkv, s, D, gen=gen),
                 rnd(b, hkv, s, D, gen=gen)) for _ in range(n)]
        plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
        ref = reference(q, *sets[0])
        res = {}
        for fused in (True, False):
            fn = functools.partial(cascade_triton, scale=D**-0.5, mask=None, causal=False, softcap=None,
                                   fuse_suffix=fused)
            calls = [lambda st=st, fn=fn: fn(q, st[2], st[3], [(st[0], st[1], plan)]) for st in sets]
            out = calls[0]()[0]
            err = ((out[: ref.shape[0]].float() - ref).norm() / ref.norm()).item()
            t = graph_time(calls, repeat=15)["ms"]
            e = eager_time(calls, repeat=15)["ms"]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(50):
                calls[i % n]()
            host_us = (time.perf_counter() - t0) / 50 * 1e6  # launch queue not full: host cost per call
            torch.cuda.synchronize()
            res[fused] = (t, e, err, host_us)
            writer.write(dict(bench="cascade_variant", heads=heads, batch=b, prefix=p, suffix=s, fused=fused, ms=t,
                              eager_ms=e, host_us=host_us, rel_err=err, pct_of_copy=100 * ub / (t * 1e-3) / 1e9 / copy_gbs))
        floor = ub / (copy_gbs * 1e9) * 1e3
        line = (f"cascade B={b:<4} P={p:<6} S={s:<5} floor {floor:.4f}  fused {res[True][0]:.4f} ms "
                f"({100 * floor / res[True][0]:.0f}%) eager {res[True][1]:.4f} host {res[True][3]:.0f}us err {res[True][2]:.1e} | "
                f"two-pass {res[False][0]:.4f} ({100 * floor / res[False][0]:.0f}%) eager {res[False][1]:.4f} "
                f"host {res[False][3]:.0f}us err {res[False][2]:.1e}")
        print(line, flush=True)
        lines.append(line)
        del q, sets
        torch.cuda.empty_cache()
    return lines


DECODE_VARIANTS = [  # (fused, BLOCK_M, BLOCK_N, num_warps, num_stages, splits); None: the heuristic's choice
    (True, 64, 64, 4, 3, None), (True, 64, 64, 4, 3, 4), (True, 64, 64, 4, 3, 16), (True, 64, 64, 4, 2, None),
    (True, 64, 64, 4, 4, None), (True, 64, 32, 4, 4, None), (True, 64, 128, 4, 2, None), (True, 32, 64, 4, 3, None),
    (True, 32, 64, 4, 3, 16), (True, 128, 64, 8, 3, None), (True, 128, 64, 8, 3, 16),
    (False, 128, 64, 8, 3, None), (False, 128, 64, 8, 3, 16), (False, 64, 64, 4, 3, 16),
]


def tune_decode(args, writer, copy_gbs):
    """cascade_attention's launch choices at decode shapes (one query per row, a suffix mask tensor as in the
    compiled decode step): the heuristic's choice against variants of tile sizes, stages and KV splits."""
    from hf_cascade.ops._launch import launch_cascade, launch_configs

    lines = []
    hq, hkv = 32, 8
    g = hq // hkv
    for b, p, s in itertools.product(args.batches, args.prefixes, args.suffixes):
        gen = torch.Generator(device="cuda").manual_seed(b + p + s)
        ub = unique_bytes(b, hq, hkv, p, s)
        n = copies_for(ub)
        q = rnd(b, hq, 1, D, gen=gen)
        sets = [(rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen), rnd(b, hkv, s, D, gen=gen),
                 rnd(b, hkv, s, D, gen=gen)) for _ in range(n)]
        mask = torch.ones(b, 1, s, dtype=torch.bool, device="cuda")
        mask[:, :, s - s // 4:] = False  # the step's unwritten columns
        plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
        ref_rows = min(4, b)
        k_ref = torch.cat([sets[0][0].expand(ref_rows, -1, -1, -1), sets[0][2][:ref_rows, :, : s - s // 4]], dim=2)
        v_ref = torch.cat([sets[0][1].expand(ref_rows, -1, -1, -1), sets[0][3][:ref_rows, :, : s - s // 4]], dim=2)
        ref = F.scaled_dot_product_attention(q[:ref_rows].double(), k_ref.double().repeat_interleave(g, dim=1),
                                             v_ref.double().repeat_interleave(g, dim=1), scale=D**-0.5).float()
        bf16_err = ((ref.to(DTYPE).float() - ref).norm() / ref.norm()).item()
        heur_fused, heur_cfgs = launch_configs(q, sets[0][2], [(sets[0][0], sets[0][1], plan)], shape_only=True)
        results = []
        heur_variant = (heur_fused, *heur_cfgs[0][2:], heur_cfgs[0][1])  # always timed, listed or not
        variants = list(DECODE_VARIANTS)
        if not any(v[:5] == heur_variant[:5] and v[5] in (None, heur_variant[5]) for v in variants):
            variants.append(heur_variant)
        for fused, bm, bn, w, st, splits in variants:
            sched = plan.schedule(g, bm)
            ns = splits or launch_configs(q, sets[0][2], [(sets[0][0], sets[0][1], plan)], fuse_suffix=fused,
                                          shape_only=True)[1][0][1]
            cfg = [(sched, ns, bm, bn, w, st)]
            heuristic = fused == heur_fused and tuple(cfg[0][1:]) == tuple(heur_cfgs[0][1:])
            calls = [lambda st_=st_, cfg=cfg, fused=fused: launch_cascade(
                q, st_[2], st_[3], [(st_[0], st_[1])], cfg, fused, scale=D**-0.5, mask=mask, causal=False,
                softcap=None) for st_ in sets]
            try:
                out = calls[0]()[0]
                err = ((out[:ref_rows].float() - ref).norm() / ref.norm()).item()
                t = graph_time(calls, repeat=15)["ms"]
            except Exception as e:  # a config that does not compile / fit: note it and go on
                print(f"  skip {fused, bm, bn, w, st, ns}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            ok = err <= 2 * bf16_err + 1e-3
            results.append((t, fused, bm, bn, w, st, ns, heuristic, ok))
            writer.write(dict(bench="tune_decode", heads="32/8", batch=b, prefix=p, suffix=s, fused=fused, block_m=bm,
                              block_n=bn, num_warps=w, num_stages=st, splits=ns, heuristic=heuristic, ms=t,
                              rel_err=err, check_ok=ok,
                              pct_of_copy=100 * ub / (t * 1e-3) / 1e9 / copy_gbs))
        results.sort()
        floor = ub / (copy_gbs * 1e9) * 1e3
        heur = next((r for r in results if r[7]), None)
        line = (f"decode B={b:<4} P={p:<6} S={s:<5} floor {floor:.4f} heuristic {heur[0] if heur else float('nan'):.4f}"
                " | " + "; ".join(f"{r[0]:.4f} {'F' if r[1] else '2'} m{r[2]} n{r[3]} w{r[4]} st{r[5]} ns{r[6]}"
                                  f"{'' if r[8] else ' BAD'}" for r in results[:6]))
        print(line, flush=True)
        lines.append(line)
        del q, sets
        torch.cuda.empty_cache()
    return lines


def profile_host():
    """Where the host time of one eager cascade_attention call goes (cProfile, launches queued, no sync)."""
    import cProfile
    import pstats

    b, p, s, hq, hkv = 32, 4096, 128, 32, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = rnd(b, hq, 1, D, gen=gen)
    kp, vp, ks, vs = rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen), rnd(b, hkv, s, D, gen=gen), rnd(b, hkv, s, D, gen=gen)
    plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
    call = lambda: cascade_attention(q, ks, vs, [(kp, vp, plan)], scale=D**-0.5)  # noqa: E731
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--suffixes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--heads", nargs="+", default=["32/8", "32/32"], help="q_heads/kv_heads")
    parser.add_argument("--quick", action="store_true", help="B in {8, 64}, P in {4K, 16K}, S=256, GQA only")
    parser.add_argument("--tune", action="store_true", help="sweep kernel configs and KV splits (see NOTES.md)")
    parser.add_argument("--sections", nargs="+", default=["prefix", "suffix"], help="--tune parts: prefix suffix cascade decode")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the host side of eager calls")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU.")
    if args.quick:
        args.batches, args.prefixes, args.suffixes, args.heads = [8, 64], [4096, 16384], [256], ["32/8"]
    if args.profile_host:
        profile_host()
    elif args.tune:
        tune(args)
    else:
        run_grid(args)


if __name__ == "__main__":
    main()
