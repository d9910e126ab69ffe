"""Issue 48, item 4: does a call of a new layout stall once the process has moved up to the compiled tier?

ONE process, one GPU, a Llama-3-8B-shaped model (32 layers, bf16, random weights), hf_cascade's default
one-argument call (``model.generate(ids, attention_mask=mask, max_new_tokens=64,
custom_generate=hf_cascade.generate)``, sampling where it says samples), the workloads one after another:

1. ``samples32``: 1 prompt of 4,096 tokens x 32 samples, calls for at least ``--phase1-s`` seconds and until the
   compiled tier is ready (at most ``--phase1-max-s``): the process moves up.
2. ``tree64``: 64 rows, 1,024 tokens shared by all, 4 documents of 2,048 each shared by 16, 64 own tokens each,
   greedy; every call's seconds until it settles.
3. ``prompts16x8``: 16 prompts of 1,024 tokens x 8 samples (128 rows); every call until it settles.
4. ``stream``: ``--stream-batches`` (>= 60) batches of ``--stream-layouts`` distinct layouts (1-128 rows, 1-3 prefix
   levels, ragged own tokens, greedy and sampling; seeded; prompts <= ~1.3K tokens so that sdpa stays affordable),
   each call timed; then each layout's steady time (a repeat once the background builds are done; the least of it
   and the layout's later calls in the stream), and generate() with sdpa for a subset of layouts.

Per call: seconds (host clock, CUDA synchronised), the tier it ran (``hf_cascade.tiers.tier_report``), whether it
ran layers uncompiled (shapes new to the compiled tier) and whether a background build ran beside it, and
(``variants_vs_grid``) each Triton kernel the call built, with the arguments in which it differs from the closest
variant the background build's children had built before it (``variant_log.py``: every process of the run logs the
variants it builds; ``--no-variant-log`` turns that off). Per workload:
first call / steady (the median of the last 3 calls). Stream: the total against the sum of the steady times, each
call against its layout's steady time (issue 48's targets: first calls <= 1.5x steady; no stream call above 2x; the
stream within 1.2x of the sum). ``--old-policy``: calls compile new shapes themselves (as before issue 48), for an
A/B run. ``--budget-s``: no new work starts once it could not finish in time (the records written so far stay).
Records (``benchmarks/results/stall.jsonl``, and ``$OUT/stall.jsonl`` on the device machine): one per workload, then
a summary, each with the GPU, the versions and the git SHA.

    python benchmarks/bench_stall.py --budget-s 450                       # one H100, < 8 minutes with the build
    python benchmarks/bench_stall.py --tiny                               # CPU smoke run (tiny model, < 60 s)
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ResultWriter  # noqa: E402
import variant_log  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade import tier_build, tiers  # noqa: E402
from hf_cascade.inputs import left_padded  # noqa: E402

TREE = ([(1, 1024), (4, 2048)], 64, 64)  # levels (groups, tokens each), own tokens, rows (as bench_generate's tree)
ROW_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 31, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def build_model(tiny: bool, device: str):
    """Llama-3-8B's shape (random bf16 weights; ``tiny``: 2 small layers, fp32) with the cascade attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    size = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2) if tiny else dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8)
    config = LlamaConfig(**size, max_position_embeddings=16384, rope_theta=500000.0, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade",
                                                 dtype=torch.float32 if tiny else torch.bfloat16)
    model.generation_config.eos_token_id = None  # random weights: every row makes all its new tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def tree_batch(levels, own, rows: int, vocab: int, seed: int, device, ragged: bool = False):
    """``rows`` rows sharing a tree (per level (groups, tokens each); group g of a level holds rows [g * rows /
    groups, (g + 1) * rows / groups)), then each row's own tokens (``ragged``: 1-``own`` of them, left-padded)."""
    g = torch.Generator().manual_seed(seed)
    segments = [[torch.randint(3, vocab, (tokens,), generator=g) for _ in range(groups)] for groups, tokens in levels]
    lengths = torch.randint(1, own + 1, (rows,), generator=g) if ragged else torch.full((rows,), own)
    parts = [torch.cat([segments[i][r * groups // rows] for i, (groups, _) in enumerate(levels)]
                       + [torch.randint(3, vocab, (int(lengths[r]),), generator=g)]) for r in range(rows)]
    ids, mask = left_padded(parts)
    return ids.to(device), mask.to(device)


class Budget:
    """Seconds left of ``--budget-s`` (from the process's start), and whether work of ``seconds`` still fits."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.longest = 0.0  # the longest call so far: what the next one may take

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - STARTED)

    def allows(self, seconds: float = 0.0) -> bool:
        return self.left() > max(seconds, 2.0 * self.longest, 3.0)


class CompileMeter:
    """What each call compiled: Triton kernels built or loaded from the disk cache (``JITFunction._do_compile``: a
    miss of Triton's in-memory cache; seconds > 0.05 is a build, below a load), dynamo's graphs, CUDA graphs
    recorded. Where Triton is missing, only the rest."""

    def __init__(self, model):
        self.model = model
        self.triton: list[tuple[str, float]] = []
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = JITFunction._do_compile
        meter = self

        def timed(fn_self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(fn_self, *args, **kwargs)
            finally:
                meter.triton.append((getattr(fn_self, "__name__", "?"), time.perf_counter() - t))

        JITFunction._do_compile = timed

    def mark(self) -> tuple:
        from hf_cascade.decode.captured_step import recorded_steps

        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        return len(self.triton), graphs, recorded_steps(self.model)["recorded"]

    def since(self, mark: tuple) -> dict:
        now = self.mark()
        new = self.triton[mark[0]:]
        built = [(name, round(s, 2)) for name, s in new if s > 0.05]
        return {"triton_misses": len(new), "triton_built": len(built), "triton_s": round(sum(s for _, s in new), 2),
                "triton_kernels": built, "dynamo_graphs": now[1] - mark[1], "cuda_graphs": now[2] - mark[2]}


def _short(value, limit: int) -> str:
    """A logged value for the results, at most ``limit`` characters (a list of frames joined by " < ")."""
    text = " < ".join(value) if isinstance(value, list) else str(value)
    return text[:limit]


class Runner:
    """The default one-argument call of one model, timed, with what the tiers say about it."""

    def __init__(self, model, budget: Budget, new_tokens: int, variant_path: str | None = None):
        self.model, self.budget, self.new_tokens = model, budget, new_tokens
        self.cuda = model.device.type == "cuda"
        self.calls = 0
        self.meter = CompileMeter(model)
        self.variants = None if variant_path is None else variant_log.LogReader(variant_path)

    def variants_built(self, since: float) -> list[dict]:
        """The Triton variants this process built since ``since`` (``time.time()``), each with how it differs from
        the closest variant of that kernel another process of the run (the background build's children: the rows
        child and the grid) had built before (``variant_log.closest_difference``; None: none of that kernel)."""
        if self.variants is None:
            return []
        self.variants.new_entries()
        entries = self.variants.entries
        mine = [e for e in entries if e["pid"] == os.getpid() and e["t"] >= since and e["s"] > 0.05]
        before = [e for e in entries if e["pid"] != os.getpid() and e["t"] < since]
        out = []
        for e in mine:
            nearest = variant_log.nearest_differences(e, before, 2)
            shown = [{k: [_short(x, 400 if k == "launched_from" else 120) for x in v] for k, v in diff.items()}
                     for diff in nearest]
            out.append({"name": e["name"], "s": e["s"], "differs": shown[0] if shown else None,
                        "launched_from": e.get("launched_from"),
                        "next_nearest_differs": sorted(shown[1]) if len(shown) > 1 else None})
        return out

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, ids, mask, sample: bool, samples: int = 1, seed: int = 0, sdpa: bool = False) -> dict:
        extra = {} if sdpa else {"custom_generate": hf_cascade.generate}
        if samples > 1:
            extra["num_return_sequences"] = samples
        before = tiers.tier_report(self.model)
        building = before["background_build"]["running"]
        grid = before["background_build"].get("grid_running", False)
        torch.manual_seed(seed)
        self.sync()
        mark = self.meter.mark()
        wall = time.time()
        t = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=self.new_tokens, do_sample=sample, **extra)
        self.sync()
        seconds = time.perf_counter() - t
        self.budget.longest = max(self.budget.longest, seconds)
        self.calls += 1
        after = tiers.tier_report(self.model)
        own = [name for name, _ in after["calls"][len(before["calls"]):] if not name.startswith("background")]
        return {"s": round(seconds, 3), "tier": None if sdpa else (own[-1] if own else "eager"),
                "missed": after["new_shapes"]["missed_calls"] > before["new_shapes"]["missed_calls"],
                "beside_build": building or after["background_build"]["running"],
                "beside_grid": grid or after["background_build"].get("grid_running", False), "call": self.calls,
                **self.meter.since(mark), "variants_vs_grid": self.variants_built(wall)}


def steady(calls: list[dict]) -> float:
    """The median of the last 3 calls' seconds."""
    return statistics.median(c["s"] for c in calls[-3:])


def settled(calls: list[dict], cuda: bool) -> bool:
    """At least 4 calls, the last 3 within 10% of their median, none beside a build, on the compiled tier (CUDA)."""
    if len(calls) < 4 or any(c["beside_build"] for c in calls[-3:]):
        return False
    if cuda and calls[-1]["tier"] != "compiled":
        return False
    mid = steady(calls)
    return all(abs(c["s"] - mid) <= 0.1 * mid for c in calls[-3:])


def repeat_until(runner: Runner, batch, sample: bool, samples: int, min_s: float, max_s: float, max_calls: int,
                 until_compiled: bool = False) -> list[dict]:
    """Call with ``batch`` again and again: at least ``min_s`` seconds (and, ``until_compiled``, until the compiled
    tier is ready), until it settles, at most ``max_s`` seconds / ``max_calls`` calls, within the budget."""
    calls, started = [], time.perf_counter()
    while len(calls) < max_calls and runner.budget.allows():
        calls.append(runner.call(*batch, sample=sample, samples=samples, seed=len(calls)))
        spent = time.perf_counter() - started
        ready = not runner.cuda or tiers.tier_report(runner.model)["ready"]["compiled"]
        if spent >= max_s or (spent >= min_s and (ready or not until_compiled) and (
                until_compiled or settled(calls, runner.cuda))):
            break
    return calls


def phase_record(name: str, calls: list[dict], **extra) -> dict:
    record = {"bench": "stall", "phase": name, "calls": calls, **extra}
    if calls:
        record.update(first_s=calls[0]["s"], steady_s=steady(calls), calls_n=len(calls),
                      first_over_steady=round(calls[0]["s"] / steady(calls), 2),
                      settled=settled(calls, calls[0]["tier"] not in (None, "eager")))
    return record


def stream_layouts(count: int, batches: int, seed: int, tiny: bool) -> tuple[list[dict], list[int]]:
    """``count`` distinct layouts (rows, levels, own tokens, ragged, greedy or sampling) and the order of a stream of
    ``batches`` batches over them: every layout once (shuffled), then repeats drawn at random."""
    rng = random.Random(seed)
    scale = 16 if tiny else 1
    layouts = []
    for i in range(count):
        rows = ROW_CHOICES[i * len(ROW_CHOICES) // count] if i < len(ROW_CHOICES) else rng.choice(ROW_CHOICES)
        depth = rng.choice((1, 2, 3))
        levels = [(1, rng.choice((256, 512, 768, 1024)) // scale)]
        groups = 1
        for _ in range(depth - 1):
            groups = min(rows, groups * rng.choice((2, 4)))
            levels.append((groups, rng.choice((64, 128, 256)) // scale))
        layouts.append({"layout": i, "rows": rows, "levels": levels, "own": rng.choice((8, 32, 64)),
                        "ragged": rng.random() < 0.5, "sample": rng.random() < 0.5})
    order = list(range(count))
    rng.shuffle(order)
    order += [rng.randrange(count) for _ in range(batches - count)]
    return layouts, order


def run_stream(runner: Runner, layouts: list[dict], order: list[int], vocab: int, device) -> list[dict]:
    calls = []
    for index, layout in enumerate(order):
        if not runner.budget.allows():
            break
        spec = layouts[layout]
        batch = tree_batch(spec["levels"], spec["own"], spec["rows"], vocab, 1000 + index, device, spec["ragged"])
        calls.append({**runner.call(*batch, sample=spec["sample"], seed=index), "layout": layout, "index": index})
    return calls


def steady_per_layout(runner: Runner, layouts, stream: list[dict], vocab: int, device) -> dict[int, float]:
    """Each layout's steady seconds: a repeat now (the builds done), or the least of its later calls in the stream."""
    if runner.cuda:
        tier_build.wait_for_build(runner.model, timeout=max(0.0, min(120.0, runner.budget.left() - 60.0)))
    seen: dict[int, list[float]] = {}
    for call in stream:
        seen.setdefault(call["layout"], []).append(call["s"])
    times = {layout: min(s[1:]) for layout, s in seen.items() if len(s) > 1}
    for layout in seen:
        if not runner.budget.allows():
            break
        spec = layouts[layout]
        batch = tree_batch(spec["levels"], spec["own"], spec["rows"], vocab, 5000 + layout, device, spec["ragged"])
        repeat = runner.call(*batch, sample=spec["sample"], seed=layout)["s"]
        times[layout] = min(times.get(layout, repeat), repeat)
    return times


def sdpa_subset(runner: Runner, layouts, times: dict[int, float], vocab: int, device, count: int) -> list[dict]:
    """generate() with sdpa (no custom_generate) for ``count`` layouts spread over the batch sizes, after one
    untimed sdpa call (sdpa's own first-call setup)."""
    chosen = sorted(times, key=lambda i: layouts[i]["rows"])
    chosen = [chosen[i * len(chosen) // count] for i in range(min(count, len(chosen)))]
    out = []
    runner.model.set_attn_implementation("sdpa")
    try:
        for n, layout in enumerate(chosen):
            spec = layouts[layout]
            batch = tree_batch(spec["levels"], spec["own"], spec["rows"], vocab, 5000 + layout, device,
                               spec["ragged"])
            if not runner.budget.allows((6.0 if n == 0 else 3.0) * times[layout] + 5.0):
                break  # (sdpa: a few times the cascade's seconds)
            if n == 0:
                runner.call(*batch, sample=spec["sample"], seed=layout, sdpa=True)
            call = runner.call(*batch, sample=spec["sample"], seed=layout, sdpa=True)
            out.append({"layout": layout, "rows": spec["rows"], "sdpa_s": call["s"], "cascade_steady_s": times[layout],
                        "speedup": round(call["s"] / times[layout], 2)})
    finally:
        runner.model.set_attn_implementation("cascade")
    return out


def stream_summary(stream: list[dict], times: dict[int, float], layouts) -> dict:
    rated = [c for c in stream if c["layout"] in times]
    for call in rated:
        call["over_steady"] = round(call["s"] / times[call["layout"]], 2)
    total = sum(c["s"] for c in rated)
    steady_sum = sum(times[c["layout"]] for c in rated)
    firsts = {}
    for call in rated:
        firsts.setdefault(call["layout"], call)
    return {
        "stream_batches": len(stream), "rated_batches": len(rated), "stream_total_s": round(total, 3),
        "sum_of_steady_s": round(steady_sum, 3), "total_over_steady": round(total / steady_sum, 3) if rated else None,
        "max_over_steady": max((c["over_steady"] for c in rated), default=None),
        "calls_over_2x": sum(c["over_steady"] > 2 for c in rated),
        "missed_calls": sum(c["missed"] for c in stream), "beside_build_calls": sum(c["beside_build"] for c in stream),
        "first_over_steady": {layout: c["over_steady"] for layout, c in sorted(firsts.items())},
        "steady_s": {layout: round(s, 3) for layout, s in sorted(times.items())},
        "layouts": layouts,
    }


def caches_state() -> dict:
    """File counts of the compile caches at the start (empty caches: the first compile is a cold one)."""
    from hf_cascade.tiers import _inductor_cache, _default_triton_cache

    counts = {}
    for name, folder in (("triton", os.environ.get("TRITON_CACHE_DIR") or _default_triton_cache()),
                         ("inductor", _inductor_cache())):
        counts[name] = sum(len(files) for _, _, files in os.walk(folder)) if folder and os.path.isdir(folder) else 0
    return counts


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, short phases")
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no work past this many seconds")
    parser.add_argument("--phase1-s", type=float, default=40.0)
    parser.add_argument("--phase1-max-s", type=float, default=110.0)
    parser.add_argument("--stream-batches", type=int, default=64)
    parser.add_argument("--stream-layouts", type=int, default=24)
    parser.add_argument("--sdpa-layouts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--old-policy", action="store_true",
                        help="calls compile shapes new to the compiled tier themselves (before issue 48)")
    parser.add_argument("--output", default=None, help="results file (default benchmarks/results/stall.jsonl)")
    parser.add_argument("--no-variant-log", action="store_true",
                        help="do not log the Triton variants every process builds (benchmarks/variant_log.py)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.phase1_s, args.phase1_max_s = min(args.phase1_s, 1.0), min(args.phase1_max_s, 3.0)
        args.stream_batches, args.stream_layouts = min(args.stream_batches, 8), min(args.stream_layouts, 5)
        args.sdpa_layouts, args.new_tokens = min(args.sdpa_layouts, 2), min(args.new_tokens, 8)
        args.budget_s = min(args.budget_s, 55.0)
    return args


def start_variant_log() -> str | None:
    """Every process of the run logs the Triton variants it builds to one file (this one through the hook, the
    background build's children through ``variant_hook/sitecustomize.py`` on their ``PYTHONPATH``); returns the
    file, or None without Triton."""
    path = os.path.join(tempfile.gettempdir(), f"stall_variants_{os.getpid()}.jsonl")
    if not variant_log.install(path):
        return None
    os.environ[variant_log.ENV] = path
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variant_hook")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p)
    return path


def main(argv=None) -> int:
    args = parse(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.old_policy:
        tiers.NEW_SHAPES_COST_S = 0.0  # every call may compile what it needs (tiers.shape_policy)
    if args.tiny and args.output is None:  # a smoke run's records stay out of the results
        args.output = os.path.join(tempfile.gettempdir(), "stall_tiny.jsonl")
    writer = ResultWriter("stall.jsonl", args.output)
    base = {"bench": "stall", "device": device, "tiny": args.tiny, "old_policy": args.old_policy,
            "background": tier_build.describe(), "caches_at_start": caches_state()}
    t = time.perf_counter()
    model = build_model(args.tiny, device)
    vocab = model.config.vocab_size
    base["model_build_s"] = round(time.perf_counter() - t, 2)
    budget = Budget(args.budget_s)
    runner = Runner(model, budget, args.new_tokens, variant_path=None if args.no_variant_log else start_variant_log())
    scale = 16 if args.tiny else 1
    results = {}
    one = tree_batch([(1, 4096 // scale)], 0, 1, vocab, 1, device)
    cap = 3.0 if args.tiny else 60.0  # seconds of calls at most for the tree and the 128 rows
    phases = [("samples32", one, True, 32, args.phase1_s, args.phase1_max_s, 200, True),
              ("tree64", tree_batch([(g, n // scale) for g, n in TREE[0]], TREE[1], TREE[2], vocab, 2, device),
               False, 1, 0.0, cap, 20, False),
              ("prompts16x8", tree_batch([(16, 1024 // scale)], 0, 16, vocab, 3, device), True, 8, 0.0, cap, 15,
               False)]
    for name, batch, sample, samples, min_s, max_s, max_calls, until in phases:
        calls = repeat_until(runner, batch, sample, samples, min_s, max_s, max_calls, until)
        results[name] = phase_record(name, calls, rows=batch[0].shape[0] * samples, **base)
        writer.write(results[name])
        print(name, [(c["s"], c["tier"], c["triton_built"], c["triton_s"], c["dynamo_graphs"]) for c in calls], flush=True)
    layouts, order = stream_layouts(args.stream_layouts, args.stream_batches, seed=48, tiny=args.tiny)
    stream = run_stream(runner, layouts, order, vocab, device)
    print("stream", [(c["layout"], c["s"], c["tier"], c["missed"], c["triton_built"], c["triton_s"], c["dynamo_graphs"])
                     for c in stream], flush=True)
    times = steady_per_layout(runner, layouts, stream, vocab, device)
    summary = {**base, "phase": "stream", "calls": stream, **stream_summary(stream, times, layouts)}
    summary["sdpa"] = sdpa_subset(runner, layouts, times, vocab, device, args.sdpa_layouts)
    writer.write(summary)
    targets = {name: results[name].get("first_over_steady") for name in ("tree64", "prompts16x8")}
    final = {**base, "phase": "summary", "first_over_steady": targets,
             "stream_total_over_steady": summary["total_over_steady"],
             "stream_max_over_steady": summary["max_over_steady"], "stream_calls_over_2x": summary["calls_over_2x"],
             "samples32_steady_s": results["samples32"].get("steady_s"), "tiers": tiers.tier_report(model),
             "process_s": round(time.perf_counter() - STARTED, 1), "budget_left_s": round(budget.left(), 1)}
    writer.write(final)
    print({k: final[k] for k in ("first_over_steady", "stream_total_over_steady", "stream_max_over_steady",
                                 "stream_calls_over_2x", "process_s")}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
