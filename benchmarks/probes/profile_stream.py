"""Where each batch of the layout stream spends its time, warm: planning + prefill (a call of one new token) and
decode (ms per step from a full call), per sharing tree, with the default decode step.

    python benchmarks/probes/profile_stream.py     # the 8 trees of bench_generate.py --workload stream, B=32

Records ``stream_breakdown`` in ``benchmarks/results/profile_stream.jsonl``.
"""

from __future__ import annotations

import argparse

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import LAYOUT_STREAM, build_model, make_tree_batch  # noqa: E402
from common import ResultWriter, wall_time  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.decode.captured_step import recorded_steps  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-step", default=None, help="cascade_options decode_step (default: hf_cascade's)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("profile_stream.jsonl", args.output)
    model = build_model(args.layers)
    vocab = model.config.vocab_size
    options = {} if args.decode_step is None else {"decode_step": args.decode_step}

    def call(ids, mask, new, caches=None):
        return wall_time(lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            custom_generate=hf_cascade.generate, cascade_caches=caches, cascade_options=options))[0]

    for seed, (levels, own) in enumerate(LAYOUT_STREAM):
        ids, mask = make_tree_batch(levels, own, 32, vocab, seed)
        caches = []
        call(ids, mask, args.new_tokens, caches)  # warm: kernels built, the step recorded
        before = recorded_steps(model)
        full = sorted(call(ids, mask, args.new_tokens) for _ in range(3))[1]
        one = sorted(call(ids, mask, 1) for _ in range(3))[1]
        after = recorded_steps(model)
        cache = caches[0]
        record = {
            "bench": "stream_breakdown", "layers": args.layers, "batch": 32, "levels": [list(l) for l in levels],
            "own": own, "new_tokens": args.new_tokens, "decode_step": args.decode_step or "default",
            "prefix_tokens": sum(g * t for g, t in levels), "call_s": round(full, 4), "one_token_call_s": round(one, 4),
            "decode_ms_per_step": round((full - one) / (args.new_tokens - 1) * 1e3, 3),
            "planned_levels": cache.num_levels, "max_suffix_length": cache.max_suffix_length,
            "prefix_tree": str(cache.prefix_tree) if getattr(cache, "prefix_tree", None) is not None else None,
            "recorded_during_timed_calls": after["recorded"] - before["recorded"],
        }
        writer.write(record)
        print(record, flush=True)


if __name__ == "__main__":
    main()
