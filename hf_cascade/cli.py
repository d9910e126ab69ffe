"""``python -m hf_cascade`` / ``hf-cascade``: demo, bench and info subcommands. Entry point: :func:`main`."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hf_cascade.model_zoo import FAMILIES

DESCRIPTION = """\
hf_cascade: cascade (shared-prefix) attention inside Hugging Face transformers generate().
Rows that share a prompt prefix (system prompt, few-shot block) prefill and store it once.
"""

EPILOG = """\
examples:
  python -m hf_cascade demo                          # tiny random-init model on CPU, no downloads
  python -m hf_cascade demo --model ./Llama-3.2-1B --device cuda --dtype bfloat16
  python -m hf_cascade info                          # versions, GPU, which kernels would run
  python -m hf_cascade bench --quick                 # GPU benchmarks -> JSON lines + PNG
  python -m hf_cascade bench --plot results.jsonl    # PNG from existing results (no GPU needed)

Run `python -m hf_cascade COMMAND --help` for a command's options.
"""


def _paragraphs(*paragraphs: str, width: int = 88) -> str:
    return "\n\n".join(textwrap.fill(p, width) for p in paragraphs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_cascade",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hf_cascade {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="cascade vs sdpa generate() on prompts sharing a system prompt + few-shot block",
        description=_paragraphs(
            "Build a batch of prompts sharing a system prompt and one of several few-shot blocks, then run greedy "
            "generate() twice on the same weights: with hf_cascade (shared prefixes prefilled and stored once) "
            "and with the stock attention (sdpa; eager for soft-capped models). Prints whether the tokens are "
            "identical, the time and the KV-cache memory of each, and the nested sharing found.",
            "Default: a tiny random-init Llama built in memory (no downloads), fp32 on CPU. Its text is "
            "gibberish; the comparison is what matters.",
        ),
        epilog=(
            "examples:\n"
            "  python -m hf_cascade demo\n"
            "  python -m hf_cascade demo --batch 64 --shots 32 --new-tokens 64\n"
            "  python -m hf_cascade demo --model ./Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--model", metavar="PATH", help="a local checkpoint directory (default: tiny random-init model)")
    demo.add_argument(
        "--family", default="llama", choices=sorted(FAMILIES), help="tiny model family when no --model (default: llama)"
    )
    demo.add_argument("--device", default="auto", help="cpu, cuda, cuda:1... (default: cuda if available, else cpu)")
    demo.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16", "auto"],
        help="weights dtype (default: float32 for the tiny model, the checkpoint's own for --model)",
    )
    demo.add_argument("--batch", type=int, default=16, help="prompts in the batch (default: 16)")
    demo.add_argument("--groups", type=int, default=2, help="different few-shot blocks (default: 2)")
    demo.add_argument("--shots", type=int, default=8, help="examples per few-shot block (default: 8)")
    demo.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per row (default: 32)")
    demo.add_argument("--min-shared-tokens", type=int, default=4, help="shortest shared segment kept (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="seeds the tiny model's weights and the questions")
    demo.add_argument("--show", type=int, default=2, metavar="N", help="print N example completions (default: 2)")
    demo.add_argument("--check", action="store_true", help="exit with status 1 if the tokens are not identical")
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object instead")

    bench = sub.add_parser(
        "bench",
        help="run the GPU benchmark suites (benchmarks/bench_*.py), write JSON lines and a PNG plot",
        description=_paragraphs(
            "Run the benchmark suites of a source checkout on a CUDA GPU: `kernels` (one decode step of attention, "
            "cascade kernels vs SDPA over replicated KV) and `generate` (end-to-end generate(): cascade vs sdpa vs "
            "continuous batching). Results are JSON lines (with GPU name, versions, git SHA); a PNG plots speedup "
            "vs batch per prefix length and memory vs batch.",
            "With --plot, only draw the PNG from existing results (no GPU needed).",
        ),
        epilog=(
            "examples:\n"
            "  python -m hf_cascade bench --quick\n"
            "  python -m hf_cascade bench --suite kernels -- --batches 8 64 --prefixes 4096\n"
            "  python -m hf_cascade bench --plot benchmarks/results/kernels.jsonl benchmarks/results/generate.jsonl"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--suite", choices=["kernels", "generate", "all"], default="all", help="default: all")
    bench.add_argument("--quick", action="store_true", help="a few points per suite (minutes, not an hour)")
    bench.add_argument(
        "--output-dir", default="hf_cascade_bench", help="where results and the PNG go (default: ./hf_cascade_bench)"
    )
    bench.add_argument("--plot", nargs="+", metavar="RESULTS.jsonl", help="only plot these result files")
    bench.add_argument(
        "--png", metavar="PATH", help="PNG path (default: OUTPUT_DIR/bench-TIMESTAMP.png; with --plot: RESULTS.png)"
    )
    bench.add_argument("suite_args", nargs=argparse.REMAINDER, help="after `--`: extra arguments for the suite script")

    info = sub.add_parser(
        "info",
        help="versions, GPU, and which attention backend / kernel path would be used",
        description="Print library versions, the GPU (if any) and which hf_cascade kernel path would run on it.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return {"demo": cmd_demo, "bench": cmd_bench, "info": cmd_info}[args.command](args)
    except ValueError as err:  # bad input: one readable line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------- info
def _version(dist: str = "hf-cascade") -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if dist == "hf-cascade":
            from hf_cascade import __version__

            return __version__
        return None


def collect_info() -> dict:
    """Versions, GPUs and the kernel path hf_cascade would choose (as a dict)."""
    import torch

    import hf_cascade
    from hf_cascade.ops._backend import interpret_mode, resolve_backend, triton_available

    versions = {"hf_cascade": hf_cascade.__version__, "python": platform.python_version(), "torch": torch.__version__}
    for name, dist in [
        ("transformers", "transformers"),
        ("triton", "triton"),
        ("flash_attn", "flash-attn"),
        ("accelerate", "accelerate"),
        ("datasets", "datasets"),
        ("matplotlib", "matplotlib"),
    ]:
        versions[name] = _version(dist)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "compute_capability": f"{props.major}.{props.minor}",
                }
            )
    device = torch.device("cuda" if gpus else "cpu")
    backend = resolve_backend("auto", device, "info")
    if backend == "triton":
        path = f"triton: hf_cascade's Triton kernels on {gpus[0]['name']}"
    elif gpus:
        path = "torch: fp32 PyTorch ops on the GPU (triton is not importable: pip install 'hf-cascade[triton]')"
    else:
        path = "torch: fp32 PyTorch reference ops on the CPU (no CUDA GPU); Triton kernels run on CUDA GPUs"
    from transformers import AttentionInterface

    return {
        "versions": versions,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "attention_registered": "cascade" in AttentionInterface._global_mapping,
        "backend": backend,
        "kernel_path": path,
        "triton_importable": triton_available(),
        "triton_interpret": interpret_mode(),
    }


def cmd_info(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    v = info["versions"]
    missing = "not installed"
    lines = [f"hf_cascade   {v['hf_cascade']}", f"python       {v['python']}"]
    lines.append(f"torch        {v['torch']} (CUDA {info['cuda'] or 'none'})")
    for name in ("transformers", "triton", "flash_attn", "accelerate", "datasets", "matplotlib"):
        lines.append(f"{name:<12} {v[name] or missing}")
    if info["gpus"]:
        for gpu in info["gpus"]:
            lines.append(
                f"GPU {gpu['index']}        {gpu['name']} ({gpu['memory_gib']} GiB, sm_{gpu['compute_capability']})"
            )
    else:
        lines.append("GPU          none (torch.cuda.is_available() is False)")
    registered = "yes" if info["attention_registered"] else "NO"
    lines.append(f"attention    'cascade' registered with transformers: {registered}")
    lines.append(f"kernel path  {info['kernel_path']}")
    if info["triton_interpret"]:
        lines.append("             TRITON_INTERPRET=1: ops forced to backend='triton' run on Triton's CPU interpreter")
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------------------- demo
SYSTEM_PROMPT = (
    "You are a meticulous assistant. Answer every question with a single number and nothing else. "
    "Follow the format of the examples exactly.\n\n"
)
_OPS = [("+", lambda a, b: a + b, "addition"), ("*", lambda a, b: a * b, "multiplication"),
        ("-", lambda a, b: a - b, "subtraction"), ("//", lambda a, b: a // max(b, 1), "integer division")]


def demo_prompts(batch: int, groups: int, shots: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``batch`` prompts ``[system prompt][few-shot block of the row's group][question]`` and each row's group."""
    if batch < 1 or groups < 1 or shots < 0:
        raise ValueError(f"--batch and --groups must be >= 1 and --shots >= 0; got {batch}, {groups}, {shots}.")
    rng = random.Random(seed)
    blocks = []
    for g in range(groups):
        symbol, fn, name = _OPS[g % len(_OPS)]
        lines = [f"Examples ({name}, set {g // len(_OPS) + 1}):"]
        for _ in range(shots):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            lines.append(f"Q: {a} {symbol} {b} = ?\nA: {fn(a, b)}")
        blocks.append("\n".join(lines) + "\n\n")
    prompts, group_of = [], []
    for i in range(batch):
        g = i % groups
        symbol = _OPS[g % len(_OPS)][0]
        prompts.append(SYSTEM_PROMPT + blocks[g] + f"Q: {rng.randint(2, 999)} {symbol} {rng.randint(2, 99)} = ?\nA:")
        group_of.append(g)
    return prompts, group_of


def dynamic_cache_nbytes(cache) -> int:
    """Bytes of KV held by a transformers cache (DynamicCache & co.): every tensor its layers hold."""
    import torch

    if cache is None:
        return 0
    if hasattr(cache, "nbytes") and not hasattr(cache, "layers"):
        return int(cache.nbytes)
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA GPU is visible (torch.cuda.is_available() is False).")
    return device


def _timed(fn, device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def run_demo(
    model_path: str | None = None,
    *,
    family: str = "llama",
    device: str = "auto",
    dtype: str | None = None,
    batch: int = 16,
    groups: int = 2,
    shots: int = 8,
    new_tokens: int = 32,
    min_shared_tokens: int = 4,
    seed: int = 0,
) -> dict:
    """The demo's measurement: cascade vs the stock attention on the same weights (a dict of results)."""
    import torch

    import hf_cascade
    from hf_cascade.tiny import load_model_and_tokenizer, reference_attn_implementation

    device = _resolve_device(device)
    model, tokenizer = load_model_and_tokenizer(model_path, family=family, device=device, dtype=dtype, seed=seed)
    reference = reference_attn_implementation(model)
    prompts, group_of = demo_prompts(batch, groups, shots, seed)
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    gen = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)

    def run_cascade(rows=None, n=new_tokens):
        i, m = (ids, mask) if rows is None else (ids[:rows], mask[:rows])
        inputs = hf_cascade.shared_prefix_inputs(model, i, m, min_shared_tokens=min_shared_tokens)
        out = model.generate(**inputs, **{**gen, "max_new_tokens": n, "min_new_tokens": n})
        return out[:, inputs["input_ids"].shape[1] :], inputs["past_key_values"]

    def run_reference(rows=None, n=new_tokens):
        i, m = (ids, mask) if rows is None else (ids[:rows], mask[:rows])
        out = model.generate(
            input_ids=i, attention_mask=m, return_dict_in_generate=True,
            **{**gen, "max_new_tokens": n, "min_new_tokens": n},
        )
        return out.sequences[:, i.shape[1] :], out.past_key_values

    with torch.inference_mode():
        # Warm-up with the timed shapes: Triton compiles a kernel per specialisation (integer arguments ==1 or
        # divisible by 16 included), so a smaller warm-up would leave compilations inside the timed run on a GPU.
        run_cascade()
        t_cascade, (cascade_tokens, cache) = _timed(run_cascade, device)
        model.set_attn_implementation(reference)
        try:
            run_reference()
            t_reference, (reference_tokens, reference_cache) = _timed(run_reference, device)
        finally:
            model.set_attn_implementation("cascade")

    same_rows = (cascade_tokens == reference_tokens).all(dim=1).tolist()
    tree = getattr(cache, "prefix_tree", None)
    lengths = mask.sum(1).tolist()
    shared_per_row = sum(tree.row_prefix_len) if tree is not None else 0
    config = model.config.get_text_config()
    return {
        "model": model_path or f"tiny random-init {family}",
        "model_shape": f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} q / {getattr(config, 'num_key_value_heads', None)} kv heads",
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(model.device),
        "reference": reference,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "sharing": tree.describe() if tree is not None else "unknown",
        "prefix_tokens_prefilled": int(getattr(cache, "prefilled_prefix_tokens", 0)),
        "shared_prompt_tokens": int(shared_per_row),
        "identical_rows": int(sum(same_rows)),
        "identical": all(same_rows),
        "cascade_s": t_cascade,
        "reference_s": t_reference,
        "cascade_kv_bytes": int(cache.nbytes),
        "reference_kv_bytes": dynamic_cache_nbytes(reference_cache),
        "examples": [
            {"prompt_tail": prompts[i][-40:], "completion": text}
            for i, text in enumerate(tokenizer.batch_decode(cascade_tokens, skip_special_tokens=True))
        ],
    }


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def cmd_demo(args) -> int:
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1; got {args.new_tokens}.")
    r = run_demo(
        args.model, family=args.family, device=args.device, dtype=args.dtype, batch=args.batch, groups=args.groups,
        shots=args.shots, new_tokens=args.new_tokens, min_shared_tokens=args.min_shared_tokens, seed=args.seed,
    )
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["identical"] or not args.check else 1
    ref = r["reference"]
    kv_ratio = r["reference_kv_bytes"] / max(r["cascade_kv_bytes"], 1)
    speed = r["reference_s"] / r["cascade_s"] if r["cascade_s"] > 0 else float("nan")
    print(f"hf_cascade demo: {r['model']} ({r['model_shape']}), {r['dtype']} on {r['device']}")
    print(
        f"batch: {r['batch']} prompts = system prompt + 1 of {args.groups} few-shot blocks ({args.shots} shots) + "
        f"a question; {r['prompt_tokens_min']}-{r['prompt_tokens_max']} tokens each"
    )
    print(f"shared prefixes found: {r['sharing']}")
    print(
        f"  prefilled once: {r['prefix_tokens_prefilled']} prefix tokens "
        f"(per-row prefill would compute {r['shared_prompt_tokens']})"
    )
    print()
    print(f"{'':<26}{'cascade':>12}{ref:>12}")
    time_label = f"time ({r['new_tokens']} new tokens/row)"
    print(f"{time_label:<26}{r['cascade_s']:>10.2f} s{r['reference_s']:>10.2f} s   (speedup {speed:.2f}x)")
    print(f"{'KV cache':<26}{_mib(r['cascade_kv_bytes']):>12}{_mib(r['reference_kv_bytes']):>12}   "
          f"({kv_ratio:.1f}x smaller)")
    verdict = "yes" if r["identical"] else "NO"
    print(f"identical tokens: {verdict} ({r['identical_rows']}/{r['batch']} rows, greedy)")
    if not r["identical"] and r["dtype"] != "float32":
        print(f"  ({r['dtype']} rounding differs between the two attention paths and can flip near-tie tokens; "
              "--dtype float32 compares exactly)")
    for example in r["examples"][: args.show]:
        print(f"  ...{example['prompt_tail']!r} -> {example['completion']!r}")
    if r["device"] == "cpu":
        print(
            "\nOn CPU, times mostly measure the Python overhead of a tiny model: cascade's speedup needs a GPU,\n"
            "long shared prefixes and large batches (python -m hf_cascade bench). The KV saving holds everywhere."
        )
    elif args.model is None:
        print(
            "\nA tiny random model on a GPU measures launch overhead, not attention: cascade pays with long shared\n"
            "prefixes, wide batches and a real model (python -m hf_cascade bench, or --model PATH)."
        )
    return 0 if r["identical"] or not args.check else 1


# ---------------------------------------------------------------------------------------------- bench
SUITES = {"kernels": "bench_kernels.py", "generate": "bench_generate.py"}
QUICK_ARGS = {"kernels": ["--quick"], "generate": ["--layers", "4", "--batches", "8", "32", "--prefix", "2048"]}


def find_benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the source checkout hf_cascade runs from (or of the current directory)."""
    import hf_cascade

    for root in (Path(hf_cascade.__file__).resolve().parent.parent, Path.cwd()):
        if (root / "benchmarks").is_dir():
            return root / "benchmarks"
    return None


def cmd_bench(args) -> int:
    from hf_cascade.plots import plot_results

    if args.plot:
        missing = [p for p in args.plot if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--plot: no such file(s): {missing}")
        png = Path(args.png) if args.png else Path(args.plot[0]).with_suffix(".png")
        print(f"wrote {plot_results(args.plot, png)}")
        return 0

    import torch

    bench_dir = find_benchmarks_dir()
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    if bench_dir is None:
        print(
            "hf_cascade bench runs the scripts in benchmarks/ of a source checkout, and none was found next to the "
            "installed package or in the current directory. Clone the repository and run it from there.",
            file=sys.stderr,
        )
        return 2
    missing = [SUITES[s] for s in suites if not (bench_dir / SUITES[s]).is_file()]
    if missing:
        print(f"benchmark script(s) {missing} not found in {bench_dir}.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "hf_cascade bench needs a CUDA GPU: the suites time the Triton kernels and generate() on the GPU, and "
            "torch.cuda.is_available() is False here. To plot results measured elsewhere: "
            "python -m hf_cascade bench --plot RESULTS.jsonl",
            file=sys.stderr,
        )
        return 2
    extra = [a for a in args.suite_args if a != "--"]
    if extra and len(suites) > 1:
        raise ValueError("extra suite arguments (after `--`) need a single --suite kernels|generate.")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    results, status = [], 0
    for suite in suites:
        out = out_dir / f"{suite}-{stamp}.jsonl"
        cmd = [sys.executable, str(bench_dir / SUITES[suite]), "--output", str(out)]
        cmd += (QUICK_ARGS[suite] if args.quick else []) + extra
        print(f"$ {' '.join(cmd)}", flush=True)
        code = subprocess.call(cmd, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(bench_dir.parent), os.environ.get("PYTHONPATH")]))})
        if code:
            print(f"{suite} suite exited with status {code}", file=sys.stderr)
            status = code
        if out.is_file():
            results.append(out)
    if results:
        png = Path(args.png) if args.png else out_dir / f"bench-{stamp}.png"
        try:
            print(f"results: {', '.join(map(str, results))}\nwrote {plot_results(results, png)}")
        except ValueError as err:
            print(f"no plot: {err}", file=sys.stderr)
    return status
