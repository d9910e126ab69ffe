"""Is cascade's bf16 difference from sdpa ordinary bf16 noise? Compare it with sdpa vs eager (both transformers').

Llama-3-8B-shaped random bf16 model, rows sharing a P-token prompt: first-step logits and greedy tokens of
sdpa, eager and cascade. If |cascade - sdpa| is of the order of |eager - sdpa|, the difference is rounding, not a bug
(exactness itself is tested in fp32, where cascade's tokens are identical).

    python benchmarks/probes/bf16_noise.py --batch 4 --prefix 4096
"""

from __future__ import annotations

import argparse

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args  # noqa: E402

import hf_cascade  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_workload_args(parser, batch=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("bf16_noise.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
               return_dict_in_generate=True, min_new_tokens=args.new_tokens)
    results = {}
    for impl in ("sdpa", "eager", "cascade"):
        model.set_attn_implementation(impl)
        inputs = dict(input_ids=ids, attention_mask=mask)
        if impl == "cascade":
            inputs = hf_cascade.shared_prefix_inputs(model, ids, mask, cost_model=None)
        out = model.generate(**inputs, **gen)
        results[impl] = (out.logits[0].float(), out.sequences[:, inputs["input_ids"].shape[1]:])
        torch.cuda.empty_cache()
    ref_logits, ref_tokens = results["sdpa"]
    for impl in ("eager", "cascade"):
        logits, tokens = results[impl]
        record = dict(
            bench="bf16_noise", compare=f"{impl} vs sdpa", batch=args.batch, prefix=args.prefix, layers=args.layers,
            first_logits_max_abs_diff=(logits - ref_logits).abs().max().item(),
            first_logits_scale=ref_logits.abs().max().item(),
            first_logits_cosine_min=torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).min().item(),
            first_token_agreement=(logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            greedy_token_agreement=(tokens == ref_tokens).float().mean().item(),
        )
        writer.write(record)
        print(record, flush=True)


if __name__ == "__main__":
    main()
