"""Where a TRL GRPO rollout's time goes on hf_cascade's route (issue 51: the target is 3x TRL's default path).

    python benchmarks/probes/probe_trl_step.py --out /tmp/trl_profile

The rollout of ``benchmarks/trl_rollout.py`` (Qwen2.5-1.5B shape, bf16, 16 prompts x 8 generations x 256 new tokens,
TRL's generation config: sampling, ``disable_compile=True``): two warm calls, then one under ``torch.profiler``.
Prints (and appends to ``<out>/trl_profile.jsonl``) the call's wall time, the GPU's busy time (kernels and copies),
the CUDA-graph replays, and the ops that take the most host time and the most GPU time.

``--cascade-options '{"max_levels": 1}'`` runs the same rollout with the prompts' own tokens in the rows' suffixes
(only the system prompt shared): whether sharing each prompt's ~250 tokens across its 8 rows pays on the first tier,
where every node is one more attention call per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import preamble  # noqa: F401  (the repository root and benchmarks/ on sys.path)
import torch

import trl_rollout as trl


def _rows(averages, key: str, n: int = 14) -> list[dict]:
    ranked = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [dict(op=e.key[:80], calls=e.count, host_ms=round(e.cpu_time_total / 1e3, 2),
                 gpu_ms=round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3, 2))
            for e in ranked]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/trl_profile")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--cascade-options", default=None, help="JSON: hf_cascade options of the rollouts (a probe's A/B)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_trl_step: needs a CUDA GPU.")
        return 0
    os.makedirs(args.out, exist_ok=True)
    model = trl.build_model(device="cuda")
    prompt_ids = [q for q in trl.make_prompts("qwen2.5-1.5b") for _ in range(8)]
    config = trl.trl_generation_config("qwen2.5-1.5b", args.new_tokens)
    options = json.loads(args.cascade_options) if args.cascade_options else None
    warm = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trl.rollout_cascade(model, prompt_ids, config, cascade_options=options)
        torch.cuda.synchronize()
        warm.append(time.perf_counter() - start)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        trl.rollout_cascade(model, prompt_ids, config, cascade_options=options)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.events()
    device_us = sum(e.device_time for e in events
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    averages = prof.key_averages()
    record = dict(probe="trl_step", cascade_options=options, warm_calls_s=[round(s, 3) for s in warm],
                  profiled_call_s=round(wall, 3),
                  gpu_busy_s=round(device_us / 1e6, 3), graph_replays=sum(e.count for e in averages
                                                                          if "cudaGraphLaunch" in e.key),
                  top_host=_rows(averages, "cpu_time_total"),
                  top_gpu=_rows(averages, "device_time_total" if hasattr(averages[0], "device_time_total")
                                else "cuda_time_total"))
    print(json.dumps(record, indent=1))
    with open(os.path.join(args.out, "trl_profile.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
