"""Where one decode step's cascade attention spends its time (GPU): the compiled step's launches, taken apart.

Shape of the shared workload's decode step: B rows share a P-token prefix, one query each, GQA Hq/Hkv, d=128, bf16,
suffix buffers of S columns with the last quarter unwritten (a bool mask, as in the compiled step). Times are
CUDA-graph replays over input copies that do not fit in L2 (``bench_kernels.graph_time``), in us:

* ``full``: what the step launches (the heuristic's fused prefix+suffix kernel, then the state combine);
* ``fused_only`` / ``combine_only``: the two launches alone;
* ``prefix_only`` (splits, BLOCK_M): the prefix kernel writing split states, no suffix; ``suffix_only``: the suffix
  kernel, no prefix states, over S columns and over the written 3/4 of them;
* ``copy_prefix_kv`` / ``copy_suffix_kv``: torch copies of the same bytes (the memory floor of each pass).

    python benchmarks/probes/probe_decode_attention.py --batch 32 --prefix 4096 --suffix 128
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/probes/probe_decode_attention.py --ncu
"""

from __future__ import annotations

import argparse
import json

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_kernels import D, copies_for, graph_time, rnd  # noqa: E402
from common import ResultWriter  # noqa: E402

from hf_cascade.ops import plan_shared_prefix  # noqa: E402
from hf_cascade.ops._launch import _launch_fused, launch_cascade, launch_configs  # noqa: E402
from hf_cascade.ops._launch import _num_splits_for, launch_combine, launch_prefix, partial_strides  # noqa: E402
from hf_cascade.ops._launch import launch_suffix  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--ncu", action="store_true",
                        help="launch each variant 3 times, no graphs, no timing (run under ncu)")
    parser.add_argument("--sweep", action="store_true",
                        help="time each pass alone over tile sizes, warps and stages, with the registers, spills and "
                             "shared memory Triton compiled them with")
    parser.add_argument("--sweep-prefill", action="store_true",
                        help="the suffix pass of generate()'s first forward (each row's window of --window queries "
                             "over its suffix buffer, seeded with one prefix state per query) over launch choices")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("probe_decode_attention.jsonl", args.output)
    hq, hkv = map(int, args.heads.split("/"))
    if args.sweep_prefill:
        return sweep_prefill(args, writer, hq, hkv)
    b, p, s, g = args.batch, args.prefix, args.suffix, hq // hkv
    written = s - s // 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    nbytes = 2 * hkv * D * 2 * (p + b * s)
    n = copies_for(nbytes)
    q = rnd(b, hq, 1, D, gen=gen)
    sets = [(rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen), rnd(b, hkv, s, D, gen=gen), rnd(b, hkv, s, D, gen=gen))
            for _ in range(n)]
    mask = torch.ones(b, 1, s, dtype=torch.bool, device="cuda")
    mask[:, :, written:] = False
    plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
    fuse, cfgs = launch_configs(q, sets[0][2], [(sets[0][0], sets[0][1], plan)], shape_only=True)
    sched, splits, bm, bn, w, st = cfgs[0]
    us = {}

    def timed(name, calls):
        if args.ncu:
            for call in calls[:3]:
                call()
            torch.cuda.synchronize()
            print(f"launched {name}", flush=True)
            return
        us[name] = round(graph_time(calls, repeat=15)["ms"] * 1e3, 2)
        print(f"{name:40s} {us[name]:8.2f} us", flush=True)

    timed(f"full (fused={fuse} m{bm} n{bn} w{w} st{st} splits{splits})",
          [lambda t=t: launch_cascade(q, t[2], t[3], [(t[0], t[1])], cfgs, fuse, scale=D**-0.5, mask=mask,
                                      causal=False, softcap=None) for t in sets])
    slots = splits + 1
    m_total = b * g
    part_out = torch.empty((slots, hkv, m_total, D), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((slots, hkv, m_total), dtype=torch.float32, device="cuda")
    o_str, l_str = partial_strides(part_out, part_lse, 1, g, D)
    out = torch.empty((b, 1, hq, D), dtype=q.dtype, device="cuda").transpose(1, 2)
    lse = torch.empty((b, hq, 1), dtype=torch.float32, device="cuda")
    if fuse:
        timed("fused_only", [lambda t=t: _launch_fused(q, t[0], t[1], cfgs[0], t[2], t[3], mask, False, part_out,
                                                       part_lse, o_str, l_str, 0, slots - 1, scale=D**-0.5,
                                                       softcap=None) for t in sets])
    timed(f"combine_only ({slots} slots)", [lambda: launch_combine(out, lse, part_out, part_lse, g)])
    for block_m, warps in ((64, 4), (128, 8)):
        sch = plan.schedule(g, block_m)
        for ns in sorted({4, 8, 16, _num_splits_for(p, sch.num_tiles, hkv, 64, q.device)}):
            po = torch.empty((ns, hkv, m_total, D), dtype=torch.float32, device="cuda")
            pl = torch.empty((ns, hkv, m_total), dtype=torch.float32, device="cuda")
            os_, ls_ = partial_strides(po, pl, 1, g, D)
            cfg = (sch, ns, block_m, 64, warps, 3)
            timed(f"prefix_only m{block_m} splits{ns}",
                  [lambda t=t, cfg=cfg, po=po, pl=pl, os_=os_, ls_=ls_: launch_prefix(
                      q, t[0], t[1], None, cfg, po, pl, os_, ls_, 0, scale=D**-0.5, softcap=None) for t in sets])
    for cols in (s, written):
        m = mask[:, :, :cols]
        timed(f"suffix_only S={cols}", [lambda t=t, m=m, cols=cols: launch_suffix(
            q, t[2][:, :, :cols], t[3][:, :, :cols], scale=D**-0.5, mask=m, causal=False, softcap=None, states=None)
            for t in sets])
    dst_p = torch.empty_like(sets[0][0])
    dst_s = torch.empty_like(sets[0][2])
    timed("copy_prefix_kv (K+V read, written)", [lambda t=t: (dst_p.copy_(t[0]), dst_p.copy_(t[1])) for t in sets])
    timed("copy_suffix_kv (K+V read, written)", [lambda t=t: (dst_s.copy_(t[2]), dst_s.copy_(t[3])) for t in sets])
    if args.ncu:
        return
    record = {"bench": "probe_decode_attention", "heads": args.heads, "batch": b, "prefix": p, "suffix": s,
              "written": written, "us": us}
    if args.sweep:
        record["sweep"] = sweep(q, sets, mask, plan, hkv, g, p)
    writer.write(record)
    print(json.dumps(record))


def sweep_prefill(args, writer, hq, hkv):
    """The first forward's suffix launch: B rows x ``window`` queries over S suffix columns (causal within the
    window, as a bool mask), merged with one fp32 prefix state per query (the prefix kernel's output)."""
    from hf_cascade.ops import _suffix_kernel

    b, s, lq, g = args.batch, args.suffix, args.window, hq // hkv
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = rnd(b, hq, lq, D, gen=gen)
    k, v = rnd(b, hkv, s, D, gen=gen), rnd(b, hkv, s, D, gen=gen)
    cols = torch.arange(s, device="cuda")
    pos = torch.arange(lq, device="cuda")
    mask = (cols[None, :] <= pos[:, None] + (s - lq) // 2)[None].expand(b, lq, s).contiguous()  # the written part
    po = torch.randn((1, hkv, b * lq * g, D), device="cuda", dtype=torch.float32)
    pl = torch.randn((1, hkv, b * lq * g), device="cuda", dtype=torch.float32)
    o_str, l_str = partial_strides(po, pl, lq, g, D)
    states = (po, pl, 1, (*o_str, 1), l_str)
    ref = launch_suffix(q, k, v, scale=D**-0.5, mask=mask, causal=False, softcap=None, states=states)[0].float()
    rows = []
    for bm, bn, w, st in [(None, None, None, None), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2),
                          (32, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 3), (16, 64, 4, 2), (128, 64, 8, 2),
                          (128, 32, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2)]:
        try:
            call = lambda: launch_suffix(q, k, v, scale=D**-0.5, mask=mask, causal=False, softcap=None,  # noqa: E731
                                         states=states, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            out, built = _built_during(_suffix_kernel._suffix_fwd_kernel, call)
            err = ((out[0].float() - ref).norm() / ref.norm()).item()
            t = round(graph_time([call], repeat=10)["ms"] * 1e3, 2)
        except Exception as e:  # noqa: BLE001
            t, err, built = repr(e)[:80], None, None
        rows.append([f"m{bm} n{bn} w{w} st{st}" if bm else "heuristic", t, err, built])
        print(rows[-1], flush=True)
    # The prefix pass of the same forward: every query of the batch (one node) against the shared P keys.
    p = args.prefix
    kp, vp = rnd(hkv, p, D, gen=gen), rnd(hkv, p, D, gen=gen)
    plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
    m_total = b * lq * g
    for bm, bn, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3),
                          (64, 64, 4, 3), (128, 64, 4, 3)]:
        sch = plan.schedule(g * lq, bm)
        ns = _num_splits_for(p, sch.num_tiles, hkv, bn, q.device)
        po2 = torch.empty((ns, hkv, m_total, D), dtype=torch.float32, device="cuda")
        pl2 = torch.empty((ns, hkv, m_total), dtype=torch.float32, device="cuda")
        os2, ls2 = partial_strides(po2, pl2, lq, g, D)
        cfg = (sch, ns, bm, bn, w, st)
        try:
            t = round(graph_time([lambda: launch_prefix(q, kp, vp, None, cfg, po2, pl2, os2, ls2, 0, scale=D**-0.5,
                                                        softcap=None)], repeat=10)["ms"] * 1e3, 2)
        except Exception as e:  # noqa: BLE001
            t = repr(e)[:80]
        tflops = 4 * b * lq * hq * p * D / (t * 1e-6) / 1e12 if isinstance(t, float) else None
        rows.append([f"prefix m{bm} n{bn} w{w} st{st} splits{ns}", t, tflops])
        print(rows[-1], flush=True)
    writer.write({"bench": "probe_prefill_suffix", "heads": args.heads, "batch": b, "suffix": s, "window": lq,
                  "us": rows})


def _kernels(jit_fn) -> dict:
    """{id: compiled kernel} of every variant Triton has built of ``jit_fn`` in this process ({} if its internals
    moved)."""
    try:
        return {id(k): k for caches in jit_fn.device_caches.values() for k in caches[0].values()}
    except Exception:  # noqa: BLE001 (Triton internals move between versions: report nothing, don't fail)
        return {}


def _built_during(jit_fn, fn):
    """``(fn(), [registers, spills, shared bytes] of the variant of jit_fn that fn built, or None)``: the launch
    choices a row times are the variant it built, so its resources are read from that variant."""
    before = _kernels(jit_fn)
    result = fn()
    new = [k for key, k in _kernels(jit_fn).items() if key not in before]
    if len(new) != 1:
        return result, None
    try:
        new[0]._init_handles()
        return result, [new[0].n_regs, new[0].n_spills, new[0].metadata.shared]
    except Exception:  # noqa: BLE001
        return result, None


def sweep(q, sets, mask, plan, hkv, g, p) -> list:
    """Each pass alone over launch choices: [pass, config, us, [registers, spills, shared bytes] of the variant the
    row built (None when it built none or several)]; the combine rows: [pass, config, us, rel. difference]."""
    from hf_cascade.ops import _prefix_kernel, _suffix_kernel

    rows = []
    b = q.shape[0]
    m_total = b * g

    def time_us(calls):
        return round(graph_time(calls, repeat=10)["ms"] * 1e3, 2)

    for bn, w, st in [(16, 1, 2), (16, 2, 2), (32, 1, 2), (32, 2, 2), (32, 4, 2), (32, 2, 3), (32, 4, 3), (64, 2, 2),
                      (64, 4, 2), (64, 4, 3), (64, 4, 1), (128, 4, 1), (128, 4, 2), (128, 8, 2), (32, 1, 4)]:
        try:
            t, built = _built_during(_suffix_kernel._suffix_fwd_kernel, lambda bn=bn, w=w, st=st: time_us(
                [lambda t=t: launch_suffix(q, t[2], t[3], scale=D**-0.5, mask=mask, causal=False, softcap=None,
                                           states=None, block_m=16, block_n=bn, num_warps=w, num_stages=st)
                 for t in sets]))
        except Exception as err:  # noqa: BLE001
            t, built = repr(err)[:80], None
        rows.append(["suffix", f"m16 n{bn} w{w} st{st}", t, built])
        print(rows[-1], flush=True)
    for bm, bn, w, st, ns in [(64, 64, 4, 3, 8), (64, 32, 4, 3, 8), (64, 32, 4, 2, 8), (64, 64, 4, 2, 8),
                              (64, 32, 4, 3, 16), (128, 64, 8, 3, 16), (128, 32, 8, 3, 16), (128, 64, 8, 2, 16),
                              (128, 32, 4, 2, 16), (128, 64, 4, 2, 16), (32, 64, 4, 2, 16), (32, 32, 2, 2, 16),
                              (128, 128, 8, 2, 16), (128, 64, 8, 3, 32), (64, 64, 4, 3, 32)]:
        sch = plan.schedule(g, bm)
        po = torch.empty((ns, hkv, m_total, D), dtype=torch.float32, device="cuda")
        pl = torch.empty((ns, hkv, m_total), dtype=torch.float32, device="cuda")
        os_, ls_ = partial_strides(po, pl, 1, g, D)
        cfg = (sch, ns, bm, bn, w, st)
        try:
            t, built = _built_during(_prefix_kernel._prefix_fwd_kernel, lambda cfg=cfg, po=po, pl=pl, os_=os_,
                                     ls_=ls_: time_us([lambda t=t: launch_prefix(
                                         q, t[0], t[1], None, cfg, po, pl, os_, ls_, 0, scale=D**-0.5, softcap=None)
                                         for t in sets]))
        except Exception as err:  # noqa: BLE001
            t, built = repr(err)[:80], None
        rows.append(["prefix", f"m{bm} n{bn} w{w} st{st} splits{ns}", t, built])
        print(rows[-1], flush=True)
    slots = 9  # 8 KV splits + the suffix, as the step's combine merges
    po = torch.randn((slots, hkv, m_total, D), dtype=torch.float32, device="cuda")
    pl = torch.randn((slots, hkv, m_total), dtype=torch.float32, device="cuda")
    out = torch.empty((b, 1, q.shape[1], D), dtype=q.dtype, device="cuda").transpose(1, 2)
    lse = torch.empty((b, q.shape[1], 1), dtype=torch.float32, device="cuda")
    launch_combine(out, lse, po, pl, g)
    ref = out.float().clone()
    for bm, sps, w in [(None, None, None), (16, 4, 4), (16, 8, 4), (8, 2, 4), (8, 4, 4), (8, 8, 4), (4, 4, 2),
                       (4, 8, 2), (4, 8, 4), (2, 8, 1), (2, 8, 2), (8, 8, 2), (4, 16, 2)]:
        call = lambda bm=bm, sps=sps, w=w: launch_combine(out, lse, po, pl, g, block_m=bm,  # noqa: E731
                                                           slots_per_step=sps, num_warps=w)
        try:
            call()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            t = time_us([call])
        except Exception as e:  # noqa: BLE001
            t, err = repr(e)[:80], None
        rows.append(["combine", f"m{bm} slots/step{sps} w{w}" if bm else "heuristic", t, err])
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
