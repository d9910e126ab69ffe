"""What a user's FIRST generate() calls cost: each peer in a fresh process, on empty and on warm compile caches.

Issue 32. One child process per (workload, peer, cache state), one after another; each child imports torch,
transformers and hf_cascade, builds the model and runs the workload's calls, timing everything on the host clock
(CUDA synchronised). Cache states: ``empty`` points every compile cache (Triton, Inductor, hf_cascade's compile records) at a new
empty folder; ``warm`` runs the same peer again on the folder its ``empty`` run filled, for ``cascade`` after a
process that ran :func:`hf_cascade.warmup.warm_up` for the workload's batch sizes (its ``empty`` run compiles
nothing, so a warm cache is one that a warm-up, or an earlier long job, filled).

Workloads:
- ``shared32``: Llama-3-8B shape (random bf16, 32 layers), 32 rows sharing 4,096 tokens + 64 own, 64 new tokens,
  greedy; the same call twice (first call, second call).
- ``chat48``: SmolLM2-135M-Instruct's shape (its real config, random weights, fp32): 48 chat-like rows sharing a
  300-token system + few-shot block, each with a ragged 12-30-token question (left-padded), 16 new tokens; twice.
- ``stream``: the layout stream of ``bench_generate.py`` (8 sharing trees x 32 rows, Llama-3-8B shape) then four
  batches of odd sizes (7, 13, 20, 48 rows); every batch's seconds, counted from the first.

    python benchmarks/bench_first_call.py                                   # every workload, peer and state
    python benchmarks/bench_first_call.py --workloads shared32 --peers sdpa cascade --states empty

Peers: ``sdpa`` (generate() as it is), ``sdpa_static`` (transformers' static cache, which generate() compiles),
``hf_prefix_reuse`` (transformers' prefix-reuse recipe: the shared prefix prefilled once into a DynamicCache, copied
to every row; only where the rows share leading columns), ``cascade`` (``custom_generate=hf_cascade.generate``,
default options: the tiers, the compiled tier built in the background), ``cascade_no_background`` (the same with
the background build off: the ski rental alone), ``cascade_compiled_now`` (the compiled tier from the first call:
``cascade_options={"compile": "now"}``, the old default), and ``cascade_exit_during_build`` (one default call, then
the process exits while the background build runs: its exit code and how long the exit took). (Earlier results also
hold ``cascade_foreground_finish``, ``cascade_no_prewarm`` and ``cascade_switch_as_is``: policies of a thread that
compiled in the process, removed since: ``hf_cascade.tier_build``'s docstring says why.)

Python bytecode: by default every peer runs with the installed packages' bytecode compiled ahead into a cache
folder (``--bytecode compiled``), as ``pip install`` leaves a machine; the device machine's image ships none and
does not write it, which adds seconds of source compilation to every process's imports (``--bytecode as-is``).
Records ``first_call`` (one per child) in ``benchmarks/results/first_call.jsonl``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

PEER_OPTIONS = {"sdpa": None, "sdpa_static": None, "hf_prefix_reuse": None, "generate_batch": None, "cascade": {},
                "cascade_no_background": {}, "cascade_compiled_now": {"compile": "now"},
                "cascade_exit_during_build": {}}
WORKLOADS = ("shared32", "chat48", "stream")
ODD_BATCHES = (7, 13, 20, 48)


def _child(args) -> dict:
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    import transformers  # noqa: F401

    t_transformers = time.perf_counter() - t0 - t_torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import hf_cascade

    t_hf_cascade = time.perf_counter() - t0 - t_torch - t_transformers
    from bench_generate import LAYOUT_STREAM, build_model, make_tree_batch

    peer = args.peer
    options = PEER_OPTIONS[peer]
    t = time.perf_counter()
    if args.workload == "chat48":
        model = _smollm2_shape_model()
    else:
        model = build_model(32)
    model.set_attn_implementation("sdpa" if options is None else "cascade")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    if peer == "cascade_no_background":
        os.environ["HF_CASCADE_BACKGROUND"] = "off"

    def generate(ids, mask, new_tokens, **extra):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, **extra)

    def timed_call(ids, mask, new_tokens):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if peer == "hf_prefix_reuse":  # transformers' recipe: the shared columns prefilled once, copied per row
            import copy

            from bench_generate import common_prefix_length
            from transformers import DynamicCache

            prefix = common_prefix_length(ids)
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                model(ids[:1, :prefix], past_key_values=cache, use_cache=True)
            cache = copy.deepcopy(cache)
            cache.batch_repeat_interleave(ids.shape[0])
            out = generate(ids, mask, new_tokens, past_key_values=cache)
        elif peer == "sdpa_static":
            out = generate(ids, mask, new_tokens, cache_implementation="static")
        elif peer == "generate_batch":  # transformers' continuous batching, prefix sharing on: its defaults
            out = _generate_batch(model, ids, mask, new_tokens)
        elif options is None:
            out = generate(ids, mask, new_tokens)
        else:
            out = generate(ids, mask, new_tokens, custom_generate=hf_cascade.generate, cascade_options=options or None)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    calls, same_tokens = [], None
    stalls = _StallSampler() if args.sample_stalls and options is not None else None
    if args.fill:  # fill the compile caches as `python -m hf_cascade warmup` does, for this workload's shapes
        from hf_cascade.warmup import warm_up

        rows = {"shared32": (32,), "chat48": (48,), "stream": (7, 13, 20, 32, 48)}[args.workload]
        return {"fill": warm_up(model, rows=rows, prompt_tokens=300 if args.workload == "chat48" else 1024,
                                new_tokens=16, report=lambda line: None)}
    if args.workload == "stream":
        vocab = model.config.vocab_size
        batches = [make_tree_batch(levels, own, 32, vocab, seed) for seed, (levels, own) in enumerate(LAYOUT_STREAM)]
        for i, rows in enumerate(ODD_BATCHES):
            levels, own = LAYOUT_STREAM[i % len(LAYOUT_STREAM)]
            batches.append(make_tree_batch(levels, own, rows, vocab, 100 + i))
        from bench_generate import sdpa_in_parts

        for ids, mask in batches:
            if options is None and peer != "generate_batch":  # sdpa as a capable user runs a batch that does not
                # fit: in halves, quarters
                seconds, _ = sdpa_in_parts(model, ids, mask, 64)
            else:
                seconds, _ = timed_call(ids, mask, 64)
            calls.append(round(seconds, 3))
            torch.cuda.empty_cache()
    else:
        ids, mask, new_tokens = _chat_batch(model) if args.workload == "chat48" else _shared_batch(model)
        outs = []
        count = 1 if peer == "cascade_exit_during_build" else args.calls if options is not None else args.sdpa_calls
        seconds_at_least = args.cascade_seconds if options is not None and count > 1 else 0.0
        started_calls = time.perf_counter()
        while len(calls) < count or (time.perf_counter() - started_calls < seconds_at_least and len(calls) < 500):
            seconds, out = timed_call(ids, mask, new_tokens)
            calls.append(round(seconds, 3))
            if len(outs) < 1:
                outs.append(out)
        outs.append(out)
        same_tokens = bool(torch.equal(outs[0], outs[-1]))  # bf16: tiers' kernels may round near-ties apart
    tiers = None
    if options is not None:
        from hf_cascade.tiers import tier_report

        tiers = tier_report(model)
    return {
        "bench": "first_call", "workload": args.workload, "peer": peer, "cache_state": args.state,
        "cascade_options": options, "import_s": {"torch": round(t_torch, 3), "transformers": round(t_transformers, 3),
                                                 "hf_cascade": round(t_hf_cascade, 3)},
        "model_build_s": round(build_s, 3), "calls_s": calls, "total_calls_s": round(sum(
            c for c in calls if isinstance(c, float)), 3),
        "last5_median_s": sorted(calls[-5:])[len(calls[-5:]) // 2] if calls else None,
        "first_and_last_call_tokens_equal": same_tokens,
        "process_s": round(time.perf_counter() - STARTED, 3), "tiers": tiers,
        "gil_stalls": stalls.report() if stalls is not None else None,
    }


def _generate_batch(model, ids, mask, new_tokens: int):
    """``model.generate_batch(rows, generation_config=...)`` (its defaults) on the left-padded batch's real tokens;
    the generated tokens as one tensor ``[rows, new_tokens]`` (the other peers return prompt + new tokens)."""
    import torch

    from cb_peer import _outputs, greedy_config

    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    out = model.generate_batch(rows, generation_config=greedy_config(new_tokens), progress_bar=False)
    tokens, problem = _outputs(out, rows)
    if problem:
        raise RuntimeError(f"generate_batch: {problem}")
    return torch.tensor(tokens, device=ids.device)


class _StallSampler:
    """A thread that wakes every 10 ms; a wake-up late by more than 100 ms means another thread held the GIL (or the
    import lock) that long: the stacks of the other threads right after are kept (what the background build did)."""

    def __init__(self):
        self.stalls, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        last = time.perf_counter()
        while not self.stop.wait(0.01):
            now = time.perf_counter()
            late = now - last - 0.01
            last = now
            if late > 0.1 and len(self.stalls) < 200:
                frames = sys._current_frames()
                names = {t.ident: t.name for t in threading.enumerate()}
                stacks = {names.get(ident, str(ident)): [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}:{f.name}"
                                                         for f in traceback.extract_stack(frame)[-8:]]
                          for ident, frame in frames.items() if ident != self.thread.ident}
                self.stalls.append({"at_s": round(now - STARTED, 2), "late_s": round(late, 3), "stacks": stacks})

    def report(self):
        self.stop.set()
        self.thread.join()
        return {"count": len(self.stalls), "total_s": round(sum(s["late_s"] for s in self.stalls), 2),
                "worst": sorted(self.stalls, key=lambda s: -s["late_s"])[:12]}


def _triton_kernels(folder: str) -> set:
    """``{(hash, kernel name)}`` of the compiled kernels (``.cubin``) in the Triton cache under ``folder``."""
    root = os.path.join(folder, "triton")
    found = set()
    for entry in (os.listdir(root) if os.path.isdir(root) else []):
        for name in os.listdir(os.path.join(root, entry)):
            if name.endswith(".cubin"):
                found.add((entry, name[:-len(".cubin")]))
    return found


def _kernel_metadata(folder: str, entry: str, name: str) -> dict:
    """A built kernel's metadata from the Triton cache (which specialisation it is: its constants and launch
    configuration), the large fields left out."""
    try:
        with open(os.path.join(folder, "triton", entry, f"{name}.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        return {"name": name, "error": str(err)[:200]}
    return {"name": name, **{k: v for k, v in meta.items() if len(json.dumps(v)) < 600}}


def _kernel_signature(folder: str, entry: str, name: str) -> dict:
    """What tells a kernel's variants apart, read from its Triton cache entry: each argument of its TTIR signature
    (``"div16"`` where Triton specialised it as divisible by 16, ``""`` otherwise; an int specialised as 1 is absent)
    and the launch configuration (warps, stages, shared memory)."""
    import re

    sig = {}
    try:
        with open(os.path.join(folder, "triton", entry, f"{name}.ttir")) as f:
            line = next((ln for ln in f if f"tt.func public @{name}(" in ln), "")
        for arg, attrs in re.findall(r"%(\w+): [^ ,)]+(?: (\{[^}]*\}))?", line.split(") attributes")[0]):
            sig[arg] = "div16" if "tt.divisibility = 16" in attrs else ""
        with open(os.path.join(folder, "triton", entry, f"{name}.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return {"args": sig}
    return {"args": sig, "config": {k: meta.get(k) for k in ("num_warps", "num_stages", "shared")}}


def _variant_difference(new: dict, cached: list[dict]) -> dict | None:
    """How a kernel built anew differs from the closest variant of it already cached: ``{"args": {arg: (cached,
    new)}, "config": {...}}`` (``None`` for an argument absent on one side: specialised as 1), or None where no
    variant of it was cached."""
    best = None
    for old in cached:
        names = set(new["args"]) | set(old["args"])
        args = {a: (old["args"].get(a), new["args"].get(a)) for a in sorted(names)
                if old["args"].get(a) != new["args"].get(a)}
        config = {k: (old.get("config", {}).get(k), v) for k, v in new.get("config", {}).items()
                  if old.get("config", {}).get(k) != v}
        if best is None or len(args) + len(config) < len(best["args"]) + len(best["config"]):
            best = {"args": args, "config": config}
    return best


def _smollm2_shape_model():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(  # SmolLM2-135M-Instruct's config
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def _shared_batch(model):
    from bench_generate import make_batch

    ids, mask = make_batch(32, 4096, 64, model.config.vocab_size)
    return ids, mask, 64


def _chat_batch(model):
    """48 rows: a 300-token shared block, then a 12-30-token question each, left-padded to one width."""
    import torch

    g = torch.Generator().manual_seed(48)
    vocab = model.config.vocab_size
    shared = torch.randint(3, vocab, (300,), generator=g)
    rows = [torch.cat([shared, torch.randint(3, vocab, (int(n),), generator=g)])
            for n in torch.randint(12, 31, (48,), generator=g)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(48, width, dtype=torch.long)
    mask = torch.zeros(48, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids.cuda(), mask.cuda(), 16


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--peers", nargs="+", default=["sdpa", "cascade", "cascade_compiled_now"],
                        choices=list(PEER_OPTIONS))
    parser.add_argument("--states", nargs="+", default=["empty", "warm"], choices=["empty", "warm"])
    parser.add_argument("--calls", type=int, default=2, help="hf_cascade's calls per child for shared32 / chat48")
    parser.add_argument("--sdpa-calls", type=int, default=2, help="the transformers peers' calls per child")
    parser.add_argument("--cascade-seconds", type=float, default=0.0,
                        help="hf_cascade's peers call again until this many seconds of calls (the background build)")
    parser.add_argument("--sample-stalls", action="store_true", help="record where the GIL was held > 100 ms")
    parser.add_argument("--output", default=None)
    parser.add_argument("--bytecode", choices=["compiled", "as-is"], default="compiled",
                        help="compiled (default): every peer runs with the Python bytecode of the installed packages "
                             "compiled ahead into a cache folder, as `pip install` leaves a machine (the device "
                             "image has none and sets PYTHONDONTWRITEBYTECODE); as-is: the environment as it is")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = _child(args)  # (it times its own imports first: common, which imports torch, comes after)
        from common import print_child_result

        print_child_result(record)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import ResultWriter, child_result, compile_bytecode_ahead, fresh_cache_env

    writer = ResultWriter("first_call.jsonl", args.output)
    root = tempfile.mkdtemp(prefix="hf_cascade_first_call_")
    bytecode = compile_bytecode_ahead(os.path.join(root, "pycache")) if args.bytecode == "compiled" else {"mode": "as-is"}
    summary = []
    for workload in args.workloads:
        for peer in args.peers:
            folder = os.path.join(root, f"{workload}-{peer}")
            for state in args.states:
                if state == "empty" and os.path.isdir(folder):
                    folder += "-again"
                if peer == "hf_prefix_reuse" and workload == "chat48":
                    continue  # left-padded ragged rows share no leading columns: the recipe has nothing to reuse
                if peer == "cascade_exit_during_build" and (
                        state == "warm" or workload == "stream"):
                    continue
                if peer in ("sdpa_static", "hf_prefix_reuse") and workload == "stream":
                    continue  # the stream's batches that do not fit run in parts (sdpa_in_parts): sdpa's row only
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workload", workload, "--peer", peer,
                       "--state", state, "--calls", str(args.calls), "--sdpa-calls", str(args.sdpa_calls),
                       "--cascade-seconds", str(args.cascade_seconds)] + (["--sample-stalls"] if args.sample_stalls else [])
                fill = None
                if state == "warm" and peer in ("cascade", "cascade_no_background"):  # warm: after `hf_cascade warmup`
                    done = subprocess.run([*cmd, "--fill"], env=fresh_cache_env(folder), capture_output=True, text=True)
                    fill = child_result(done.stdout) or f"error: {done.stderr[-800:]}"
                built_before = _triton_kernels(folder)
                t = time.perf_counter()
                proc = subprocess.run(cmd, env=fresh_cache_env(folder), capture_output=True, text=True)
                wall = time.perf_counter() - t
                result = child_result(proc.stdout)
                if proc.returncode != 0 or result is None:
                    record = {"bench": "first_call", "workload": workload, "peer": peer, "cache_state": state,
                              "status": f"error rc={proc.returncode}: {proc.stderr[-1500:]}"}
                else:
                    record = {**result, "status": "ok"}
                record["child_wall_s"] = round(wall, 2)
                record["bytecode"] = bytecode
                new_kernels = _triton_kernels(folder) - built_before  # what the run built beyond the warm caches
                record["triton_kernels_built"] = dict(sorted(collections.Counter(
                    name for _, name in new_kernels).items()))
                record["triton_kernels_built_metadata"] = [_kernel_metadata(folder, *k) for k in sorted(new_kernels)]
                record["triton_kernels_built_vs_cached"] = [  # which argument or configuration made it another variant
                    {"name": name, "difference": _variant_difference(
                        _kernel_signature(folder, entry, name),
                        [_kernel_signature(folder, e, n) for e, n in built_before if n == name])}
                    for entry, name in sorted(new_kernels) if not name.startswith("triton_")]
                if peer == "cascade_exit_during_build":
                    record["exit"] = {"returncode": proc.returncode, "stderr_tail": proc.stderr[-600:],
                                      "exit_after_result_s": round(wall - record.get("process_s", wall), 2)}
                if fill is not None:
                    record["caches_filled_by"] = {"warmup": fill}
                writer.write(record)
                summary.append(record)
                print(json.dumps({k: record.get(k) for k in ("workload", "peer", "cache_state", "calls_s",
                                                            "model_build_s", "import_s", "status", "tiers")}),
                      flush=True)
    print(f"\n{'workload':>9} {'peer':>21} {'caches':>6} {'call 1 s':>9} {'call 2 s':>9} {'all calls s':>11}")
    for r in summary:
        calls = r.get("calls_s") or []
        c = lambda i: f"{calls[i]:9.2f}" if len(calls) > i and isinstance(calls[i], float) else f"{'-':>9}"  # noqa
        print(f"{r['workload']:>9} {r['peer']:>21} {r['cache_state']:>6} {c(0)} {c(1)} "
              f"{r.get('total_calls_s', float('nan')):11.2f}  {r['status'][:60]}")


if __name__ == "__main__":
    main()
