"""Probe: what a process's first causal ``scaled_dot_product_attention`` call costs on the GPU, per SDPA backend.

Each case runs in a fresh process: CUDA context and cuBLAS made ready first (a matmul), then one causal bf16 SDPA
call of a shared prompt's prefill shape (``[1, 32, L, 128]`` queries, 8 KV heads, GQA), timed to the end of its
kernels, then a second call; the kernel that ran (profiler) is named. Cases: ``default`` (PyTorch's backend choice),
``flash`` (FlashAttention-2 only), ``no_cudnn`` (every backend but cuDNN's).

    python benchmarks/probes/probe_first_sdpa.py --length 4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import preamble  # noqa: F401  (the repository root and benchmarks/ on sys.path)

from common import ResultWriter, child_result, print_child_result  # noqa: E402

CASES = ("default", "flash", "no_cudnn")


def _child(case: str, length: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    backends = {"default": None, "flash": [SDPBackend.FLASH_ATTENTION],
                "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}[case]

    def call():
        if backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - t) * 1e3, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    return {"case": case, "length": length, "first_ms": times[0], "second_ms": times[1], "third_ms": times[2],
            "kernels": kernels, "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--output", default=None)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        print_child_result(_child(args.child, args.length))
        return
    writer = ResultWriter("probe_first_sdpa.jsonl", args.output)
    for case in CASES:
        done = subprocess.run([sys.executable, __file__, "--child", case, "--length", str(args.length)],
                              capture_output=True, text=True)
        record = {"bench": "probe_first_sdpa",
                  **(child_result(done.stdout) or {"case": case, "error": done.stderr[-800:]})}
        writer.write(record)
        print(json.dumps(record))


if __name__ == "__main__":
    main()
