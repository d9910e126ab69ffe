"""``python -m hf_cascade warmup --model PATH``: build every kernel and compiled graph a model's generate() calls
use, ahead of time, so that later processes start fast (container images, CI caches, a job's first step).

The background build of :mod:`hf_cascade.tier_build` run in the foreground, to its end: for each ``--rows`` size a
generate() call of a shared-prefix batch on the compiled tier (the layers compiled into Inductor's cache), then the
build's children on the model cut to two layers (the call's rows, and the grid of layouts with these batches added,
for at most ``--grid-budget-s``: the Triton kernels into Triton's cache). The calls leave the markers of
:mod:`hf_cascade.tiers`, so a later process with the same machine type, versions and cache folders expects the warm
costs and starts no build: keep ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` in the image at the same paths.
Last, the bytecode of the imported modules where none is up to date (:func:`compile_bytecode`). On a CPU it runs the
calls only.
"""

from __future__ import annotations

import argparse
import os
import time

__all__ = ["build_parser", "main", "warm_up"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m hf_cascade warmup", description=__doc__)
    parser.add_argument("--model", required=True, help="a local checkpoint folder (from_pretrained) or .gguf file")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32],
                        help="batch sizes to run (each compiles its batch bucket's decode step)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="shared prompt tokens of each batch")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--grid-budget-s", type=float, default=None,
                        help="longest seconds each child runs the grid of other layouts (CUDA; default: the background "
                        "build's, hf_cascade.tier_build.GRID_BUDGET_S)")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="do not write the Python bytecode of the modules the calls imported (see compile_bytecode)")
    return parser


def warm_up(model, rows=(1, 8, 32), prompt_tokens: int = 512, new_tokens: int = 16, report=print,
            grid_budget_s: float | None = None) -> list[dict]:
    """Run generate() on ``model`` (loaded with ``attn_implementation="cascade"``) for a shared-prefix batch of each
    size in ``rows`` (``prompt_tokens`` shared + 8 own per row) on the compiled tier; on CUDA then the background
    build's children to their end (:func:`hf_cascade.tier_build.start_build`: the last batch's rows, and the grid
    of layouts with every batch added, each child for at most ``grid_budget_s``, default
    :data:`~hf_cascade.tier_build.GRID_BUDGET_S`). Returns one ``{"rows", "batch", "seconds", "tier"}`` per call,
    then ``{"batch": "background build", "seconds", "grid": {...}, "error"}`` (CUDA)."""
    import torch

    from hf_cascade.tiers import tier_report

    from hf_cascade.transformers_compat import text_config

    vocab = text_config(model.config).vocab_size
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (prompt_tokens,), generator=g)
    results, batches = [], []
    for n in rows:
        ids = torch.cat([shared.expand(n, -1), torch.randint(3, vocab, (n, 8), generator=g)], dim=1)
        batches.append((ids, torch.ones_like(ids)))
        seconds = _call(model, ids.to(model.device), new_tokens)
        calls = tier_report(model)["calls"]
        results.append({"rows": n, "batch": "plain", "seconds": round(seconds, 2),
                        "tier": calls[-1][0] if calls else "none"})
        report(f"  {n:>4} rows x {prompt_tokens} shared tokens, {new_tokens} new: {seconds:.1f} s "
               f"({results[-1]['tier']})")
    if model.device.type == "cuda" and batches:
        results.append(_build_in_foreground(model, batches, new_tokens, grid_budget_s, report))
    return results


def _build_in_foreground(model, batches: list, new_tokens: int, grid_budget_s: float | None, report) -> dict:
    """The background build's children on the last of ``batches`` (its rows) and on the grid of layouts with every
    batch of ``batches`` added, waited for to their end."""
    from hf_cascade import tier_build
    from hf_cascade.build_grid import variant_grid

    ids, mask = (t.to(model.device) for t in batches[-1])
    captured = {}

    def capture(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        captured.update(input_ids=input_ids, generation_config=generation_config, kwargs=kwargs)
        return input_ids

    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, custom_generate=capture)  # the arguments generate() hands hf_cascade.generate
    grid = batches + variant_grid(model, captured["input_ids"], captured["generation_config"])
    started = time.perf_counter()
    build = tier_build.start_build(model, captured["input_ids"], captured["generation_config"], captured["kwargs"],
                                   {"compile": "now", "batch_buckets": True}, grid_batches=grid,
                                   grid_budget_s=grid_budget_s)
    build.wait(progress=True)
    seconds = time.perf_counter() - started
    outcome = build.summary
    report(f"  background build in the foreground: {seconds:.1f} s; grid {outcome.get('grid')}"
           + (f"; failed: {build.error}" if build.error else ""))
    return {"batch": "background build", "seconds": round(seconds, 2), "grid": outcome.get("grid"),
            "error": build.error}


def _call(model, ids, new_tokens: int) -> float:
    """Seconds of one greedy generate() of ``ids`` (no padding) on the compiled tier (``compile="now"``), device
    work included."""
    import torch

    import hf_cascade

    started = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate,
                   cascade_options={"compile": "now", "cost_model": None})
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - started


def compile_bytecode(files=None, report=print) -> dict:
    """Write the Python bytecode of every module this process imported (``files``: those source files instead), where
    none is up to date, as ``pip install`` does for its packages.

    An image whose packages were installed without it (``uv`` by default, ``pip --no-compile``) and whose processes
    write none (``PYTHONDONTWRITEBYTECODE``, or a read-only site-packages) compiles every source it imports in every
    process: on the device machine's image, importing torch and transformers took 7.0 s against 2.6 s with bytecode,
    building the 8B-shaped model 10.1 s against 3.4 s, and the compiled tier's first call 2 s more
    (``benchmarks/results/first_call.jsonl``, ``probe_warm_compile.jsonl``); on a 2-core CPU a fresh process went
    from 12.5 s to 5.3 s after this step (``benchmarks/bench_bytecode.py``). Python reads bytecode even where it
    writes none; it looks in ``$PYTHONPYCACHEPREFIX`` where that is set (as here, so set it alike for later
    processes). Runs ``python -m compileall`` over the files (seconds for a few thousand; up-to-date ones are skipped).

    Returns:
        ``{"files", "seconds", "failed"}``; ``failed``: compileall's error lines, at most 20 (a read-only folder:
        set ``PYTHONPYCACHEPREFIX`` to a writable one for every process).
    """
    import os
    import subprocess
    import sys
    import tempfile

    if files is None:
        files = sorted({f for f in (getattr(m, "__file__", None) for m in list(sys.modules.values()))
                        if isinstance(f, str) and f.endswith(".py") and os.path.isfile(f)})
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
        listing.write("\n".join(files) + "\n")
    try:
        done = subprocess.run([sys.executable, "-m", "compileall", "-q", "-i", listing.name],
                              capture_output=True, text=True)
    finally:
        os.unlink(listing.name)
    failed = [line.strip() for line in done.stdout.splitlines()  # (compileall's lines for a file it failed on)
              if line.startswith("*** ") or line.startswith(("PermissionError", "OSError", "FileNotFoundError"))]
    result = {"files": len(files), "seconds": round(time.perf_counter() - started, 1), "failed": failed[:20]}
    report(f"  bytecode of {len(files)} imported modules written where missing: {result['seconds']} s"
           + (f"; {len(failed)} could not be written (read-only? set PYTHONPYCACHEPREFIX)" if failed else ""))
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from hf_cascade.tiers import tier_report
    from hf_cascade.tiny import load_model_and_tokenizer

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("warmup: --device cuda but no CUDA GPU is visible; there is nothing to compile on a CPU "
                         "(its path runs PyTorch's own kernels). Pass --device cpu to run the calls anyway.")
    if min(args.rows) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1:
        raise SystemExit(f"warmup: --rows, --prompt-tokens and --new-tokens must be >= 1; got --rows {args.rows}, "
                         f"--prompt-tokens {args.prompt_tokens}, --new-tokens {args.new_tokens}.")
    if args.model != "tiny" and not os.path.exists(args.model):
        raise SystemExit(f"warmup: --model {args.model!r}: no such checkpoint folder or .gguf file.")
    print(f"warmup: loading {args.model} ({args.dtype}) on {args.device}", flush=True)
    model, _ = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    warm_up(model, rows=args.rows, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
            grid_budget_s=args.grid_budget_s)
    if not args.no_bytecode:
        compile_bytecode()
    record = tier_report(model)["record"]
    print(f"warmup: done; markers: {record + '.*' if record else 'none (CPU, or HF_CASCADE_RECORDS=off)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
