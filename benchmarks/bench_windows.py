"""Sliding windows beyond the window (issue 33): a Gemma-3-shaped model, 32 rows sharing 4,096 tokens, against sdpa
and transformers' prefix-reuse recipe in one run; the window-bounded cascade kernels against the same kernels
without the bound.

Model: Gemma 3 4B's text decoder shape (``Gemma3TextConfig``: hidden 2560, 34 layers, 8 query / 4 KV heads of 256,
MLP 10240, vocabulary 262,208), random bf16 weights, the real layer pattern (five sliding layers of window 1,024 per
full one) and rotary bases. Workload: ``--batch`` rows sharing ``--prefix`` tokens, ``--own`` tokens of their own
each, ``--new-tokens`` new tokens, greedy.

Peers, each timed warm (the median of ``--repeats`` calls after an untimed one; peak memory of the timed calls):
  * ``sdpa``: ``model.generate()`` with ``attn_implementation="sdpa"`` (transformers' cache keeps a sliding layer's
    last window only);
  * ``hf_prefix_reuse``: transformers' documented prefix reuse (the shared prefix prefilled once into a
    ``DynamicCache``, ``copy.deepcopy``, ``batch_repeat_interleave(B)``, then ``generate(past_key_values=...)``);
  * ``cascade_default``: ``custom_generate=hf_cascade.generate`` with default options (tiers: its first calls run the
    built-in kernels; every call's tier is recorded);
  * ``cascade_graphs``: ``cascade_options={"decode_step": "graphs"}`` (hf_cascade's Triton kernels, decode steps
    recorded into CUDA graphs, nothing compiled);
  * ``cascade_compile_now``: ``cascade_options={"compile": "now"}`` (the compiled tier from the first call, untimed:
    ``first_call_s``; decode steps recorded with the decoder layers compiled).
The default peer runs before ``cascade_compile_now`` (a compiled tier, once ready, is the default's too).
Each record says whether the greedy tokens equal sdpa's, and which path the bounded (sliding) layers ran
(``bounded_paths``, :data:`hf_cascade.ops.bounded.BOUNDED_PATHS`: ``step:op/triton`` = the decode steps' bounded
layers on the Triton kernels inside the recorded / compiled step; ``step:torch`` = the PyTorch path), and the
cascade records the shared-prefix KV that no row can see any more in a sliding layer
(:func:`hf_cascade.windows.droppable_kv_bytes`: what dropping it would save).

Kernel point (``bench: windows_kernels``): one decode step's cascade attention at the workload's shapes (32 rows,
one 4,096-token level, GQA 8/4, head_dim 256, bf16), each call recorded 20 times into a CUDA graph and timed with
CUDA events: the unbounded op (what a full layer runs), the bounded op with window 1,024, and the bounded op with
bounds that cut nothing (the cost of the bound itself; target: within 10% of the unbounded kernels).

    python benchmarks/bench_windows.py                 # H100, ~4-6 minutes
    python benchmarks/bench_windows.py --layers 12     # a quicker look
    TRITON_INTERPRET=1 python benchmarks/bench_windows.py --smoke   # CPU: the plumbing on tiny shapes, fp32

Records go to ``benchmarks/results/windows.jsonl`` (``--smoke``: a temporary file unless ``--output``). Exits
nonzero when a peer fails, the bf16 logits check fails, or the decode steps of ``cascade_graphs`` /
``cascade_compile_now`` did not run their bounded layers on the Triton op.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import ResultWriter, cuda_time  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.ops.bounded import BOUNDED_PATHS  # noqa: E402

# Gemma 3 4B (google/gemma-3-4b-pt, text_config): the sizes that set the cost; rotary bases are the config's
# defaults (1M global, 10k local), as Gemma 3's.
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=1024, max_position_embeddings=131072)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
             max_position_embeddings=1024)


def build_model(shape: dict, layers: int, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**shape, "num_hidden_layers": layers}, bos_token_id=2, eos_token_id=None,
                              pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def make_batch(batch: int, prefix: int, own: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(batch)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    rows = torch.randint(3, vocab, (batch, own), generator=g)
    ids = torch.cat([shared.expand(batch, -1), rows], dim=1).to(device)
    return ids, torch.ones_like(ids)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def kv_nbytes(cache) -> int:
    """Bytes of a transformers cache's keys and values (each layer as it holds them: a sliding layer its window)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


GREEDY = dict(do_sample=False, pad_token_id=0)


def run_sdpa(model, ids, mask, new_tokens):
    model.set_attn_implementation("sdpa")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         return_dict_in_generate=True, **GREEDY)
    return out.sequences[:, ids.shape[1]:], {"kv_gib": kv_nbytes(out.past_key_values) / 2**30}


def run_prefix_reuse(model, ids, mask, new_tokens, prefix: int):
    """transformers' prefix reuse (its "re-use a cache" docs): the shared prefix prefilled once into a DynamicCache,
    copied, repeated for every row, then generate() on the full rows (their own tokens are prefilled per row)."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        prompt_cache = DynamicCache(config=model.config)
        model(ids[:1, :prefix], past_key_values=prompt_cache, use_cache=True)
    cache = copy.deepcopy(prompt_cache)
    cache.batch_repeat_interleave(ids.shape[0])
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, return_dict_in_generate=True, **GREEDY)
    return out.sequences[:, ids.shape[1]:], {"kv_gib": kv_nbytes(out.past_key_values) / 2**30}


def run_cascade(model, ids, mask, new_tokens, options):
    from hf_cascade.windows import droppable_kv_bytes

    model.set_attn_implementation("cascade")
    caches = []
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         custom_generate=hf_cascade.generate, cascade_caches=caches, cascade_options=options, **GREEDY)
    cache = caches[-1]
    prefix_bytes = sum(level.nbytes for level in cache.levels)
    dropped = droppable_kv_bytes(cache)
    extra = {"kv_gib": cache.nbytes / 2**30, "prefix_kv_gib": prefix_bytes / 2**30,
             "droppable_sliding_kv_gib": dropped / 2**30,
             "droppable_fraction_of_kv": dropped / max(cache.nbytes, 1),
             "prefix_levels": cache.num_levels, "fixed_buffers": cache.max_suffix_length is not None}
    return out[:, ids.shape[1]:], extra


def timed_calls(run, calls: int):
    """``calls`` calls of ``run()`` (seconds, synchronised); returns ([seconds], last tokens, last extra, peak GiB of
    the calls after the first)."""
    seconds, tokens, extra, peak = [], None, None, None
    for i in range(calls):
        if i == 1:
            reset_memory()
        sync()
        t0 = time.perf_counter()
        tokens, extra = run()
        sync()
        seconds.append(time.perf_counter() - t0)
    if calls > 1:
        peak = peak_gib()
    return seconds, tokens, extra, peak


def token_match(tokens, reference) -> dict:
    if tokens is None or reference is None:
        return {}
    equal = tokens == reference
    differ = (~equal).any(dim=0).nonzero()
    return {"greedy_equal_sdpa": bool(equal.all()), "greedy_equal_sdpa_frac": equal.float().mean().item(),
            "first_new_token_equal_sdpa": bool(equal[:, 0].all()),
            "first_differing_step": int(differ[0]) if differ.numel() else None}


def logits_check(model, ids, mask, smoke: bool) -> dict:
    """The first new position's logits (4 rows): hf_cascade no further from sdpa than transformers' eager attention
    is (bench_generate's bf16 gate); fp32 (``--smoke``): within 1e-4 relative."""
    from bench_generate import bf16_logits_gate

    check = bf16_logits_gate(model, dict(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=1,
                                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                                         pad_token_id=0))
    if smoke:
        check["check_ok"] = check["first_logits_rel_diff"] < 1e-4 and check["first_token_match"]
    return check


def kernel_point(args, device: str, dtype: torch.dtype) -> dict:
    """One decode step's attention of a sliding layer, at the workload's shapes: the unbounded op, the bounded op
    (window), the bounded op with bounds that cut nothing; each call recorded 20 times in a CUDA graph (CPU: wall
    clock of one call, interpreter)."""
    from hf_cascade.ops.cascade_wrapper import step_inputs
    from hf_cascade.ops.plan import plan_cascade
    from hf_cascade.windows import RowShifts, bound_columns

    shape = SMOKE if args.smoke else GEMMA3_4B
    B, Hq, Hkv, D = args.batch, shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    T, own, window = args.prefix, args.own, shape["sliding_window"]
    S = own + args.new_tokens  # the fixed suffix buffers' capacity
    written_n = own + args.new_tokens // 2  # mid-decode
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    q, k, v = rand(B, Hq, 1, D), rand(B, Hkv, S, D), rand(B, Hkv, S, D)
    pre_k, pre_v = rand(Hkv, T, D), rand(Hkv, T, D)
    plan = plan_cascade(None, [[0, T]], B, torch.device(device))
    op_inputs = [t for level in step_inputs(plan, q, k, [pre_k]) for t in level]
    written = torch.tensor(written_n, dtype=torch.int64, device=device)
    # Rows' own tokens start at position T (suffix column 0): suffix_shift T, level_shift 0.
    shifts = RowShifts(level_shift=torch.zeros(1, B, dtype=torch.int64, device=device),
                       suffix_shift=torch.full((B,), T, dtype=torch.int64, device=device), first_position=[T] * B)
    scale = shape["query_pre_attn_scalar"] ** -0.5
    bounds = {name: bound_columns(shifts, 1, written, 1, window=w, chunk=None)
              for name, w in (("window", window), ("cut_nothing", 1 << 30))}
    calls = {
        "unbounded": lambda: torch.ops.hf_cascade.cascade_attention(q, k, v, [pre_k], [pre_v], op_inputs, None,
                                                                    scale, None, None, written),
        **{f"bounded_{name}": (lambda b=b: torch.ops.hf_cascade.bounded_cascade_attention(
            q, k, v, [pre_k], [pre_v], op_inputs, None, scale, None, None, written, b[0], b[1]))
           for name, b in bounds.items()},
        "bounds_per_step": lambda: bound_columns(shifts, 1, written, 1, window=window, chunk=None),
    }
    ref = calls["unbounded"]()[0].float()
    cut_nothing = calls["bounded_cut_nothing"]()[0].float()
    record = {"bench": "windows_kernels", "batch": B, "heads": Hq, "kv_heads": Hkv, "head_dim": D, "prefix": T,
              "suffix_capacity": S, "suffix_written": written_n, "window": window, "dtype": str(dtype),
              # the bound that cuts nothing gives the unbounded kernels' result (the same blocks, a bound check more)
              "cut_nothing_max_abs_diff": (cut_nothing - ref).abs().max().item()}
    if device == "cuda":
        for name, fn in calls.items():
            fn()  # Triton builds, outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            timing = cuda_time(graph.replay, warmup=5, repeat=30)
            record[f"{name}_us"] = timing["ms"] / 20 * 1e3
            record[f"{name}_us_p20_p80"] = [timing["ms_p20"] / 20 * 1e3, timing["ms_p80"] / 20 * 1e3]
            del graph
        record["timing"] = "CUDA graph of 20 calls, CUDA events, median of 30 replays"
    else:
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            record[f"{name}_us"] = (time.perf_counter() - t0) * 1e6
        record["timing"] = "CPU wall clock, one call (Triton interpreter): plumbing only"
    for name in ("bounded_window", "bounded_cut_nothing"):
        record[f"{name}_over_unbounded"] = record[f"{name}_us"] / record["unbounded_us"]
    record["cut_nothing_within_10pct"] = record["bounded_cut_nothing_over_unbounded"] <= 1.10
    record["window_within_10pct"] = record["bounded_window_over_unbounded"] <= 1.10
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: Gemma 3 4B's 34)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prefix", type=int, default=None)
    parser.add_argument("--own", type=int, default=None, help="each row's own tokens after the shared prefix")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per peer (after an untimed one)")
    parser.add_argument("--peers", nargs="+", default=["sdpa", "hf_prefix_reuse", "cascade_default", "cascade_graphs",
                                                       "cascade_compile_now"])
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel point")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="a peer that would start after this many seconds of the process is skipped (and the "
                        "run fails): the run stays inside the device's time limit")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, fp32, CPU (with TRITON_INTERPRET=1 for the kernel point): the plumbing")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    smoke_defaults = dict(layers=6, batch=4, prefix=40, own=3, new_tokens=4)
    real_defaults = dict(layers=GEMMA3_4B["num_hidden_layers"], batch=32, prefix=4096, own=8, new_tokens=64)
    for name, value in (smoke_defaults if args.smoke else real_defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        device, dtype, shape = "cpu", torch.float32, SMOKE
        args.repeats = min(args.repeats, 1)
        output = args.output or os.path.join(tempfile.mkdtemp(prefix="bench_windows_"), "windows.jsonl")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_windows.py needs a CUDA GPU (or --smoke).")
        device, dtype, shape = "cuda", torch.bfloat16, GEMMA3_4B
        output = args.output
    # The default peer's tiers start from no record of earlier processes (a record would let its first calls
    # skip the built-in tier): compile records in a new folder, unless the caller chose one.
    os.environ.setdefault("HF_CASCADE_RECORDS", tempfile.mkdtemp(prefix="hf_cascade_records_"))
    # No background build of the compiled tier: it would compile beside the later peers' timed calls (the default
    # peer's numbers are its first calls' tier; benchmarks/bench_first_call.py measures the build).
    os.environ["HF_CASCADE_BACKGROUND"] = "off"
    writer = ResultWriter("windows.jsonl", output)
    print(f"records -> {writer.path}", flush=True)
    model = build_model(shape, args.layers, device, dtype)
    layer_types = list(model.config.layer_types)
    workload = dict(model="gemma3-4b-text shape" if not args.smoke else "gemma3 tiny (smoke)", layers=args.layers,
                    sliding_layers=layer_types.count("sliding_attention"), window=shape["sliding_window"],
                    batch=args.batch, prefix=args.prefix, own=args.own, new_tokens=args.new_tokens,
                    dtype=str(dtype), smoke=args.smoke)
    if args.layers != GEMMA3_4B["num_hidden_layers"] and not args.smoke:
        workload["note"] = f"layers cut to {args.layers} of Gemma 3 4B's 34"
    ids, mask = make_batch(args.batch, args.prefix, args.own, model.config.vocab_size, device)
    failures = []

    check = logits_check(model, ids, mask, args.smoke)
    writer.write({"bench": "windows_check", **workload, **check})
    print("check:", check, flush=True)
    if not check["check_ok"]:
        failures.append("logits check")
        print("FAILED: hf_cascade's first logits are further from sdpa's than eager's; not timing.", flush=True)
        return 1

    options = {"cascade_default": None, "cascade_graphs": {"decode_step": "graphs"},
               "cascade_compile_now": {"compile": "now"}}
    runners = {
        "sdpa": lambda: run_sdpa(model, ids, mask, args.new_tokens),
        "hf_prefix_reuse": lambda: run_prefix_reuse(model, ids, mask, args.new_tokens, args.prefix),
        **{peer: (lambda o=o: run_cascade(model, ids, mask, args.new_tokens, o)) for peer, o in options.items()},
    }
    unknown = set(args.peers) - set(runners)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {sorted(runners)}")
    kernels = {}
    if not args.no_kernels:  # first: a few seconds, and recorded whatever the peers do
        try:
            kernels = kernel_point(args, device, dtype)
        except Exception as err:
            import traceback

            traceback.print_exc()
            kernels = {"bench": "windows_kernels", "status": f"error: {type(err).__name__}: {str(err)[:400]}"}
            failures.append("kernels")
        writer.write({**workload, **kernels})
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in kernels.items()}, flush=True)

    reference = None
    rows = []
    for peer in args.peers:
        record = {"bench": "windows_generate", "peer": peer, **workload}
        if time.perf_counter() - STARTED > args.budget_s:
            record["status"] = f"skipped: past --budget-s {args.budget_s:.0f} s"
            failures.append(peer)
            writer.write(record)
            rows.append(record)
            print(record["status"], peer, flush=True)
            continue
        if peer in options:
            record["cascade_options"] = options[peer]
        reset_memory()
        BOUNDED_PATHS.clear()
        from hf_cascade.decode.captured_step import recorded_steps

        steps_before = recorded_steps(model)
        try:
            seconds, tokens, extra, peak = timed_calls(runners[peer], 1 + args.repeats)
            timed = seconds[1:] or seconds
            record.update(status="ok", first_call_s=seconds[0], calls_s=seconds, seconds=statistics.median(timed),
                          tokens_per_s=args.batch * args.new_tokens / statistics.median(timed), peak_gib=peak, **extra)
            if peer == "sdpa":
                reference = tokens
            record.update(token_match(tokens, reference))
        except Exception as err:  # every peer's numbers are written; the exit code says a peer failed
            record["status"] = f"error: {type(err).__name__}: {str(err)[:400]}"
            failures.append(peer)
            import traceback

            traceback.print_exc()
        if peer in options:
            from hf_cascade.tiers import tier_report

            record["bounded_paths"] = dict(BOUNDED_PATHS)
            record["tiers"] = tier_report(model) if device == "cuda" else None
            steps = recorded_steps(model)
            # this peer's decode steps: graphs recorded, steps replayed from them
            record["recorded_steps"] = {k: steps[k] - steps_before[k] for k in ("recorded", "replayed")}
            record["decode_step_bounded_path"] = (
                "triton (bounded op in the recorded/compiled step)" if BOUNDED_PATHS["step:op/triton"]
                else "torch" if BOUNDED_PATHS["step:torch"] or BOUNDED_PATHS["step:op/torch"]
                else "eager" if BOUNDED_PATHS["eager:triton"] or BOUNDED_PATHS["eager:torch"] else "none seen")
            if peer != "cascade_default" and device == "cuda" and record["status"] == "ok" and (
                    BOUNDED_PATHS["step:torch"] or not BOUNDED_PATHS["step:op/triton"]
                    or not record["recorded_steps"]["replayed"]):
                failures.append(f"{peer}: decode steps not replayed with the bounded layers on the Triton op")
        writer.write(record)
        rows.append(record)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
               if k not in ("git_sha",)}, flush=True)

    print(f"\n{'peer':>20} {'median s':>9} {'first s':>8} {'peak GiB':>9} {'KV GiB':>7} {'=sdpa':>6}  decode path / "
          "status")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(f"{r['peer']:>20} {f('seconds', '9.2f')} {f('first_call_s', '8.2f')} {f('peak_gib', '9.1f')} "
              f"{f('kv_gib', '7.2f')} {str(r.get('greedy_equal_sdpa', '-')):>6}  "
              f"{r.get('decode_step_bounded_path', '')} {r['status'] if r['status'] != 'ok' else ''}")
    drop = next((r for r in rows if "droppable_sliding_kv_gib" in r), None)
    if drop:
        print(f"sliding-layer prefix KV no row can see: {drop['droppable_sliding_kv_gib']:.3f} GiB of "
              f"{drop['kv_gib']:.3f} GiB held ({drop['droppable_fraction_of_kv']:.0%})")
    if "unbounded_us" in kernels:
        print(f"kernels: unbounded {kernels['unbounded_us']:.1f} us, window {kernels['bounded_window_us']:.1f} us "
              f"({kernels['bounded_window_over_unbounded']:.2f}x), bound cutting nothing "
              f"{kernels['bounded_cut_nothing_us']:.1f} us ({kernels['bounded_cut_nothing_over_unbounded']:.2f}x), "
              f"bounds per step {kernels['bounds_per_step_us']:.1f} us")
    print(f"total {time.perf_counter() - STARTED:.0f} s; records in {writer.path}")
    if failures:
        print(f"FAILED: {failures}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
