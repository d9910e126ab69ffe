"""Probe (issue 32): one decode step's cascade attention for one layer on kernels that need no compilation
(PyTorch's own FlashAttention-2 and matmuls) against hf_cascade's Triton op, each recorded into a CUDA graph.

Llama-3-8B shape (GQA 32/8, d=128, bf16), B rows sharing one P-token node, S suffix columns each.
Records ``builtin_attention_probe`` in ``benchmarks/results/probe_builtin_attention.jsonl``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ResultWriter  # noqa: E402

from hf_cascade.ops.cascade_attention import cascade_attention  # noqa: E402
from hf_cascade.ops.prefix_attention import plan_shared_prefix  # noqa: E402


def graph_ms(fn, replays: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main():
    writer = ResultWriter("probe_builtin_attention.jsonl")
    dev = "cuda"
    Hq, Hkv, D = 32, 8, 128
    G = Hq // Hkv
    for B, P, S, Lq in ((32, 4096, 128, 1), (64, 16384, 256, 1), (8, 1024, 128, 1), (32, 4096, 128, 64)):
        torch.manual_seed(0)
        q = torch.randn(B, Lq, Hq, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k_pre = torch.randn(Hkv, P, D, device=dev, dtype=torch.bfloat16)
        v_pre = torch.randn(Hkv, P, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        mask = torch.ones(B, Lq, S, dtype=torch.bool, device=dev)
        mask[:, :, S * 3 // 4:] = False
        plan = plan_shared_prefix(torch.zeros(B, dtype=torch.int64), torch.tensor([0, P]), device=dev)
        scale = D ** -0.5

        def triton():
            return cascade_attention(q, k, v, [(k_pre, v_pre, plan)], scale=scale, mask=mask, causal=True)

        def flash_prefix():
            # rows as the query sequence of one batch entry: [1, Hq, B*Lq, D] against [1, Hkv, P, D]
            qq = q.permute(1, 0, 2, 3).reshape(1, Hq, B * Lq, D)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qq, k_pre[None], v_pre[None], 0.0, False, False, scale=scale)[:2]
            return out, lse

        def suffix_math():
            qf = q.float().reshape(B, Hkv, G * Lq, D)
            s = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*Lq, S]
            s = s.view(B, Hkv, G, Lq, S).masked_fill(~mask[:, None, None], float("-inf")).view(B, Hkv, G * Lq, S)
            lse = torch.logsumexp(s, -1)
            o = torch.matmul(torch.exp(s - lse[..., None]), v.float())
            return o, lse

        def builtin():
            po, pl = flash_prefix()
            po = po.view(Hq, B, Lq, D).permute(1, 0, 2, 3).float()
            pl = pl.view(Hq, B, Lq).permute(1, 0, 2)
            so, sl = suffix_math()
            so, sl = so.view(B, Hq, Lq, D), sl.view(B, Hq, Lq)
            m = torch.maximum(pl, sl)
            wp, ws = torch.exp(pl - m), torch.exp(sl - m)
            return ((po * wp[..., None] + so * ws[..., None]) / (wp + ws)[..., None]).to(q.dtype)

        def prefix_math():
            qf = q.float().reshape(B, Hkv, G * Lq, D).transpose(0, 1).reshape(Hkv, B * G * Lq, D)
            s = torch.matmul(qf, k_pre.float().transpose(-1, -2)) * scale
            lse = torch.logsumexp(s, -1)
            return torch.matmul(torch.exp(s - lse[..., None]), v_pre.float()), lse

        ref = triton()[0].float()
        err = (builtin().float() - ref).abs().max().item()
        record = {"bench": "builtin_attention_probe", "B": B, "P": P, "S": S, "Lq": Lq, "max_abs_diff_vs_triton": err}
        for name, fn in (("triton_ms", triton), ("flash_prefix_ms", flash_prefix), ("suffix_math_ms", suffix_math),
                         ("builtin_ms", builtin), ("prefix_math_fp32_ms", prefix_math)):
            try:
                record[name] = round(graph_ms(fn), 4)
            except Exception as e:  # noqa: BLE001
                record[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
        writer.write(record)
        print(record, flush=True)


if __name__ == "__main__":
    main()
