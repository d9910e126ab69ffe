"""GPU benchmark of shared-prefix scoring (issue 37): ``hf_cascade.score`` vs batched sdpa forwards.

Workload (the issue's): a Llama-3-8B-shaped random bf16 model; ``--questions`` questions sharing a ``--block``-token
few-shot block, each with its own ``--question``-token text and ``--choices`` choices of ``--choice-tokens`` tokens.
Peers, on the same model:

* ``sdpa_batched``: one forward per batch of ``--sdpa-batch`` pairs (context + choice but its last token), left
  padded, attention sdpa, the LM head on the choice positions only (``logits_to_keep``: a stronger peer than
  lm-eval's ``hf``, which computes every position's logits), log-softmax in float32;
* ``hf_cascade_score``: :func:`hf_cascade.score` (``--max-batch-tokens``).

Every timed run is checked: the chosen answer of each question (argmax over its choices) and the max |difference| of
the log-probabilities between the peers (bf16: not bitwise). bf16 agreement (``--agreement-questions``, the first
questions only): the same pairs scored by sdpa, eager attention and hf_cascade in bf16, and by sdpa with the model
in float32 (the reference); each bf16 peer's |error| against it (the bar: hf_cascade no further than eager).
``--sweep-min-shared`` times the scorer with other ``min_shared_tokens`` (which segments become shared levels). Reports seconds (synchronised wall time, after one
warm-up run of each), tokens through the model, and peak memory; JSON lines to results/scoring_gpu.jsonl.

    python benchmarks/bench_scoring_gpu.py                       # the issue's point (H100, 32 layers)
    python benchmarks/bench_scoring_gpu.py --layers 4 --questions 64   # a quick look
    python benchmarks/bench_scoring_gpu.py --tiny --device cpu --questions 8 --block 64 --question 16  # smoke test
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ResultWriter  # noqa: E402

import hf_cascade  # noqa: E402


def build_model(layers: int, device: str, tiny: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tiny:
        from hf_cascade.model_zoo import tiny_model

        return tiny_model("llama", "cascade", device=device, vocab_size=1024, max_position_embeddings=8192)
    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,  # 32 in Llama-3-8B
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=torch.bfloat16)
    return model.eval()


def make_pairs(args, vocab: int):
    """``(contexts, continuations)``: [block][question q] x each of its choices."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    block = [1] + rand(args.block - 1)
    contexts, continuations = [], []
    for _ in range(args.questions):
        context = block + rand(args.question)
        for _ in range(args.choices):
            contexts.append(context)
            continuations.append(rand(args.choice_tokens))
    return contexts, continuations


@torch.no_grad()
def sdpa_batched(model, contexts, continuations, batch: int) -> torch.Tensor:
    """``[N]`` float64 summed log-probs, one left-padded sdpa forward per ``batch`` pairs (equal-length choices)."""
    out = []
    keep = len(continuations[0])
    for lo in range(0, len(contexts), batch):
        rows = [c + x[:-1] for c, x in zip(contexts[lo:lo + batch], continuations[lo:lo + batch])]
        width = max(map(len, rows))
        ids = torch.zeros((len(rows), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                       logits_to_keep=keep).logits.float()
        targets = torch.tensor(continuations[lo:lo + batch], device=logits.device)
        lps = F.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        out.append(lps.double().sum(-1).cpu())
        del logits, lps
    return torch.cat(out)


def timed(fn, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return seconds, peak, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--question", type=int, default=128)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--choice-tokens", type=int, default=16)
    parser.add_argument("--sdpa-batch", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model (a smoke test of the script)")
    parser.add_argument("--agreement-questions", type=int, default=32,
                        help="questions scored by every peer in bf16 and by sdpa in float32 (0: none)")
    parser.add_argument("--sweep-min-shared", type=int, nargs="*", default=[],
                        help="also time hf_cascade.score with these min_shared_tokens")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    model = build_model(args.layers, args.device, args.tiny)
    contexts, continuations = make_pairs(args, model.config.vocab_size)
    options = {} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}

    def cascade():
        return hf_cascade.score(model, contexts, continuations, progress=False, **options)

    def sdpa():
        model.set_attn_implementation("sdpa")
        try:
            return sdpa_batched(model, contexts, continuations, args.sdpa_batch)
        finally:
            model.set_attn_implementation("cascade")

    cascade(), sdpa()  # warm-up (kernels built, allocator warm)
    cascade_s, cascade_peak, out = timed(cascade, args.device)
    sdpa_s, sdpa_peak, ref = timed(sdpa, args.device)
    picks = out.logprobs.view(args.questions, args.choices).argmax(-1)
    ref_picks = ref.view(args.questions, args.choices).argmax(-1)
    record = {
        "bench": "scoring_gpu", "layers": args.layers, "tiny": args.tiny, "device": args.device,
        "questions": args.questions, "block": args.block, "question": args.question, "choices": args.choices,
        "choice_tokens": args.choice_tokens, "sdpa_batch": args.sdpa_batch,
        "max_batch_tokens": args.max_batch_tokens or hf_cascade.scoring.DEFAULT_MAX_BATCH_TOKENS,
        "hf_cascade_s": round(cascade_s, 3), "sdpa_batched_s": round(sdpa_s, 3), "speedup": round(sdpa_s / cascade_s, 2),
        "hf_cascade_peak_gib": cascade_peak, "sdpa_batched_peak_gib": sdpa_peak,
        "tokens_run": out.stats["tokens_run"], "tokens_unshared": out.stats["tokens_unshared"],
        "forwards": out.stats["forwards"], "same_picks": float((picks == ref_picks).float().mean()),
        "max_abs_logprob_diff": float((out.logprobs - ref).abs().max()),
    }
    sweep = {}
    for value in args.sweep_min_shared:
        seconds, peak, swept = timed(lambda: hf_cascade.score(model, contexts, continuations, progress=False,
                                                              min_shared_tokens=value, **options), args.device)
        sweep[str(value)] = {"seconds": round(seconds, 3), "peak_gib": peak, "forwards": swept.stats["forwards"],
                             "tokens_run": swept.stats["tokens_run"],
                             "max_abs_diff_vs_default": float((swept.logprobs - out.logprobs).abs().max())}
    record["min_shared_sweep"] = sweep or None
    if args.agreement_questions:
        record["bf16_agreement"] = agreement(model, contexts, continuations, args, options)
    ResultWriter("scoring_gpu.jsonl", args.output).write(record)
    print({k: record[k] for k in ("hf_cascade_s", "sdpa_batched_s", "speedup", "hf_cascade_peak_gib",
                                  "sdpa_batched_peak_gib", "same_picks", "max_abs_logprob_diff", "min_shared_sweep",
                                  "bf16_agreement") if k in record})
    return 0


def agreement(model, contexts, continuations, args, options) -> dict:
    """The first ``--agreement-questions`` questions scored by sdpa, eager and hf_cascade in the model's dtype, and
    by sdpa in float32 (the model cast up and back: bf16 -> fp32 -> bf16 is exact). Per peer: max and mean |error|
    against float32, and the share of questions whose pick matches float32's."""
    n = min(args.agreement_questions, args.questions) * args.choices
    ctx, cont = contexts[:n], continuations[:n]

    def attention(name):
        model.set_attn_implementation(name)
        try:
            return sdpa_batched(model, ctx, cont, args.sdpa_batch)
        finally:
            model.set_attn_implementation("cascade")

    got = {"sdpa": attention("sdpa"), "eager": attention("eager"),
           "hf_cascade": hf_cascade.score(model, ctx, cont, progress=False, **options).logprobs}
    dtype = model.dtype
    model.float()
    try:
        ref = attention("sdpa")
    finally:
        model.to(dtype)
    picks = ref.view(-1, args.choices).argmax(-1)
    report = {"questions": n // args.choices, "reference": "sdpa, float32"}
    for name, value in got.items():
        error = (value - ref).abs()
        report[name] = {"max_abs_err": round(float(error.max()), 4), "mean_abs_err": round(float(error.mean()), 5),
                        "same_picks_as_fp32": float((value.view(-1, args.choices).argmax(-1) == picks).float().mean())}
    return report


if __name__ == "__main__":
    sys.exit(main())
