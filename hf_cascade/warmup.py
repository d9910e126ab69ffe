"""``python -m hf_cascade warmup --model PATH``: build every kernel and compiled graph a model's generate() calls
use, ahead of time, so that later processes start fast (for container images, CI caches, a job's first step).

It loads the model with ``attn_implementation="cascade"`` and runs, for each ``--rows`` size, generate() calls of
shared-prefix batches on the Triton tier (``compile="never"``: the batch layouts of :func:`warm_up`, one per family
of kernel variants) and one on the compiled tier (``compile="now"``): hf_cascade's Triton kernels are built into
Triton's cache (``TRITON_CACHE_DIR``) for both tiers (the compiled graphs launch other specialisations
than the eager layers do), the decoder layers are compiled into Inductor's (``TORCHINDUCTOR_CACHE_DIR``), and the
compile records of :mod:`hf_cascade.tiers` are written. A later process on the same machine type, versions and
cache folders then moves to the Triton kernels after a call or two and to the compiled layers after fewer calls
(their costs are recorded). Keep those folders in the image (or restore them in CI) at the same paths. Last, it
writes the Python bytecode of the modules the calls imported where none is up to date (:func:`compile_bytecode`;
``--no-bytecode`` skips it). Triton builds a kernel again for launch shapes a warm-up did not run (another
query-block size, say): a first call of such a layout on the Triton tier pays ~1 s per kernel.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--no-bytecode", action="store_true",
                        help="do not write the Python bytecode of the modules the calls imported (see compile_bytecode)")
    return parser


def warm_up(model, rows=(1, 8, 32), prompt_tokens: int = 512, new_tokens: int = 16, report=print) -> list[dict]:
    """Run generate() on ``model`` (loaded with ``attn_implementation="cascade"``) for shared-prefix batches of
    each size in ``rows``, so that later processes find every kernel variant those sizes launch already built.

    On the Triton tier: plain batches (the shared tokens + 8 own per row, and + 40: the kernels' query-block sizes);
    from 2 rows a plain batch whose shared prefix is long next to the rows' own buffers (the decode step then runs
    the prefix pass apart from the suffix pass, with other tiles: see :func:`_two_pass_prefix_tokens`; a stream's
    8,192-token batch built that variant after a warm-up without it, ``benchmarks/results/first_call.jsonl``), a
    tree (two 32-token branches after the shared tokens, 3-12 own tokens, left-padded: the masked and multi-level
    variants) and from 4 rows a three-level tree (four 16-token sub-branches below those). On the compiled tier the
    plain batch. Returns one ``{"rows", "batch", "seconds", "tier"}`` per call."""
    import torch

    from hf_cascade.ops._backend import prepare_triton
    from hf_cascade.tiers import tier_report

    prepare_triton()
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (prompt_tokens,), generator=g)
    results = []
    for n in rows:
        plain = torch.cat([shared.expand(n, -1), torch.randint(3, vocab, (n, 8), generator=g)], dim=1)
        longer = torch.cat([shared.expand(n, -1), torch.randint(3, vocab, (n, 40), generator=g)], dim=1)
        # (batch, shared tokens, ids, attention mask or None, compile)
        runs = [("plain", prompt_tokens, plain, None, "never"), ("plain, 40 own", prompt_tokens, longer, None, "never")]
        long_tokens = _two_pass_prefix_tokens(model, n, new_tokens)
        if n >= 2 and long_tokens > prompt_tokens:
            long_shared = shared.repeat(-(-long_tokens // prompt_tokens))[:long_tokens]
            runs.append(("plain, long shared", long_tokens,
                         torch.cat([long_shared.expand(n, -1), plain[:, prompt_tokens:]], 1), None, "never"))
        if n >= 2:
            runs.append(("tree", prompt_tokens, *_tree_batch(shared, n, vocab, g), "never"))
        if n >= 4:  # a deeper tree: levels of all, half and a quarter of the rows (other tiles per level)
            runs.append(("tree, 3 levels", prompt_tokens, *_tree_batch(shared, n, vocab, g, levels=3), "never"))
        runs.append(("plain", prompt_tokens, plain, None, "now"))
        for batch, shared_tokens, ids, mask, compile in runs:
            if compile == "never":
                _move_up_to_triton(model)
            seconds = _call(model, ids.to(model.device), new_tokens, compile,
                            None if mask is None else mask.to(model.device))
            calls = tier_report(model)["calls"]
            results.append({"rows": n, "batch": batch, "seconds": round(seconds, 2),
                            "tier": calls[-1][0] if calls else "none"})
            report(f"  {n:>4} rows x {shared_tokens} shared tokens ({batch}), {new_tokens} new: {seconds:.1f} s "
                   f"({results[-1]['tier']})")
    if model.device.type == "cuda" and results:
        results.append(_measure_warm_compile(model, plain.to(model.device), new_tokens, report))
    return results


def _two_pass_prefix_tokens(model, rows: int, new_tokens: int) -> int:
    """Shared tokens enough for ``rows`` rows of 8 own tokens + ``new_tokens`` to run their decode steps' prefix pass
    apart from the suffix pass (twice the launch cost model's threshold,
    :func:`hf_cascade.ops._launch.fused_up_to_prefix_keys`), within the model's positions."""
    from hf_cascade.inputs import suffix_capacity
    from hf_cascade.ops._launch import fused_up_to_prefix_keys

    tokens = int(2 * fused_up_to_prefix_keys(rows, suffix_capacity(8 + new_tokens)))
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = getattr(config, "max_position_embeddings", None)
    return tokens if positions is None else min(tokens, positions - 8 - new_tokens)


def _tree_batch(shared, n: int, vocab: int, generator, levels: int = 2):
    """``(ids [n, W], attention_mask [n, W])``: ``shared``, then one of two 32-token branches (row i: branch i % 2),
    with ``levels=3`` then one of four 16-token sub-branches (i % 4, nested in i % 2), then 3-12 own tokens;
    left-padded with 0."""
    import torch

    from hf_cascade.inputs import left_padded

    branches = torch.randint(3, vocab, (2, 32), generator=generator)
    twigs = torch.randint(3, vocab, (4, 16), generator=generator)
    rows = [torch.cat([shared, branches[i % 2], *([twigs[i % 4]] if levels == 3 else []),
                       torch.randint(3, vocab, (3 + (5 * i) % 10,), generator=generator)]) for i in range(n)]
    return left_padded(rows)


def _move_up_to_triton(model) -> None:
    """Let the next call of ``model`` take the Triton tier (as if the calls below it had lost what building it
    costs with empty caches)."""
    from hf_cascade.tiers import DEFAULT_COST_S, raise_regret

    raise_regret(model, "triton", DEFAULT_COST_S["triton"])


def _call(model, ids, new_tokens: int, compile: str = "now", attention_mask=None) -> float:
    """Seconds of one greedy generate() of ``ids`` with ``cascade_options={"compile": compile}`` (device work
    included); ``attention_mask`` None: no padding."""
    import torch

    import hf_cascade

    started = time.perf_counter()
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate,
                   cascade_options={"compile": compile, "cost_model": None})
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - started


def _measure_warm_compile(model, ids, new_tokens: int, report) -> dict:
    """What compiling the layers again from the warm caches costs: the last batch again (all hot), then once more
    after dropping this process's compiled code (dynamo's, the model's compiled layers and recorded steps). A new
    process pays more (it also imports the compile stack: ~10 s in all against ~2 s here, H100, Llama-3-8B shape,
    ``benchmarks/results/probe_warm_compile.jsonl``), so the record only says the caches are warm
    (:func:`hf_cascade.tiers.note_caches_warm`); the first process that compiles records what it paid."""
    import torch

    from hf_cascade.engine import engine_of
    from hf_cascade.tiers import note_caches_warm

    hot = _call(model, ids, new_tokens)
    torch._dynamo.reset()
    engine_of(model).forget("layer_calls", "graphs")
    again = _call(model, ids, new_tokens)
    cost = max(again - hot, 0.0)
    note_caches_warm(model)
    report(f"  compiling again from the warm caches in this process: {cost:.1f} s (a new process also imports the "
           "compile stack)")
    return {"rows": int(ids.shape[0]), "seconds": round(again, 2), "tier": "compiled (warm caches)",
            "warm_compile_s": round(cost, 2)}


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
    print(f"warmup: loading {args.model} ({args.dtype}) on {args.device}", flush=True)
    model, _ = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    warm_up(model, rows=args.rows, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    if not args.no_bytecode:
        compile_bytecode()
    record = tier_report(model)["record"]
    print(f"warmup: done; compile record: {record or 'none (CPU, or HF_CASCADE_RECORDS=off)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
