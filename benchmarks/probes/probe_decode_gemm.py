"""The decode step's GEMMs at the shared workload's batch (GPU): cuBLAS as the model runs them vs inductor's
autotuned choice, per Llama-3-8B projection shape. x [M, K] @ W[N, K]^T in bf16, weights cycled over enough copies
that they do not sit in L2; us per call from CUDA-graph replays, and TB/s of weight bytes read.

    python benchmarks/probes/probe_decode_gemm.py --rows 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_kernels import graph_time  # noqa: E402
from common import ResultWriter  # noqa: E402

SHAPES = {"q_proj / o_proj": (4096, 4096), "k_proj / v_proj": (1024, 4096), "gate / up": (14336, 4096),
          "down": (4096, 14336), "qkv (fused)": (6144, 4096), "gate+up (fused)": (28672, 4096)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("probe_decode_gemm.jsonl", args.output)
    import torch._inductor.config as inductor_config

    results = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(200e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        row = {}
        row["cublas"] = graph_time([lambda w=w: F.linear(x, w) for w in ws], repeat=10)["ms"]
        for lib in ("cublaslt",):
            try:
                torch.backends.cuda.preferred_blas_library(lib)
                row[lib] = graph_time([lambda w=w: F.linear(x, w) for w in ws], repeat=10)["ms"]
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
        torch._dynamo.reset()
        with inductor_config.patch(max_autotune_gemm=True, max_autotune_gemm_backends="ATEN,TRITON"):
            fn = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
            t0 = time.perf_counter()
            fn(x, ws[0])
            torch.cuda.synchronize()
            row["autotune_compile_s"] = time.perf_counter() - t0
            row["inductor_autotuned"] = graph_time([lambda w=w: fn(x, w) for w in ws], repeat=10)["ms"]
        for key in ("cublas", "cublaslt", "inductor_autotuned"):
            row[key + "_TBps"] = n * k * 2 / (row[key] * 1e-3) / 1e12
        results[name] = {kk: round(v, 4) for kk, v in row.items()}
        print(name, results[name], flush=True)
    record = {"bench": "probe_decode_gemm", "rows": args.rows, "ms": results}
    writer.write(record)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
