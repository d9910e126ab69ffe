"""Probe (issue 51, the first tier of TRL's rollouts): one variable-length FlashAttention-2 call per prefix level
against the built-in tier's call per node (:func:`hf_cascade.ops.builtin_cascade._prefix_level`).

Why. On the built-in tier (a process's first calls) each node of a prefix level is its own flash call, plus the
copies around it; the `e734fe7` profile of a TRL rollout's first-tier call put flash-decoding and its combines at
0.54 s of 3.24 s GPU-busy, and the planner folds short prompts into their rows there for that reason
(``CascadeCostModel(builtin=True)``). PyTorch's ``aten._flash_attention_forward`` takes packed sequences with
cumulative offsets (varlen): all nodes of a level in one launch, the rows' queries grouped by node, the level's keys
as they lie (nodes are consecutive key spans). Not in the product until this probe says it is exact and faster.

What it checks and times (bf16, CUDA, decode: one query per row; Qwen2.5-1.5B heads by default, Hq=12, Hkv=2,
D=128): for each level layout, out and LSE of the varlen call against the per-node path (max abs difference; LSE
layout reported: ``[Hq, total_q]`` or padded ``[N, Hq, max_q]``), and the microseconds of one level per layer,
eager (CUDA events) and replayed from CUDA graphs of ``--layers`` levels (a decode step's worth; ``bench_kernels.graph_time``). Writes one JSON line per layout
(with the GPU, versions and git SHA: ``common.ResultWriter``) to ``benchmarks/results/probe_builtin_varlen.jsonl``.

    python benchmarks/probes/probe_builtin_varlen.py            # one GPU, ~1 min
"""

from __future__ import annotations

import argparse
import json

import preamble  # noqa: F401  (the repository root and benchmarks/ on sys.path)
import torch

from bench_kernels import graph_time  # noqa: E402
from common import ResultWriter, cuda_time  # noqa: E402
from hf_cascade.ops.builtin_cascade import _prefix_level  # noqa: E402
from hf_cascade.ops.plan import plan_shared_prefix  # noqa: E402

# (name, nodes, rows per node, keys per node): TRL's system prompt shared by all 128 rows; its 16 prompts of ~190
# tokens shared by their 8 samples each (what the Triton tier shares); a deeper tree's many small nodes.
LAYOUTS = [("system prompt", 1, 128, 128), ("16 prompts x 8 samples", 16, 8, 190), ("64 nodes x 2 rows", 64, 2, 96)]


def varlen_level(query, k_pre, v_pre, order, inverse, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """One level by one varlen flash call. ``query [B, Hq, 1, D]``; ``k_pre, v_pre [Hkv, T, D]``; ``order``: the rows
    sorted by node (int64 [B], device), ``inverse`` its inverse permutation. Returns ``(out [B, Hq, 1, D] fp32,
    lse [B, Hq, 1] fp32, lse layout)``."""
    B, Hq, Lq, D = query.shape
    q = query.index_select(0, order).reshape(B * Lq, Hq, D)
    k, v = k_pre.transpose(0, 1), v_pre.transpose(0, 1)  # [T, Hkv, D] views: last dim contiguous
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                       scale=scale)[:2]
    if lse.dim() == 2:  # [Hq, total_q]
        layout, lse = "[Hq, total_q]", lse.transpose(0, 1)
    else:  # [N, Hq, max_q], padded: row r of node n at [n, :, r - cu_q[n]]
        layout = "[N, Hq, max_q]"
        node = torch.repeat_interleave(torch.arange(cu_q.numel() - 1, device=q.device), cu_q.diff())
        lse = lse[node, :, torch.arange(B, device=q.device) - cu_q[node]]
    out = out.reshape(B, Lq, Hq, D).index_select(0, inverse).transpose(1, 2).float()
    return out, lse.index_select(0, inverse).reshape(B, Hq, Lq).float(), layout


def probe(name: str, nodes: int, rows: int, keys: int, args) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T = nodes * rows, nodes * keys
    row_node = torch.arange(B) % nodes  # rows interleaved (a sampling batch's order), not grouped by node
    starts = torch.arange(nodes + 1) * keys
    plan = plan_shared_prefix(row_node, starts, device=device)
    query = torch.randn(B, args.hq, 1, args.d, generator=g).to(device, dtype)
    k_pre = torch.randn(args.hkv, T, args.d, generator=g).to(device, dtype)
    v_pre = torch.randn(args.hkv, T, args.d, generator=g).to(device, dtype)
    scale = args.d ** -0.5
    order = torch.argsort(row_node, stable=True).to(device)
    inverse = torch.argsort(order)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), torch.bincount(row_node, minlength=nodes).cumsum(0)
                      .to(torch.int32)]).to(device)
    cu_k = starts.to(torch.int32).to(device)
    record = {"bench": "probe_builtin_varlen", "layout": name, "nodes": nodes, "rows": B, "keys_per_node": keys,
              "hq": args.hq, "hkv": args.hkv, "d": args.d}
    want_out, want_lse = _prefix_level(query, k_pre, v_pre, plan, scale, None)
    try:
        got_out, got_lse, layout = varlen_level(query, k_pre, v_pre, order, inverse, cu_q, cu_k, rows, keys, scale)
    except Exception as err:  # noqa: BLE001 (the probe reports what this torch's op refuses)
        return {**record, "status": f"varlen failed: {type(err).__name__}: {str(err)[:300]}"}
    record.update(lse_layout=layout, max_abs_out=(got_out - want_out).abs().max().item(),
                  max_abs_lse=(got_lse - want_lse).abs().max().item())
    per_node = lambda: _prefix_level(query, k_pre, v_pre, plan, scale, None)  # noqa: E731
    varlen = lambda: varlen_level(query, k_pre, v_pre, order, inverse, cu_q, cu_k, rows, keys, scale)  # noqa: E731
    for label, fn in (("per_node", per_node), ("varlen", varlen)):
        record[f"{label}_eager_us"] = round(cuda_time(fn)["ms"] * 1e3, 1)
        try:  # replayed from CUDA graphs of at least a decode step's worth of levels
            record[f"{label}_graph_us"] = round(graph_time([fn] * args.layers)["ms"] * 1e3, 1)
        except Exception as err:  # noqa: BLE001 (an op a CUDA graph cannot record: reported)
            record[f"{label}_graph_us"] = f"{type(err).__name__}: {str(err)[:200]}"
    record["status"] = "ok"
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hq", type=int, default=12)
    parser.add_argument("--hkv", type=int, default=2)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28, help="levels per recorded graph (a decode step's layers)")
    parser.add_argument("--output", default=None, help="results file (default benchmarks/results/"
                        "probe_builtin_varlen.jsonl)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_builtin_varlen.py needs a CUDA GPU (FlashAttention-2's varlen op is CUDA-only).")
    writer = ResultWriter("probe_builtin_varlen.jsonl", args.output)
    for layout in LAYOUTS:
        record = probe(*layout, args)
        print(json.dumps(record), flush=True)
        writer.write(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
