"""Where the time of a shared-prefix generate() goes before decoding: planning, node prefill, first token.

    python benchmarks/profile_prefill.py --layers 32 --prompt 4096 --samples 32
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_generate import build_model  # noqa: E402
from common import ResultWriter, wall_time  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.inputs import plan_cascade_batch  # noqa: E402
from hf_cascade.prefix_tree import find_shared_prefixes  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args(argv)
    writer = ResultWriter("profile_prefill.jsonl")
    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=g).cuda()
    ids = prompt.repeat_interleave(args.samples, dim=0)
    mask = torch.ones_like(ids)
    record = {"bench": "profile_prefill", "layers": args.layers, "prompt": args.prompt, "samples": args.samples}
    for rep in range(2):  # the first repetition compiles kernels
        record["tree_s"], _ = wall_time(lambda: find_shared_prefixes(ids.tolist()))
        record["plan_s"], (cache, _, _) = wall_time(lambda: plan_cascade_batch(model, ids, mask))
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            record["sdpa_prefill_one_prompt_s"], _ = wall_time(lambda: model.model(prompt))
        model.set_attn_implementation("cascade")
        gen = dict(max_new_tokens=1, do_sample=True, num_return_sequences=args.samples, pad_token_id=0)
        record["generate_first_token_s"], _ = wall_time(
            lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   custom_generate=hf_cascade.generate, **gen)
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            plan_cascade_batch(model, ids, mask)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print(table)
    print(record)
    writer.write(record)


if __name__ == "__main__":
    main()
