"""Issue 51 in one device call (one H100, under 8 minutes): hf_cascade against transformers' continuous batching
(``generate_batch`` with prefix sharing, its defaults and its guide's fast settings: ``cb_peer.py``), generate() with
sdpa and transformers' prefix-reuse recipe, on every shared-prefix workload, and a TRL GRPO-shaped rollout.

In order (each record written as soon as it is done, so that a run cut short keeps what it finished):

1. ``cb_tokens_check``: fp32 tiny Llama, greedy: generate_batch's tokens (both configs) == generate()'s (sdpa) ==
   hf_cascade's, on a shared prompt, a two-level tree and samples of one prompt (``passed``);
   ``trl_rollout_check``: fp32 tiny Qwen2, sampling, same seed: hf_cascade's rollout == TRL's default path's.
2. ``shared``: 32 rows sharing 4,096 tokens + 64 own, 64 new, greedy (Llama-3-8B shape, 32 layers, bf16).
3. ``nsamples``: 1 prompt of 4,096 tokens x 32 samples, 64 new (sampling, ``do_sample=True, top_k=50``;
   generate_batch gets the repeated rows).
4. ``tree``: 64 rows: 1,024 tokens shared by all, 4 documents of 2,048 each shared by 16, 64 own, 64 new, greedy.
5. ``grpo``: 16 prompts (256 shared + 512 own) x 8 samples, 128 new (sampling, as ``nsamples``).
6. ``trl``: TRL's GRPO rollout (``trl_rollout.py``): 16 prompts x 8 generations x 256 new, Qwen2.5-1.5B shape, bf16:
   TRL's default generate() path, its paged path (generate_batch), and hf_cascade's checkpoint-folder route.

Peers per workload: ``cascade_generate`` (the one-argument ``generate(custom_generate=hf_cascade.generate)``,
default options: a first call, then a warm call as bench_generate times it), ``sdpa`` (generate() as it is),
``hf_prefix_reuse``, ``generate_batch_defaults`` and ``generate_batch_best``. hf_cascade's background build of its
compiled tier is off (``--background-build on`` for the package's default): its child process would share the GPU
with the peers timed after it. A workload whose estimate (:data:`ESTIMATE_S`) no longer fits ``--budget-s`` is
recorded as skipped.

    python benchmarks/bench_peers_gpu.py --output $OUT/peers_gpu.jsonl     # the device run (about 7 minutes)
    python benchmarks/bench_peers_gpu.py --tiny --output /tmp/peers.jsonl   # every step on CPU, tiny sizes (~1 min)
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cb_peer  # noqa: E402
import trl_rollout  # noqa: E402
from common import ResultWriter, wall_time  # noqa: E402
from generate_peers import (  # noqa: E402
    SAMPLING_WORKLOADS, TREE_LEVELS, TREE_OWN, TREE_ROWS, TREE_SEED, PeerFailed, bf16_logits_gate, build_model,
    common_prefix_length, make_batch, make_sampling_batch, make_tree_batch, reset_memory, run_cascade_generate,
    run_generate_batch, run_hf_prefix_reuse, run_sampling, run_sdpa, sampling_logits_check, sdpa_in_parts,
)

import hf_cascade  # noqa: E402

# Seconds each workload takes in the estimate (H100, Llama-3-8B shape; generate_batch_defaults measured at 18.75 s per
# call on the shared workload), scaled by how the first workload ran against its own: a workload starts only where
# that much of --budget-s is left.
ESTIMATE_S = {"shared": 110, "nsamples": 55, "tree": 100, "grpo": 85, "trl": 60}
# Sizes: the device run, and --tiny (CPU). sampling: (prompts, shared, own, samples, new tokens).
SIZES = {
    "gpu": dict(batch=32, prefix=4096, suffix=64, new_tokens=64, sampling=SAMPLING_WORKLOADS,
                tree=(TREE_LEVELS, TREE_OWN, TREE_ROWS), trl=dict(prompts=16, num_generations=8, new_tokens=256)),
    "tiny": dict(batch=4, prefix=96, suffix=8, new_tokens=8,
                 sampling={"nsamples": (1, 0, 64, 4, 8), "grpo": (2, 16, 24, 2, 8)},
                 tree=([(1, 32), (2, 32)], 4, 8), trl=dict(prompts=2, num_generations=2, new_tokens=8)),
}
PEER_CALLS = {
    "cascade_generate": "model.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False, "
                        "custom_generate=hf_cascade.generate) with attn_implementation='cascade', default options",
    "sdpa": "model.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False) with sdpa",
    "hf_prefix_reuse": "the common prefix prefilled once into a DynamicCache, deepcopy + batch_repeat_interleave(B), "
                       "generate(past_key_values=...) with sdpa",
}


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def used(self) -> float:
        return time.perf_counter() - PROCESS_STARTED

    def allows(self, workload: str, scale: float) -> bool:
        return self.seconds - self.used() >= ESTIMATE_S[workload] * scale


_SHOWN = ("status", "passed", "check_ok", "first_call_s", "total_s", "peak_gib", "kv_gib", "kv_pool_gib",
          "prefix_tokens_reused", "greedy_tokens_equal_sdpa_frac", "completions_equal_default", "speedup_vs_sdpa",
          "cascade_generate_speedup", "attention_in_call", "settings_applied", "settings_unsupported", "retried_after",
          "process_s")


def _write(ctx, record: dict) -> dict:
    """Append the record (with the run's fields) and print its main fields on one line."""
    record = {"bench": "peers_gpu", **ctx.meta, **record, "process_s": round(time.perf_counter() - PROCESS_STARTED, 1)}
    ctx.writer.write(record)
    shown = {k: (round(record[k], 3) if isinstance(record[k], float) else record[k]) for k in _SHOWN if k in record}
    print(f"{record.get('workload')} {record.get('peer', record['bench'])}: {shown}", flush=True)
    return record


def _run(record: dict, fn) -> dict:
    """``record`` updated with ``fn()`` (status ok), or with the failure (a peer failing never stops the run)."""
    try:
        record.update(fn())
        record.setdefault("status", "ok")
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    except PeerFailed as err:
        record.update(err.record)
    except Exception as err:  # noqa: BLE001
        record["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
    reset_memory()
    return record


def _cascade_first_and_warm(model, ids, mask, new_tokens: int) -> dict:
    """hf_cascade's one-argument call: a first call (timed), then bench_generate's timing (a 1-token call, the
    call)."""
    model.set_attn_implementation("cascade")
    first, _ = wall_time(lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0, custom_generate=hf_cascade.generate))
    reset_memory()
    return {**run_cascade_generate(model, ids, mask, new_tokens), "first_call_s": first}


def _finish(ctx, records: dict, peer: str, record: dict, tokens: dict, rows: int, n: int) -> None:
    """Write ``record`` now (a run cut short keeps it), with what the peers before it allow: greedy tokens against
    sdpa's (fraction equal, bf16), hf_cascade's speedup over sdpa, and each later peer's time over hf_cascade's."""
    new = record.pop("new_tokens", None)
    if isinstance(new, torch.Tensor):
        tokens[peer] = new
        if peer != "sdpa" and "sdpa" in tokens and new.shape == tokens["sdpa"].shape:
            record["greedy_tokens_equal_sdpa_frac"] = (new == tokens["sdpa"]).float().mean().item()
    if record.get("total_s"):
        record["tokens_per_s"] = rows * n / record["total_s"]
        ours, sdpa = records.get("cascade_generate", {}).get("total_s"), records.get("sdpa", {}).get("total_s")
        if peer == "cascade_generate" and sdpa:
            record["speedup_vs_sdpa"] = sdpa / record["total_s"]
        elif peer not in ("sdpa", "cascade_generate") and ours:
            record["cascade_generate_speedup"] = record["total_s"] / ours  # how much faster hf_cascade was
    records[peer] = record
    _write(ctx, record)


def time_greedy(ctx, workload: str, ids, mask, base: dict, prefix: int, cb_calls: int) -> None:
    """Every peer on one greedy batch (sdpa first: the others' tokens are compared with its), each record written
    as soon as the peer is done."""
    n = ctx.size["new_tokens"]
    check = bf16_logits_gate(ctx.model, dict(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=1,
                                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                                             pad_token_id=0))
    _write(ctx, {**base, "peer": "bf16_gate", **check})
    runners = {
        "sdpa": lambda: run_sdpa(ctx.model, ids, mask, n),
        "cascade_generate": lambda: _cascade_first_and_warm(ctx.model, ids, mask, n),
        "hf_prefix_reuse": lambda: run_hf_prefix_reuse(ctx.model, ids, mask, n, prefix=prefix),
        **{f"generate_batch_{c}": (lambda c=c: run_generate_batch(ctx.model, ids, mask, n, c, calls=cb_calls,
                                                                   settings=ctx.cb_settings))
           for c in ctx.cb_configs},
    }
    records, tokens = {}, {}
    for peer, fn in runners.items():
        record = {**base, "peer": peer, "peer_call": PEER_CALLS.get(peer, "model.generate_batch (cb_peer.py)")}
        if peer == "cascade_generate" and not check["check_ok"] and not ctx.tiny:
            record["status"] = "skipped: the bf16 gate failed (not timing a wrong answer)"
        else:
            _run(record, fn)
        if peer == "sdpa" and record["status"] == "out of memory":  # as a capable user runs what does not fit
            _run(record, lambda: dict(zip(("total_s", "sdpa_parts"), sdpa_in_parts(ctx.model, ids, mask, n)),
                                      status="ok"))
        _finish(ctx, records, peer, record, tokens, ids.shape[0], n)


def time_sampling(ctx, workload: str, dims: tuple) -> None:
    """A sampling workload: generate(num_return_sequences) with sdpa, hf_cascade, the recipe; generate_batch on the
    repeated rows."""
    prompts, shared, own, samples, n = dims
    ids, mask = make_sampling_batch(workload, ctx.model.config.vocab_size, ctx.device, dims)
    base = {"workload": workload, "prompts": prompts, "shared": shared, "own": own, "samples": samples,
            "new_tokens": n, "rows": prompts * samples, "sampling": "do_sample=True, top_k=50"}
    check = sampling_logits_check(ctx.model, ids, mask, samples)
    _write(ctx, {**base, "peer": "bf16_gate", **check})
    records = {}
    for peer in ("sdpa", "cascade", "hf_prefix_reuse", *(f"generate_batch_{c}" for c in ctx.cb_configs)):
        name = "cascade_generate" if peer == "cascade" else peer
        record = {**base, "peer": name, "peer_call": PEER_CALLS.get(name, "model.generate_batch (cb_peer.py)")}
        if peer in ("sdpa", "cascade"):
            record["peer_call"] += " + num_return_sequences, do_sample=True, top_k=50"
        if peer == "cascade" and not check["check_ok"] and not ctx.tiny:
            record["status"] = "skipped: the bf16 gate failed (not timing a wrong answer)"
        else:
            _run(record, lambda: run_sampling(ctx.model, peer, ids, mask, samples, n, cb_settings=ctx.cb_settings))
        _finish(ctx, records, name, record, {}, prompts * samples, n)


def time_trl(ctx) -> None:
    """TRL's GRPO rollout: its default path (2 calls), its paged path (1 call), hf_cascade's route (2 calls)."""
    shape = "tiny" if ctx.tiny else "qwen2.5-1.5b"
    dtype = torch.float32 if ctx.tiny else torch.bfloat16
    size = ctx.size["trl"]
    model = trl_rollout.build_model(shape, device=ctx.device, dtype=dtype)
    prompts = trl_rollout.make_prompts(shape, size["prompts"], **({"system": 24, "own": (6, 14)} if ctx.tiny else {}))
    cb_settings = {"num_blocks": 64} if ctx.tiny else None  # TRL's default pool: half the free memory
    calls = {"trl_default": 2, "trl_paged": 1, "trl_hf_cascade": 2}
    described = {"workload": "trl", "model": f"{shape} shape, random, {str(dtype).replace('torch.', '')}",
                 "layers": model.config.num_hidden_layers}
    trl_rollout.run_rollouts(model, shape, prompts, size["num_generations"], size["new_tokens"], calls=calls,
                             cb_settings=cb_settings, on_record=lambda record: _write(ctx, {**record, **described}))
    del model
    reset_memory()


def run_workloads(ctx) -> None:
    size, vocab = ctx.size, ctx.model.config.vocab_size
    scale = 0.1 if ctx.tiny else 1.0  # after the first workload: how long it took against its estimate
    for workload in ctx.workloads:
        if not ctx.budget.allows(workload, scale):
            _write(ctx, {"workload": workload, "peer": "all", "status": "skipped: time budget",
                         "budget_s": ctx.budget.seconds, "used_s": round(ctx.budget.used(), 1)})
            continue
        started = time.perf_counter()
        if workload == "shared":
            ids, mask = make_batch(size["batch"], size["prefix"], size["suffix"], vocab, ctx.device)
            base = {"workload": "shared", "batch": size["batch"], "prefix": size["prefix"], "suffix": size["suffix"],
                    "new_tokens": size["new_tokens"]}
            time_greedy(ctx, "shared", ids, mask, base, size["prefix"], cb_calls=2)
        elif workload == "tree":
            levels, own, rows = size["tree"]
            ids, mask = make_tree_batch(levels, own, rows, vocab, TREE_SEED, ctx.device)
            base = {"workload": "tree", "batch": rows, "levels": levels, "own": own, "new_tokens": size["new_tokens"],
                    "common_prefix": common_prefix_length(ids)}
            time_greedy(ctx, "tree", ids, mask, base, common_prefix_length(ids), cb_calls=1)
        elif workload == "trl":
            time_trl(ctx)
        else:
            time_sampling(ctx, workload, size["sampling"][workload])
        took = time.perf_counter() - started
        if workload == ctx.workloads[0] and not ctx.tiny:
            scale = min(2.0, max(0.7, took / ESTIMATE_S[workload]))
        print(f"{workload}: {took:.1f} s (process {ctx.budget.used():.1f} s)", flush=True)


def _tiny_llama(device):
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", attn_implementation="cascade", seed=0, device=device, num_hidden_layers=2)
    model.generation_config.eos_token_id = None
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=None, help="JSON lines (default benchmarks/results/peers_gpu.jsonl)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds from process start; a workload that no longer fits its estimate is skipped")
    parser.add_argument("--workloads", nargs="+", default=list(ESTIMATE_S), choices=list(ESTIMATE_S))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--background-build", choices=["off", "on"], default="off",
                        help="hf_cascade's background build of its compiled tier (on: the package's default)")
    parser.add_argument("--cb-configs", nargs="+", default=["defaults", "best"], choices=list(cb_peer.CB_CONFIGS),
                        help="generate_batch's configurations (cb_peer.CB_CONFIGS)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 models and sizes on CPU (a smoke run)")
    parser.add_argument("--skip-checks", action="store_true", help="leave out the fp32 tokens checks")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench_peers_gpu.py needs a CUDA GPU (or --tiny).")
    from hf_cascade import tier_build

    os.environ["HF_CASCADE_BACKGROUND"] = "on" if args.background_build == "on" else "off"
    device = "cpu" if args.tiny else "cuda"
    ctx = argparse.Namespace(tiny=args.tiny, device=device, size=SIZES["tiny" if args.tiny else "gpu"],
                             workloads=args.workloads, budget=Budget(args.budget_s),
                             writer=ResultWriter("peers_gpu.jsonl", args.output),
                             cb_settings=cb_peer.TINY_POOL if args.tiny else None,  # CPU: a pool of 90% of RAM
                             cb_configs=args.cb_configs)
    ctx.meta = {"run": "bench_peers_gpu", "tiny": args.tiny, "trl": trl_rollout.trl_version(),
                "background_build": tier_build.background_builds_on(), "layers": 2 if args.tiny else args.layers,
                "model": "tiny llama fp32" if args.tiny else "Llama-3-8B shape, random, bf16"}
    if not args.skip_checks:
        _write(ctx, {"workload": "check", **cb_peer.tokens_check(device, tuple(args.cb_configs))})
        _write(ctx, {"workload": "check", **trl_rollout.tiny_check(device)})
    ctx.model = _tiny_llama(device) if args.tiny else build_model(args.layers)
    _write(ctx, {"workload": "setup", "peer": "model", "cb_configs": cb_peer.CB_CONFIGS,
                 "flash_attention": cb_peer.resolve_attention("flash")[0]})
    run_workloads(ctx)
    print(f"done in {ctx.budget.used():.1f} s", flush=True)


if __name__ == "__main__":
    main()
