"""End-to-end generate() benchmark: hf_cascade (compiled and eager) vs generate() with sdpa (dynamic cache, and
transformers' static cache compiled) vs generate_batch (continuous batching with prefix sharing: ``benchmarks/
cb_peer.py``; ``generate_batch_defaults`` as a user first calls it, ``generate_batch_best`` with its guide's fast
settings; ``generate_batch`` is the defaults). The peers and batches are in ``generate_peers.py``.

Workload (issue 3): a Llama-3-8B-shaped random bf16 model, B rows sharing a P-token prompt, each with its own
S-token suffix, N new tokens, greedy. Reports total time, prefill time, decode ms/step, tokens/s and peak memory
for each peer in the same run. Before any timing, a check gates the run: hf_cascade's first-step logits must be
no further from sdpa's than transformers' eager attention's are (``bf16_logits_gate``).

    python benchmarks/bench_generate.py                       # the issue's grid (needs an 80 GB GPU)
    python benchmarks/bench_generate.py --layers 4 --batches 8 --prefix 1024   # a quick look
    python benchmarks/bench_generate.py --workload nsamples grpo   # n samples of a prompt, through plain generate()
    python benchmarks/bench_generate.py --workload stream --stream-passes 2  # 8 batches, 8 sharing trees, cold + warm
    python benchmarks/bench_generate.py --workload stream --stream-process-per-peer  # each peer in a new process
    python benchmarks/bench_generate.py --workload tree      # 64 rows: 1,024 shared by all, 4 docs of 2,048 by 16

hf_cascade's one-argument peers: ``cascade_generate`` (the default, ``decode_step="auto"``: decode steps replayed
from recorded CUDA graphs, the prefill forwards with compiled layers), ``cascade_generate_graphs`` and
``cascade_generate_compile`` (``decode_step`` named), ``cascade_generate_eager_prefill`` (the default with
``compile_prefill=False``: the prefill forwards eager).

Sampling workloads (``--workload nsamples grpo``): ``nsamples`` is 1 prompt of 4096 tokens x 32 samples, 64 new
tokens; ``grpo`` is 16 prompts (a shared 256-token system prompt + 512 own tokens) x 8 samples, 128 new tokens. The
peers are the user's own ``model.generate(**batch, num_return_sequences=N, do_sample=True)`` with sdpa, transformers'
prefix-reuse recipe on the repeated rows (``hf_prefix_reuse``), the same call with
``custom_generate=hf_cascade.generate``, and ``--sampling-peers generate_batch_defaults generate_batch_best`` (the
repeated rows); KV bytes are compared with the unique tokens (each prompt token once + every sample's own tokens).
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()  # before torch's import: a stream record's process_s counts everything

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (  # noqa: E402
    RESULTS_DIR, ResultWriter, TritonBuilds, timed_with_compile_breakdown, triton_cache_files, triton_variants,
)
from generate_peers import (  # noqa: E402,F401  (re-exported: the probes and other suites import them from here)
    CASCADE_GENERATE_PEERS, CB_PEERS, SAMPLING_WORKLOADS, TREE_LEVELS, TREE_OWN, TREE_ROWS, TREE_SEED, PeerFailed,
    _options_name, bf16_logits_gate, build_model, common_prefix_length, dynamic_cache_nbytes, first_logits_check,
    gate, make_batch, make_sampling_batch, make_tree_batch, median_run, peak_gib, reset_memory, run_cascade,
    run_cascade_generate, run_generate_batch, run_hf_prefix_reuse, run_sampling, run_sdpa, sampling_logits_check,
    sdpa_in_parts, step_timings,
)

import hf_cascade  # noqa: E402


def main_sampling(args, writer, model) -> None:
    vocab = model.config.vocab_size
    bytes_per_token = 2 * args.layers * model.config.num_key_value_heads * model.config.head_dim * 2  # K+V, bf16
    rows = []
    for name in args.workload:
        prompts, shared, own, samples, new_tokens = SAMPLING_WORKLOADS[name]
        ids, mask = make_sampling_batch(name, vocab)
        unique_tokens = shared + prompts * own + prompts * samples * new_tokens
        workload = dict(workload=name, layers=args.layers, prompts=prompts, shared=shared, own=own, samples=samples,
                        new_tokens=new_tokens, unique_kv_gib=unique_tokens * bytes_per_token / 2**30)
        check = sampling_logits_check(model, ids, mask, samples)
        writer.write({"bench": "generate_sampling_check", **workload, **check})
        gate(check, name)
        # A warm-up run of the eager peers first, untimed (cascade's own first call, untimed, compiles and warms
        # it at the timed batch size; a small warm-up batch would compile a graph for its own size).
        for peer in ("sdpa", "hf_prefix_reuse"):
            try:
                run_sampling(model, peer, ids[:1], mask[:1], 2, 2)
            except torch.OutOfMemoryError:
                pass
        results = {}
        for peer in args.sampling_peers:
            record = {"bench": "generate_sampling", "peer": peer, **workload}
            try:
                record.update(median_run(lambda: run_sampling(model, peer, ids, mask, samples, new_tokens),
                                         args.repeats), status="ok")
                record["kv_over_unique"] = record["kv_gib"] / workload["unique_kv_gib"]
                results[peer] = record
            except torch.OutOfMemoryError:
                record["status"] = "out of memory"
            except PeerFailed as err:
                record.update(err.record)
            reset_memory()
            if peer == "cascade" and "cascade" in results:
                for other in ("sdpa", "hf_prefix_reuse", *CB_PEERS):
                    if other in results:
                        record[f"speedup_vs_{other}"] = results[other]["total_s"] / record["total_s"]
            writer.write(record)
            rows.append(record)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}, flush=True)
    print(f"\n{'workload':>9} {'peer':>15} {'total s':>8} {'ms/step':>8} {'KV GiB':>7} {'KV/unique':>9} "
          f"{'vs sdpa':>7} {'vs reuse':>8}")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(f"{r['workload']:>9} {r['peer'][-15:]:>15} {f('total_s', '8.2f')} {f('decode_ms_per_step', '8.1f')} "
              f"{f('kv_gib', '7.2f')} {f('kv_over_unique', '9.2f')} {f('speedup_vs_sdpa', '7.2f')} "
              f"{f('speedup_vs_hf_prefix_reuse', '8.2f')}")


# A stream of 8 batches of 32 rows, each with another sharing tree: per level (number of groups, tokens each),
# then each row's own tokens. Levels nest: group g of level l+1 hangs under group g * n_l // n_{l+1} of level l.
LAYOUT_STREAM = [
    ([(1, 4096)], 64),
    ([(1, 1024), (4, 1024)], 64),
    ([(1, 8192)], 32),
    ([(1, 512), (2, 2048), (8, 512)], 64),
    ([(1, 2048), (8, 512)], 64),
    ([(1, 1024)], 128),
    ([(1, 1024), (4, 1024), (16, 256)], 64),
    ([(1, 4096), (2, 2048)], 64),
]


def main_stream(args, writer, model) -> None:
    """8 consecutive batches with 8 sharing trees: total time including every compilation, per peer. With
    ``--stream-passes 2`` the peers run the stream again (pass 1: kernels built, libraries set up)."""
    from torch._dynamo.utils import counters

    vocab = model.config.vocab_size
    batches = [make_tree_batch(levels, own, 32, vocab, seed) for seed, (levels, own) in enumerate(LAYOUT_STREAM)]
    for stream_pass in range(args.stream_passes):
        _stream_pass(args, writer, model, batches, stream_pass, counters)


def _stream_pass(args, writer, model, batches, stream_pass: int, counters) -> None:
    totals = {}
    builds = args.triton_builds
    for peer in args.stream_peers:
        graphs_before = counters["stats"]["unique_graphs"]
        per_batch, status, caches, split, compile_per_batch, variants = [], "ok", [], [], [], []
        triton_per_batch = []
        peer_started = time.perf_counter()
        for ids, mask in batches:
            if args.peer_budget_s is not None and per_batch and time.perf_counter() - peer_started > args.peer_budget_s:
                status = f"stopped after {len(per_batch)} of {len(batches)} batches (--peer-budget-s)"
                break
            try:
                if peer == "sdpa":
                    model.set_attn_implementation("sdpa")
                    t, parts = sdpa_in_parts(model, ids, mask, args.new_tokens)
                    split.append(parts)
                elif peer == "hf_prefix_reuse":
                    prefix = common_prefix_length(ids)
                    t = run_hf_prefix_reuse(model, ids, mask, args.new_tokens, prefix=prefix, once=True)["total_s"]
                elif peer in CB_PEERS:  # its own pool and manager per batch, as generate_batch makes them
                    t = run_generate_batch(model, ids, mask, args.new_tokens, CB_PEERS[peer])["total_s"]
                else:
                    model.set_attn_implementation("cascade")
                    before = builds.snapshot()
                    t, compile_s, _ = timed_with_compile_breakdown(lambda: model.generate(
                        ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate, cascade_caches=caches,
                        cascade_options=CASCADE_GENERATE_PEERS[peer],
                    ))
                    compile_per_batch.append(compile_s)
                    variants.append(triton_variants())
                    after = builds.snapshot()
                    triton_per_batch.append({k: None if after[k] is None else round(after[k] - before[k], 3)
                                             for k in after})
                per_batch.append(t)
            except torch.OutOfMemoryError:
                status = "out of memory"
                break
            except PeerFailed as err:
                status = err.record["status"]
                break
            except KeyboardInterrupt:  # (SIGTERM too: main) the batches so far are written, then it stops
                status = f"stopped in batch {len(per_batch) + 1} (interrupted)"
                break
            finally:
                reset_memory()
        record = _stream_record(args, peer, stream_pass, per_batch, status, split, caches,
                                {"compile_s_per_batch": compile_per_batch, "triton_variants_after_batch": variants,
                                 "triton_per_batch": triton_per_batch})
        record["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
        if status == "ok":
            totals[peer] = record["total_s"]
        writer.write(record)
        if status.startswith("stopped in"):
            raise KeyboardInterrupt(status)
        print({k: v for k, v in record.items() if k != "layouts"}, flush=True)
    for ours in CASCADE_GENERATE_PEERS:
        for peer in ("sdpa", "hf_prefix_reuse", *CB_PEERS):
            if totals.get(peer) and totals.get(ours):
                print(f"layout stream (pass {stream_pass}): {ours} {totals[ours]:.1f} s, {peer} {totals[peer]:.1f} s "
                      f"({totals[peer] / totals[ours]:.2f}x)")


def _stream_record(args, peer: str, stream_pass: int, per_batch: list, status: str, split: list, caches: list,
                   triton: dict) -> dict:
    """One peer's record of a stream pass (``triton``: the cascade peers' per-batch compile and Triton lists)."""
    record = {
        "bench": "generate_layout_stream", "peer": peer, "pass": stream_pass, "layers": args.layers, "batch": 32,
        "new_tokens": args.new_tokens, "layouts": [[list(l) for l in levels] for levels, _ in LAYOUT_STREAM],
        "per_batch_s": per_batch, "total_s": sum(per_batch), "status": status,
        # this process so far: imports, model build, earlier peers and passes, this one
        "process_s": time.perf_counter() - PROCESS_STARTED, "peers_in_process": args.stream_peers,
    }
    if split:
        record["sdpa_parts_per_batch"] = split
    if peer in CASCADE_GENERATE_PEERS:
        record["decode_step"] = (CASCADE_GENERATE_PEERS[peer] or {}).get("decode_step", "default")
        record["cascade_options"] = _options_name(CASCADE_GENERATE_PEERS[peer])
    if triton["compile_s_per_batch"]:  # torch.compile phases per batch (the rest of a compiling batch: Triton, ...)
        record.update(triton)  # hf_cascade's Triton kernels built so far; builds (and seconds), loads from disk
        record["triton_cache_files_at_start"] = args.triton_cache_files_at_start  # 0: a machine-cold stream
    if caches:  # the trees as planned: prefix levels and fixed-buffer capacity of each batch
        record["planned"] = [{"levels": c.num_levels, "max_suffix_length": c.max_suffix_length,
                              "compiled": c.is_compileable} for c in caches]
        caches.clear()
    return record


def stream_process_per_peer(args, argv: list[str]) -> None:
    """Each stream peer in a new process (this script again with ``--stream-peers <peer>``), one after another;
    prints each pass's totals and the ratios from the records they append."""
    output = args.output or str(RESULTS_DIR / "generate.jsonl")
    with open(output, "a"):
        pass
    with open(output) as f:
        start = sum(1 for _ in f)
    child = [a for a in argv if a != "--stream-process-per-peer"]
    i = child.index("--stream-peers") if "--stream-peers" in child else None
    if i is not None:  # drop the peers list: each child gets one peer
        j = i + 1
        while j < len(child) and not child[j].startswith("--"):
            j += 1
        del child[i:j]
    if "--output" not in child:
        child += ["--output", output]
    for peer in args.stream_peers:
        subprocess.run([sys.executable, os.path.abspath(__file__), *child, "--stream-peers", peer], check=True)
    with open(output) as f:
        records = [json.loads(line) for line in list(f)[start:]]
    totals = {(r["peer"], r["pass"]): r["total_s"] for r in records
              if r.get("bench") == "generate_layout_stream" and r.get("status") == "ok"}
    for stream_pass in range(args.stream_passes):
        for ours in CASCADE_GENERATE_PEERS:
            for peer in ("sdpa", "hf_prefix_reuse", *CB_PEERS):
                a, b = totals.get((ours, stream_pass)), totals.get((peer, stream_pass))
                if a and b:
                    print(f"layout stream, a process per peer (pass {stream_pass}): {ours} {a:.1f} s, {peer} "
                          f"{b:.1f} s ({b / a:.2f}x)")


def _time_peers(args, writer, model, runners, ids, mask, base: dict, out_of_memory: set, rows: list) -> None:
    """Every peer of ``args.peers`` on one batch (a warm-up call first where the peer compiles or builds a pool),
    each record written as it is done; greedy tokens compared with sdpa's."""
    from torch._dynamo.utils import counters as dynamo_counters

    tokens = {}
    for peer in args.peers:
        record = {**base, "peer": peer}
        if peer in out_of_memory:
            record["status"] = "skipped: out of memory at a smaller batch"
        else:
            try:
                if peer.endswith("_compiled") or peer in CASCADE_GENERATE_PEERS or peer in CB_PEERS:
                    # compile + capture for this batch size, untimed (cascade_generate: its default path compiles
                    # once per model and batch size; after a --workload stream run of this size, nothing;
                    # generate_batch: its first call in the process)
                    record["warmup_s"], record["warmup_compile_s"], _ = timed_with_compile_breakdown(
                        lambda: runners[peer](model, ids, mask, args.new_tokens)
                    )
                    reset_memory()
                result = median_run(lambda: runners[peer](model, ids, mask, args.new_tokens), args.repeats)
                new = result.pop("new_tokens", None)
                if new is not None:
                    tokens[peer] = new
                record.update(result, status="ok")
                record["tokens_per_s"] = ids.shape[0] * args.new_tokens / result["total_s"]
                record["dynamo_unique_graphs_so_far"] = dynamo_counters["stats"]["unique_graphs"]
            except torch.OutOfMemoryError:
                record["status"] = "out of memory"
                out_of_memory.add(peer)
            except PeerFailed as err:
                record.update(err.record)
                if "out of memory" in err.record.get("status", ""):
                    out_of_memory.add(peer)
            except Exception as err:  # a peer failing must not hide the others' numbers
                record["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
        reset_memory()
        # sdpa's record: the peers before it; a peer after sdpa: its own record (greedy_tokens_equal_sdpa_frac)
        others = [o for o in tokens if o != "sdpa"] if peer == "sdpa" else [peer] if "sdpa" in tokens else []
        for other in others:
            if other in tokens and tokens[other].shape == tokens["sdpa"].shape:
                key = f"greedy_tokens_equal_{other if peer == 'sdpa' else 'sdpa'}_frac"
                record[key] = (tokens[other] == tokens["sdpa"]).float().mean().item()
        writer.write(record)
        rows.append(record)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}, flush=True)


def main_tree(args, writer, model, runners, out_of_memory: set, rows: list) -> None:
    """The tree workload (``generate_peers.TREE_*``): 64 rows, 1,024 tokens shared by all, 4 documents of 2,048
    tokens each shared by 16, 64 own tokens, greedy; transformers' recipe reuses the common 1,024 tokens."""
    ids, mask = make_tree_batch(TREE_LEVELS, TREE_OWN, TREE_ROWS, model.config.vocab_size, TREE_SEED)
    prefix = common_prefix_length(ids)
    runners = {**runners, "hf_prefix_reuse": lambda *a: run_hf_prefix_reuse(*a, prefix=prefix)}
    base = {"bench": "generate_tree", "workload": "tree", "batch": TREE_ROWS, "levels": TREE_LEVELS, "own": TREE_OWN,
            "layers": args.layers, "new_tokens": args.new_tokens, "common_prefix": prefix}
    _time_peers(args, writer, model, runners, ids, mask, base, out_of_memory, rows)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per peer and point; the run with the median total is reported")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument(
        "--peers", nargs="+",
        default=["cascade_compiled", "cascade", "cascade_generate", "hf_prefix_reuse", "sdpa_compiled", "sdpa",
                 "generate_batch_defaults", "generate_batch_best"],
        help="*_compiled: generate()'s auto-compile (torch.compile, CUDA graphs) with a fixed-size cache; each "
        "compiled peer, cascade_generate (the default path, which compiles on CUDA) and generate_batch_*, runs once "
        "untimed per batch size first (compilation and graph capture, reported as warmup_s)",
    )
    parser.add_argument("--skip-after-oom", action="store_true", default=True)
    parser.add_argument(
        "--workload", nargs="+", default=["shared"], choices=["shared", "tree", "stream", *SAMPLING_WORKLOADS],
        help="shared: B rows sharing --prefix (the grid above); tree: 64 rows, a two-level tree (--peers); nsamples "
        "/ grpo: sampling workloads (docstring)",
    )
    parser.add_argument("--sampling-peers", nargs="+", default=["sdpa", "hf_prefix_reuse", "cascade"],
                        choices=["sdpa", "hf_prefix_reuse", "cascade", *CB_PEERS], help="peers of nsamples / grpo")
    parser.add_argument("--stream-peers", nargs="+", default=["cascade_generate", "hf_prefix_reuse", "sdpa"],
                        choices=[*CASCADE_GENERATE_PEERS, "hf_prefix_reuse", "sdpa", *CB_PEERS],
                        help="peers of --workload stream")
    parser.add_argument("--stream-passes", type=int, default=1,
                        help="--workload stream: run the stream this many times in one process (pass 0 is cold)")
    parser.add_argument("--stream-process-per-peer", action="store_true",
                        help="--workload stream: run each peer in a new process of its own (each pays its own "
                        "first-call costs), one after another, and compare their pass-0 totals")
    parser.add_argument("--peer-budget-s", type=float, default=None,
                        help="--workload stream: a peer starts no further batch of a pass after this many seconds "
                        "(its record says how many it ran), so that a slow peer leaves time to the others")
    parser.add_argument("--output", default=None, help="JSON-lines file (default benchmarks/results/generate.jsonl)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU.")
    signal.signal(signal.SIGTERM, _interrupt)  # a limit's SIGTERM: the stream's batches so far are written
    if args.stream_process_per_peer:
        stream_process_per_peer(args, argv if argv is not None else sys.argv[1:])
        return

    runners = {
        "cascade": run_cascade,
        **{peer: functools.partial(run_cascade_generate, options=options)
           for peer, options in CASCADE_GENERATE_PEERS.items()},
        "cascade_compiled": lambda *a: run_cascade(*a, compiled=True),
        "sdpa": run_sdpa,
        "sdpa_compiled": lambda *a: run_sdpa(*a, compiled=True),
        "hf_prefix_reuse": lambda *a: run_hf_prefix_reuse(*a, prefix=args.prefix),
        **{peer: functools.partial(run_generate_batch, config=config) for peer, config in CB_PEERS.items()},
    }
    unknown = set(args.peers) - set(runners)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {sorted(runners)}")
    writer = ResultWriter("generate.jsonl", args.output)
    # Before any kernel is built: whether this process starts with Triton's disk cache empty (a machine-cold run)
    args.triton_cache_files_at_start, args.triton_builds = triton_cache_files(), TritonBuilds()
    model = build_model(args.layers)
    sampling = [w for w in args.workload if w in SAMPLING_WORKLOADS]
    if sampling:
        main_sampling(argparse.Namespace(**{**vars(args), "workload": sampling}), writer, model)
    if "stream" in args.workload:
        main_stream(args, writer, model)
    if "shared" not in args.workload:
        args.batches = []  # the tree alone: no shared-prefix grid
        if "tree" not in args.workload:
            return
    vocab = model.config.vocab_size
    workload = dict(layers=args.layers, prefix=args.prefix, suffix=args.suffix, new_tokens=args.new_tokens)
    # Warm-up with the timed shapes (Triton specialises kernels on integer arguments: ==1, %16), so that no
    # kernel compilation or library heuristic lands inside a timed run.
    ids, mask = make_batch(min(args.batches or [4]), args.prefix, args.suffix, vocab)
    for peer in ("cascade", "sdpa"):
        if peer in args.peers:
            try:
                runners[peer](model, ids, mask, args.new_tokens)
            except torch.OutOfMemoryError:
                pass
    reset_memory()
    check = first_logits_check(model, *make_batch(4, args.prefix, args.suffix, vocab))
    writer.write({"bench": "generate_check", **workload, **check})
    gate(check, "shared")

    out_of_memory, rows = set(), []
    for batch in args.batches:
        ids, mask = make_batch(batch, args.prefix, args.suffix, vocab)
        base = {"bench": "generate", "batch": batch, **workload}
        _time_peers(args, writer, model, runners, ids, mask, base, out_of_memory, rows)
    if "tree" in args.workload:
        main_tree(args, writer, model, runners, set(), rows)
    print(f"\n{'peer':>17} {'B':>4} {'total s':>8} {'prefill s':>9} {'ms/step':>8} {'tok/s':>8} {'peak GiB':>8}  status")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(
            f"{r['peer']:>17} {r['batch']:>4} {f('total_s', '8.2f')} {f('prefill_s', '9.2f')} "
            f"{f('decode_ms_per_step', '8.1f')} {f('tokens_per_s', '8.0f')} {f('peak_gib', '8.1f')}  {r['status']}"
        )


if __name__ == "__main__":
    main()
