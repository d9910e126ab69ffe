"""Write docs/benchmarks.md's tables from benchmarks/results/*.jsonl, and print the README's headline table.

    python benchmarks/make_docs.py             # rewrites docs/benchmarks.md (the text between the markers)
    python benchmarks/make_docs.py --headline  # prints the README's headline table (tests/test_readme.py checks it;
                                               # no commits there: docs/benchmarks.md's copy names them)

Only numbers come from here; the prose around them is hand-written in docs/benchmarks.md, outside the markers
``<!-- generated: start -->`` / ``<!-- generated: end -->``. Every figure there names its GPU and commit (the
records' ``gpu`` and ``git_sha``); the README's headline table names the GPU only. No GPU is needed.
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- generated: start -->", "<!-- generated: end -->"

# The one-argument call's peer name per bench (earlier runs of `generate` named the shared_prefix_inputs path
# "cascade"; the one-argument call is "cascade_generate" there).
ONE_ARG = {"generate": "cascade_generate", "generate_sampling": "cascade"}
WORKLOADS = [  # (bench, workload, batch, label)
    ("generate_sampling", "nsamples", None, "1 prompt of 4,096 tokens x 32 samples, 64 new (sampling)"),
    ("generate_sampling", "grpo", None, "16 prompts (256 shared + 512 own) x 8 samples, 128 new (sampling)"),
    ("generate", None, 32, "32 rows sharing 4,096 tokens + 64 own, 64 new (greedy)"),
]


def load(name: str) -> list[dict]:
    path = RESULTS / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def runs(records: list[dict], bench: str, workload: str | None, batch: int | None) -> "OrderedDict[str, dict]":
    """``git_sha -> {peer: record}`` for one workload, in file order (oldest first); the last record of a peer wins."""
    out: OrderedDict[str, dict] = OrderedDict()
    for r in records:
        if r.get("bench") != bench or r.get("status") != "ok":
            continue
        if workload is not None and r.get("workload") != workload:
            continue
        if batch is not None and r.get("batch") != batch:
            continue
        out.setdefault(r["git_sha"], {})[r["peer"]] = r
    return out


def _gib(r: dict | None) -> str:
    return f"{r['kv_gib']:.2f} GiB" if r and r.get("kv_gib") is not None else "–"


def _call(r: dict | None) -> str:
    return f"{r['total_s']:.2f} s" if r else "–"


def headline_rows(records: list[dict]) -> list[dict]:
    """Per workload, the newest run with the one-argument call, transformers' prefix-reuse recipe and sdpa."""
    rows = []
    for bench, workload, batch, label in WORKLOADS:
        for sha, peers in reversed(runs(records, bench, workload, batch).items()):
            one = peers.get(ONE_ARG[bench])
            if one and "hf_prefix_reuse" in peers and "sdpa" in peers:
                rows.append(dict(label=label, sha=sha, cascade=one, recipe=peers["hf_prefix_reuse"],
                                 sdpa=peers["sdpa"]))
                break
    return rows


def headline_table(records: list[dict], shas: bool = False) -> str:
    """The headline table: the README's without commits (``shas=False``), docs/benchmarks.md's with each row's
    commit (``shas=True``)."""
    rows = headline_rows(records)
    gpus = sorted({r["cascade"]["gpu"] for r in rows})
    lines = [
        f"| {' / '.join(gpus)}, Llama-3-8B shape, bf16 | sdpa | transformers' prefix-reuse recipe | hf_cascade "
        "| vs sdpa | KV: sdpa → hf_cascade |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, h, s = r["cascade"], r["recipe"], r["sdpa"]
        kv_flat = s.get("kv_gib") or h.get("kv_gib")
        label = f"{r['label']} (`{r['sha'][:7]}`)" if shas else r["label"]
        lines.append(
            f"| {label} | {_call(s)} | {_call(h)} | **{_call(c)}** "
            f"| **{s['total_s'] / c['total_s']:.1f}x** | {kv_flat:.2f} → {c['kv_gib']:.2f} GiB |"
        )
    return "\n".join(lines)


CB_WORKLOADS = [  # (workload in peers_gpu.jsonl, label)
    ("shared", "32 rows sharing 4,096 tokens + 64 own, 64 new (greedy)"),
    ("nsamples", "1 prompt of 4,096 tokens x 32 samples, 64 new (sampling)"),
    ("tree", "64 rows: 1,024 shared by all, 4 documents of 2,048 shared by 16 each"),
    ("grpo", "16 prompts (256 shared + 512 own) x 8 samples, 128 new (sampling)"),
]


def cb_table(records: list[dict], shas: bool = False) -> str:
    """hf_cascade against transformers' continuous batching (``generate_batch``, block sharing on: its defaults and
    its guide's fast settings), with sdpa and the prefix-reuse recipe: per workload the newest run of
    ``bench_peers_gpu.py`` (all peers in one process). hf_cascade runs its default options with the background
    build off (its first tier); a call is the warm call, the first call in brackets where it was timed apart. With
    ``shas`` (docs/benchmarks.md): the newest run per workload on each GPU, each row's commit named."""
    if shas:  # one table, the GPUs' newest runs after one another
        gpus = sorted({r.get("gpu") for r in records if r.get("workload") in dict(CB_WORKLOADS) and r.get("gpu")})
        tables = [_cb_table([r for r in records if r.get("gpu") == gpu], True).split("\n") for gpu in gpus]
        body = [line for table in tables for line in table[2:] if line.startswith("|")]
        notes = [line for table in tables for line in table[2:] if line.startswith("†")]
        return "\n".join((tables[0][:2] if tables else []) + body + (["", *notes] if notes else []))
    return _cb_table(records, False)


def _cb_table(records: list[dict], shas: bool) -> str:
    lines = ["| one run, all peers in it (GPU) | sdpa | prefix-reuse recipe | `generate_batch` defaults | `generate_batch` "
             "CUDA graphs + async | hf_cascade | vs best `generate_batch` | KV GiB: `generate_batch` in use (pool) "
             "→ hf_cascade |", "|---|---|---|---|---|---|---|---|"]
    loaded = None
    for workload, label in CB_WORKLOADS:
        peers: dict = {}
        for r in records:
            if (r.get("workload") == workload and r.get("status") and not r.get("tiny") and "peer" in r
                    and r["peer"] != "all"):  # ("all": a workload the run skipped)
                if peers and r["git_sha"] != next(iter(peers.values()))["git_sha"]:
                    peers = {}
                peers[r["peer"]] = r
        need = ("sdpa", "hf_prefix_reuse", "generate_batch_defaults", "generate_batch_best", "cascade_generate")
        if not all(k in peers for k in need) or any(peers[k]["status"] != "ok" for k in need[2:]):
            continue
        s, h, d, b, c = (peers[k] for k in need)

        def call(r):
            if r["status"] != "ok":  # a peer that failed in the run (the recipe out of memory on the tree)
                return r["status"]
            first = r.get("first_call_s")
            return f"{r['total_s']:.2f} s" + (f" ({first:.1f})" if first and r.get("calls", 2) > 1 else "")

        best = min(d["total_s"], b["total_s"])
        gpu = str(c.get("gpu", "")).replace("NVIDIA ", "").split(" ")[0]
        sha = (f", {gpu}" if gpu else "") + (f" (`{c['git_sha'][:7]}`)" if shas else "")
        if c.get("host_load"):  # a run beside other jobs on the same host: said under the table
            sha += " †"
            loaded = c["host_load"]
        lines.append(f"| {label}{sha} | {call(s)} | {call(h)} | {call(d)} | {call(b)} | **{call(c)}** | "
                     f"**{best / c['total_s']:.1f}x** | {d['kv_used_peak_gib']:.2f} ({d['kv_pool_gib']:.1f}) → "
                     f"{c['kv_gib']:.2f} |")
    if loaded:
        lines += ["", f"† {loaded}."]
    return "\n".join(lines)


def _built(call: dict) -> str:
    """What a stall-bench call compiled, where the run recorded it: `` (3 Triton kernels built, 3.6 s; beside the
    grid)``."""
    parts = []
    if call.get("triton_built"):
        n = call["triton_built"]
        parts.append(f"{n} Triton kernel{'s' if n != 1 else ''} built, {call['triton_s']:.1f} s")
    if call.get("dynamo_graphs"):
        n = call["dynamo_graphs"]
        parts.append(f"{n} graph{'s' if n != 1 else ''} compiled")
    if parts and call.get("beside_grid"):
        parts.append("beside the grid")
    return f" ({'; '.join(parts)})" if parts else ""


def stall_table(records: list[dict]) -> str:
    """The newest full GPU run of bench_stall.py (one that reached its stream) with sdpa in the same run: one process,
    workloads one after another, then a stream of layouts; then a line for each newer full run, and the newest run
    that stopped before its stream."""
    gpu = [r for r in records if not r.get("tiny") and r.get("device") == "cuda"]
    full = [r for r in gpu if r.get("phase") == "summary" and r.get("stream_total_over_steady") is not None]
    with_sdpa = [r for r in full if any(s.get("phase") == "stream" and s.get("sdpa") and s["git_sha"] == r["git_sha"]
                                        for s in gpu)]
    main_run = (with_sdpa or full or [None])[-1]
    if main_run is None:
        return ""
    sha = main_run["git_sha"]
    runs_ = [r for r in gpu if r["git_sha"] == sha]
    run = {r["phase"]: r for r in runs_ if r["git_sha"] == sha}
    summary = run.get("summary", {})
    caches = summary.get("caches_at_start") or {}
    empty = "empty compile caches" if not any(caches.values()) else f"compile cache files at the start: {caches}"
    lines = [f"{runs_[-1]['gpu']}, torch {runs_[-1]['torch']}, git `{sha[:7]}`, Llama-3-8B shape, bf16, default options, "
             f"one process, {empty}. Each workload's calls in order (seconds, tier):", ""]
    for phase in ("samples32", "tree64", "prompts16x8"):
        if phase in run:
            calls = run[phase]["calls"]
            shown = ", ".join(f"{c['s']:.2f} {c['tier']}" + _built(c) for c in calls[:6])
            lines.append(f"* `{phase}` ({run[phase]['rows']} rows, {len(calls)} calls): {shown}"
                         + (", ..." if len(calls) > 6 else ""))
    if summary:
        lines += ["", "First call over steady: " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                             summary.get("first_over_steady", {}).items())
                  + f". Stream of {len(run.get('stream', {}).get('calls', []))} calls of varied layouts: whole "
                  f"stream {summary.get('stream_total_over_steady', 0):.2f}x the sum of the layouts' steady times, "
                  f"{summary.get('stream_calls_over_2x', 0)} calls over 2x their steady time (worst "
                  f"{summary.get('stream_max_over_steady', 0):.1f}x)."]
    stream = run.get("stream", {}).get("calls") or []
    slow = [c for c in stream if c.get("over_steady", 0) > 2]
    if slow:
        lines += ["", "Stream calls over 2x their steady time: " + ", ".join(
            f"layout {c['layout']} {c['s']:.2f} s ({c['over_steady']:.1f}x)" + _built(c) for c in slow) + "."]
    build = summary.get("tiers", {}).get("background_build", {})
    grid = (build.get("prewarm") or {}).get("grid")
    if grid:
        after = grid.get("seconds_after_rows", grid.get("seconds"))
        lines += ["", f"The background build: the call's rows in {build.get('seconds')} s; the grid's "
                  f"{grid.get('done')} of {grid.get('batches')} runs in {grid.get('processes', 1)} children, done "
                  f"{after} s after the rows."]
    sdpa = run.get("stream", {}).get("sdpa") or []
    if sdpa:
        lines += ["", "generate() with sdpa in the same run, on " + f"{len(sdpa)} of the stream's layouts: "
                  + ", ".join(f"{r['rows']} rows {r['sdpa_s']:.2f} s against {r['cascade_steady_s']:.2f} s"
                              for r in sdpa) + "."]
    if runs_[-1].get("host_load"):
        lines += ["", f"Host: {runs_[-1]['host_load']}."]
    for newer in full[full.index(main_run) + 1:]:
        stream_calls = next((r.get("calls") or [] for r in gpu
                             if r.get("phase") == "stream" and r["git_sha"] == newer["git_sha"]), [])
        lines += ["", _newer_full_stall(newer, [c for c in stream_calls if c.get("over_steady", 0) > 2])]
    lines += _newer_partial_stall(records, full[-1])
    return "\n".join(lines)


def _newer_full_stall(summary: dict, slow: list[dict]) -> str:
    """One line for a full run newer than the one :func:`stall_table` shows (one without sdpa in the run); ``slow``:
    its stream calls over 2x their steady time."""
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in summary.get("first_over_steady", {}).items())
    build = summary.get("tiers", {}).get("background_build", {})
    grid = (build.get("prewarm") or {}).get("grid") or {}
    note = summary.get("run_note") or summary.get("host_load")
    return (f"A newer run (git `{summary['git_sha'][:7]}`, {summary['gpu']}, without sdpa): first call over steady "
            f"{ratios}; the stream {summary['stream_total_over_steady']:.2f}x the steady sum, "
            f"{summary.get('stream_calls_over_2x', 0)} calls over 2x (worst {summary['stream_max_over_steady']:.1f}x"
            + "".join(f"; layout {c['layout']} {c['s']:.2f} s" + _built(c) for c in slow) + "); "
            f"the background build's rows in {build.get('seconds')} s, the grid's {grid.get('done')} of "
            f"{grid.get('batches')} runs in {grid.get('processes')} children." + (f" {note}." if note else ""))


def _newer_partial_stall(records: list[dict], full_summary: dict) -> list[str]:
    """Lines for the newest GPU run that stopped before its stream, where it is newer than the full run shown."""
    gpu = [r for r in records if not r.get("tiny") and r.get("device") == "cuda"]
    partial = [r for r in gpu if r.get("phase") == "summary" and r.get("stream_total_over_steady") is None]
    if not partial or gpu.index(partial[-1]) < gpu.index(full_summary):
        return []
    sha = partial[-1]["git_sha"]
    run = {r["phase"]: r for r in gpu if r["git_sha"] == sha}
    shown = "; ".join(f"`{phase}` " + ", ".join(f"{c['s']:.2f}" + _built(c) for c in run[phase]["calls"][:3])
                      for phase in ("tree64", "prompts16x8") if phase in run)
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in partial[-1].get("first_over_steady", {}).items())
    return ["", f"A newer run without the stream (git `{sha[:7]}`, {run['summary']['gpu']}): {shown}. First call over "
            f"steady: {ratios}." + (f" Host: {partial[-1]['host_load']}." if partial[-1].get("host_load") else "")]


def history_table(records: list[dict], bench: str, workload: str | None, batch: int | None) -> str:
    lines = [
        "| commit | date | GPU | torch / transformers | hf_cascade (one argument): call / ms per step / KV "
        "| prefix-reuse recipe | sdpa | vs sdpa |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sha, peers in runs(records, bench, workload, batch).items():
        one = peers.get(ONE_ARG[bench]) or peers.get("cascade")
        if one is None:
            continue
        s, h = peers.get("sdpa"), peers.get("hf_prefix_reuse")
        path = "" if one["peer"] == ONE_ARG[bench] else " (via `shared_prefix_inputs`)"
        ratio = f"{s['total_s'] / one['total_s']:.1f}x" if s else "–"
        lines.append(
            f"| `{sha[:7]}` | {one['date'][:10]} | {one['gpu']} | {one['torch']} / {one['transformers']} "
            f"| {_call(one)} / {one['decode_ms_per_step']:.1f} ms / {_gib(one)}{path} | {_call(h)} | {_call(s)} "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def kernels_table(records: list[dict]) -> str:
    points = [r for r in records if r.get("bench") == "decode_step" and r.get("form") == "fused"]
    if not points:
        return "(no records)"
    sha = points[-1]["git_sha"]
    bw = next((r["gbs"] for r in records if r.get("bench") == "copy_bandwidth" and r["git_sha"] == sha), None)
    lines = [
        f"{points[-1]['gpu']}, torch {points[-1]['torch']}, triton {points[-1]['triton']}, bf16, d=128, commit "
        f"`{sha[:7]}`" + (f"; copy bandwidth {bw / 1000:.2f} TB/s measured in the same run" if bw else "") + ".",
        "",
        "| heads q/kv | B | P | S | cascade ms | SDPA ms (KV per row) | speedup | % of copy BW (unique bytes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in points:
        if r["git_sha"] != sha or not r.get("check_ok"):
            continue
        sdpa = r.get("sdpa_ms")
        sdpa_cell = f"{sdpa:.3f}" if sdpa else r.get("sdpa_status", "–")
        speedup = f"{sdpa / r['cascade_ms']:.1f}x" if sdpa else "–"
        lines.append(
            f"| {r['heads']} | {r['batch']} | {r['prefix']} | {r['suffix']} | {r['cascade_ms']:.3f} "
            f"| {sdpa_cell} | {speedup} | {r['pct_of_copy']:.0f} |"
        )
    return "\n".join(lines)


def generated() -> str:
    gen = load("generate.jsonl")
    parts = [
        "## Headline (newest run per workload with all three peers)",
        "",
        headline_table(gen, shas=True),
        "",
        "## Every run of the end-to-end workloads (`benchmarks/results/generate.jsonl`)",
        "",
        "Each row is one run with all of its peers in one process; the call is the median of its timed calls where",
        "the run made several (`total_s_runs`).",
    ]
    for bench, workload, batch, label in WORKLOADS:
        parts += ["", f"### {label}", "", history_table(gen, bench, workload, batch)]
    parts += ["", "## Against transformers' continuous batching (`benchmarks/results/peers_gpu.jsonl`)", "",
              cb_table(load("peers_gpu.jsonl"), shas=True)]
    stall = stall_table(load("stall.jsonl"))
    if stall:
        parts += ["", "## New layouts in a warm process (`benchmarks/results/stall.jsonl`)", "", stall]
    parts += ["", "## One decode step of attention (`benchmarks/results/kernels.jsonl`)", "",
              kernels_table(load("kernels.jsonl"))]
    scoring = scoring_table(load("scoring_gpu.jsonl"))
    if scoring:
        parts += ["", "## Shared-prefix scoring on a GPU (`benchmarks/results/scoring_gpu.jsonl`)", "", scoring]
    windows = windows_table(load("windows.jsonl"))
    if windows:
        parts += ["", "## Sliding windows: a Gemma-3-shaped model (`benchmarks/results/windows.jsonl`)", "", windows]
    return "\n".join(parts)


def scoring_table(records: list[dict]) -> str:
    """``hf_cascade.score`` against batched sdpa forwards (bench_scoring_gpu.py), the GPU runs of the full model;
    the latest run's bf16 agreement against float32."""
    rows = [r for r in records if r.get("bench") == "scoring_gpu" and not r.get("tiny") and r.get("device") == "cuda"]
    if not rows:
        return ""
    lines = ["| run | model | questions x choices | `hf_cascade.score` s | batched sdpa s | speedup | peak GiB (score / "
             "sdpa) | same picks |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['git_sha'][:7]}`, {r['gpu']} | Llama-3-8B shape, {r['layers']} layers, bf16, random | "
                     f"{r['questions']} x {r['choices']} (block {r['block']}, question {r['question']}, choice "
                     f"{r['choice_tokens']}) | {r['hf_cascade_s']:.2f} | {r['sdpa_batched_s']:.1f} | "
                     f"{r['speedup']:.1f}x | {r['hf_cascade_peak_gib']:.1f} / {r['sdpa_batched_peak_gib']:.1f} | "
                     f"{r['same_picks']:.1%} |")
    agreement = next((r for r in reversed(rows) if r.get("bf16_agreement")), None)
    if agreement:
        a = agreement["bf16_agreement"]
        lines += ["", f"bf16 against the same pairs scored in float32 (sdpa; the first {a['questions']} questions, "
                  f"`{agreement['git_sha'][:7]}`): the bar is no further from it than eager attention is.", "",
                  "| peer (bf16) | max abs error (nats) | mean abs error | picks as float32's |", "|---|---|---|---|"]
        for peer in ("sdpa", "eager", "hf_cascade"):
            e = a[peer]
            lines.append(f"| {peer} | {e['max_abs_err']:.3f} | {e['mean_abs_err']:.3f} | "
                         f"{e['same_picks_as_fp32']:.1%} |")
    sweep = next((r for r in reversed(rows) if r.get("min_shared_sweep")), None)
    if sweep:
        lines += ["", f"`min_shared_tokens` (which segments become shared levels), `{sweep['git_sha'][:7]}`: default "
                  f"(4) {sweep['hf_cascade_s']:.2f} s, " + ", ".join(
                      f"{k}: {v['seconds']:.2f} s ({v['forwards']} forwards, {v['tokens_run']:,} tokens)"
                      for k, v in sweep["min_shared_sweep"].items()) + "."]
    return "\n".join(lines)


def windows_table(records: list[dict]) -> str:
    """The newest GPU run of bench_windows.py: its peers, the KV a sliding layer could drop, the kernel point."""
    gpu = [r for r in records if not r.get("smoke") and r.get("gpu")]
    runs_by_sha = [r for r in gpu if r.get("git_sha") == gpu[-1]["git_sha"]] if gpu else []
    peers = [r for r in runs_by_sha if r.get("bench") == "windows_generate" and r.get("status") == "ok"]
    if not peers:
        return ""
    w = peers[0]
    lines = [f"{w['gpu']}, torch {w['torch']}, transformers {w['transformers']}; {w['model']}, {w['layers']} layers "
             f"({w['sliding_layers']} sliding, window {w['window']}), random {w['dtype'].replace('torch.', '')}; "
             f"{w['batch']} rows sharing {w['prefix']:,} tokens + {w['own']} own, {w['new_tokens']} new, greedy; "
             f"git `{w['git_sha'][:7]}`. Median of the calls after the first; `cascade_default` is the built-in tier the "
             f"default's first calls run (the background build is off in this benchmark).", "",
             "| peer | call s | first call s | peak GiB | KV GiB | tokens equal to sdpa's | sliding layers in the decode "
             "step |", "|---|---|---|---|---|---|---|"]
    for r in peers:
        lines.append(f"| {r['peer']} | {r['seconds']:.2f} | {r['first_call_s']:.2f} | {r['peak_gib']:.1f} | "
                     f"{r.get('kv_gib', 0):.2f} | {r.get('greedy_equal_sdpa_frac', 1.0):.1%} | "
                     f"{r.get('decode_step_bounded_path', '-')} |")
    drop = next((r for r in peers if "droppable_sliding_kv_gib" in r), None)
    if drop is not None:
        lines += ["", f"Shared-prefix KV of the sliding layers that no row can see any more: "
                      f"{drop['droppable_sliding_kv_gib']:.2f} GiB of {drop['kv_gib']:.2f} GiB held "
                      f"({drop['droppable_fraction_of_kv']:.0%}; reported, kept)."]
    kernel = next((r for r in runs_by_sha if r.get("bench") == "windows_kernels"), None)
    if kernel is not None:
        lines += ["", "Decode-step kernels (µs, CUDA graphs): " + ", ".join(
            f"{k} {v:.1f}" for k, v in kernel.items() if k.endswith("_us") and isinstance(v, float)) + "."]
    return "\n".join(lines)


def rendered_doc() -> str:
    text = DOC.read_text() if DOC.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return (f"{head}{START}\n<!-- written by benchmarks/make_docs.py from benchmarks/results/*.jsonl: "
            f"edit the script, not this part -->\n\n{generated()}\n\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headline", action="store_true", help="print the README's headline table and exit")
    parser.add_argument("--cb", action="store_true", help="print the README's continuous-batching table and exit")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = parser.parse_args(argv)
    if args.headline:
        print(headline_table(load("generate.jsonl")))
        return 0
    if args.cb:
        print(cb_table(load("peers_gpu.jsonl")))
        return 0
    text = rendered_doc()
    if args.check:
        if DOC.exists() and DOC.read_text() == text:
            return 0
        print(f"{DOC.relative_to(ROOT)} is out of date: run python benchmarks/make_docs.py")
        return 1
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
