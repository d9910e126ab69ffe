"""One decode step of attention: cascade kernels vs SDPA over per-row (replicated) KV, on the GPU.

For each (heads, B, P, S): every row has one new query token, a P-token prefix shared by all rows and its own
S-token suffix. Cascade = shared-prefix pass (prefix stored once) + suffix pass with the merge fused. The peer is
``torch.nn.functional.scaled_dot_product_attention`` on KV replicated per row ``[B, Hkv, P + S, D]`` (what
transformers' sdpa path reads). Each point is checked against an fp32 reference before it is timed.

Reported: median ms (p20/p80), achieved GB/s on *unique* bytes (prefix once + suffixes + q + out), that as a % of
the device-to-device copy bandwidth measured in the same run, and the speedup over SDPA.

    python benchmarks/bench_kernels.py               # the issue's grid
    python benchmarks/bench_kernels.py --quick       # a few points
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ResultWriter, copy_bandwidth_gbs, cuda_graph_time, cuda_time  # noqa: E402

from hf_cascade.ops.prefix_attention import plan_shared_prefix, shared_prefix_attention  # noqa: E402
from hf_cascade.ops.suffix_attention import suffix_attention  # noqa: E402

D = 128
DTYPE = torch.bfloat16


def unique_bytes(b, hq, hkv, p, s):
    e = 2  # bf16
    return 2 * hkv * D * e * (p + b * s) + 2 * b * hq * D * e  # K+V once each, q in, out


def replicated_bytes(b, hq, hkv, p, s):
    return 2 * hkv * D * 2 * b * (p + s) + 2 * b * hq * D * 2


def setup(b, hq, hkv, p, s):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + p + s)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=DTYPE, generator=g)  # noqa: E731
    q = rnd(b, hq, 1, D)
    kp, vp = rnd(hkv, p, D), rnd(hkv, p, D)
    ks, vs = rnd(b, hkv, s, D), rnd(b, hkv, s, D)
    return q, kp, vp, ks, vs


def cascade_step(q, kp, vp, ks, vs, plan):
    scale = D**-0.5
    po, pl = shared_prefix_attention(q, kp, vp, plan.rows, plan.node_starts_dev, scale=scale, plan=plan)
    out, _ = suffix_attention(q, ks, vs, scale=scale, causal=False, prefix_out=po, prefix_lse=pl)
    return out


def reference(q, kp, vp, ks, vs, rows=4):
    """fp32 attention of the first ``rows`` rows over [prefix | suffix] (float64 softmax)."""
    b = min(rows, q.shape[0])
    g = q.shape[1] // kp.shape[0]
    k = torch.cat([kp.expand(b, -1, -1, -1), ks[:b]], dim=2).double().repeat_interleave(g, dim=1)
    v = torch.cat([vp.expand(b, -1, -1, -1), vs[:b]], dim=2).double().repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q[:b].double(), k, v, scale=D**-0.5).float()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--suffixes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--heads", nargs="+", default=["32/8", "32/32"], help="q_heads/kv_heads")
    parser.add_argument("--quick", action="store_true", help="B in {8, 64}, P in {4K, 16K}, S=256, GQA only")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.prefixes, args.suffixes, args.heads = [8, 64], [4096, 16384], [256], ["32/8"]
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU.")

    writer = ResultWriter("kernels.jsonl", args.output)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s", flush=True)
    writer.write({"bench": "copy_bandwidth", "gbs": copy_gbs})
    free_bytes = torch.cuda.mem_get_info()[0]
    header = f"{'H':>6} {'B':>4} {'P':>6} {'S':>5} {'eager ms':>8} {'cascade ms':>10} {'GB/s':>6} {'%copy':>6} {'sdpa ms':>8} {'speedup':>7} {'err':>8}"
    print(header, flush=True)
    for heads, b, p, s in itertools.product(args.heads, args.batches, args.prefixes, args.suffixes):
        hq, hkv = (int(x) for x in heads.split("/"))
        q, kp, vp, ks, vs = setup(b, hq, hkv, p, s)
        plan = plan_shared_prefix(torch.zeros(b, dtype=torch.int64), torch.tensor([0, p]), device=q.device)
        # verify
        out = cascade_step(q, kp, vp, ks, vs, plan)
        ref = reference(q, kp, vp, ks, vs)
        err = ((out[: ref.shape[0]].float() - ref).norm() / ref.norm()).item()
        bf16_err = ((ref.to(DTYPE).float() - ref).norm() / ref.norm()).item()
        record = dict(bench="decode_step", heads=heads, batch=b, prefix=p, suffix=s, head_dim=D, dtype="bf16")
        record.update(rel_err=err, rel_err_bf16_rounding=bf16_err, check_ok=err <= 2 * bf16_err + 1e-3)
        eager = cuda_time(lambda: cascade_step(q, kp, vp, ks, vs, plan), repeat=args.repeat)
        record.update({f"cascade_eager_{k}": v for k, v in eager.items()})
        # Device time from CUDA-graph replays: in a decode step the launches overlap earlier layers' work.
        t = cuda_graph_time(lambda: cascade_step(q, kp, vp, ks, vs, plan), repeat=args.repeat)
        record.update({f"cascade_{k}": v for k, v in t.items()})
        ub = unique_bytes(b, hq, hkv, p, s)
        record["unique_gbs"] = ub / (t["ms"] * 1e-3) / 1e9
        record["pct_of_copy"] = 100 * record["unique_gbs"] / copy_gbs
        record["unique_roofline_ms"] = ub / (copy_gbs * 1e9) * 1e3
        # peer: SDPA over per-row KV (skipped when it would not fit comfortably)
        if replicated_bytes(b, hq, hkv, p, s) < 0.6 * free_bytes:
            k = torch.cat([kp.expand(b, -1, -1, -1), ks], dim=2)
            v = torch.cat([vp.expand(b, -1, -1, -1), vs], dim=2)
            sd = cuda_graph_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv), repeat=args.repeat)
            record.update({f"sdpa_{k_}": v_ for k_, v_ in sd.items()})
            record["speedup_vs_sdpa"] = sd["ms"] / t["ms"]
            del k, v
        else:
            record["sdpa_status"] = "skipped: replicated KV would not fit"
        writer.write(record)
        sd_ms = record.get("sdpa_ms")
        sd_txt = f"{sd_ms:.4f}" if sd_ms else "-"
        speedup_txt = f"{record['speedup_vs_sdpa']:.1f}x" if sd_ms else "-"
        print(
            f"{heads:>6} {b:>4} {p:>6} {s:>5} {eager['ms']:>8.4f} {t['ms']:>10.4f} {record['unique_gbs']:>6.0f} {record['pct_of_copy']:>6.1f} "
            f"{sd_txt:>8} {speedup_txt:>7} "
            f"{err:>8.1e}{'' if record['check_ok'] else ' FAIL'}",
            flush=True,
        )
        del q, kp, vp, ks, vs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
