"""Probe: where does a process's first generate() call go? The layout stream's first batches with hf_cascade's
default path, the first under cProfile: per batch the wall time, Triton builds and loads, torch.compile's phases,
and the functions with the most cumulative time in the first batch. Run it in several processes one after
another on one machine: the first is machine-cold (no kernel cache on disk), the next ones process-cold.

    python benchmarks/probes/probe_first_call.py --batches 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import LAYOUT_STREAM, build_model, make_tree_batch  # noqa: E402
from common import (  # noqa: E402
    ResultWriter, TritonBuilds, timed_with_compile_breakdown, triton_cache_dir, triton_cache_files,
)

import hf_cascade  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    writer = ResultWriter("first_call.jsonl", args.output)
    files_at_start, builds = triton_cache_files(), TritonBuilds()
    model = build_model(args.layers)
    model.set_attn_implementation("cascade")
    build_s = time.perf_counter() - started
    vocab = model.config.vocab_size
    batches = [make_tree_batch(levels, own, 32, vocab, seed) for seed, (levels, own) in enumerate(LAYOUT_STREAM)]
    for index, (ids, mask) in enumerate(batches[: args.batches]):
        before = builds.snapshot()
        profiler = cProfile.Profile() if index == 0 else None

        def call():
            return model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                                  custom_generate=hf_cascade.generate)

        if profiler is not None:
            profiler.enable()
        seconds, compile_s, _ = timed_with_compile_breakdown(call)
        if profiler is not None:
            profiler.disable()
        after = builds.snapshot()
        record = {
            "bench": "first_call_probe", "batch_index": index, "levels": [list(l) for l in LAYOUT_STREAM[index][0]],
            "seconds": round(seconds, 3), "compile_s": compile_s,
            "triton": {k: None if after[k] is None else round(after[k] - before[k], 3) for k in after},
            "triton_cache_files_at_start": files_at_start, "model_build_s": round(build_s, 1),
            "triton_cache_dir": triton_cache_dir(),
        }
        if profiler is not None:
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out)
            for order in ("cumulative", "tottime"):
                out.seek(0)
                out.truncate()
                stats.sort_stats(order).print_stats(args.top)
                record[f"top_{order}"] = [line.strip() for line in out.getvalue().splitlines()
                                          if line.strip() and line.strip()[0].isdigit()][: args.top]
        writer.write(record)
        print({k: v for k, v in record.items() if not k.startswith("top_")}, flush=True)
        for order in ("cumulative", "tottime"):
            for line in record.get(f"top_{order}", []):
                print("   ", order, line[:220])
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
