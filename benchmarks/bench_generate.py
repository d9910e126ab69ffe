"""End-to-end generate() benchmark: hf_cascade (compiled and eager) vs generate() with sdpa (dynamic cache, and
transformers' static cache compiled) vs generate_batch (continuous batching).

Workload (issue 3): a Llama-3-8B-shaped random bf16 model, B rows sharing a P-token prompt, each with its own
S-token suffix, N new tokens, greedy. Reports total time, prefill time, decode ms/step, tokens/s and peak memory
for each peer in the same run. Before any timing, a check gates the run: hf_cascade's first-step logits must be
no further from sdpa's than transformers' eager attention's are (``bf16_logits_gate``).

    python benchmarks/bench_generate.py                       # the issue's grid (needs an 80 GB GPU)
    python benchmarks/bench_generate.py --layers 4 --batches 8 --prefix 1024   # a quick look
    python benchmarks/bench_generate.py --workload nsamples grpo   # n samples of a prompt, through plain generate()
    python benchmarks/bench_generate.py --workload stream --stream-passes 2  # 8 batches, 8 sharing trees, cold + warm
    python benchmarks/bench_generate.py --workload stream --stream-process-per-peer  # each peer in a new process

hf_cascade's one-argument peers: ``cascade_generate`` (the default, ``decode_step="auto"``: decode steps replayed
from recorded CUDA graphs, the prefill forwards with compiled layers), ``cascade_generate_graphs`` and
``cascade_generate_compile`` (``decode_step`` named), ``cascade_generate_eager_prefill`` (the default with
``compile_prefill=False``: the prefill forwards eager).

Sampling workloads (``--workload nsamples grpo``): ``nsamples`` is 1 prompt of 4096 tokens x 32 samples, 64 new
tokens; ``grpo`` is 16 prompts (a shared 256-token system prompt + 512 own tokens) x 8 samples, 128 new tokens. The
peers are the user's own ``model.generate(**batch, num_return_sequences=N, do_sample=True)`` with sdpa, transformers'
prefix-reuse recipe on the repeated rows (``hf_prefix_reuse``), and the same call with
``custom_generate=hf_cascade.generate``; KV bytes are compared with the unique tokens (each prompt token
once + every sample's own tokens).
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.perf_counter()  # before torch's import: a stream record's process_s counts everything

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (  # noqa: E402
    RESULTS_DIR, ResultWriter, TritonBuilds, timed_with_compile_breakdown, triton_cache_files, triton_variants,
    wall_time,
)

import hf_cascade  # noqa: E402


def build_model(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,  # 32 in Llama-3-8B
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=None,  # random weights: never stop early, every row makes N tokens
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def make_batch(batch: int, prefix: int, suffix: int, vocab: int):
    g = torch.Generator().manual_seed(batch)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    rows = torch.randint(3, vocab, (batch, suffix), generator=g)
    ids = torch.cat([shared.expand(batch, -1), rows], dim=1).cuda()
    return ids, torch.ones_like(ids)


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def reset_memory():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def step_timings(t_first: float, t_all: float, new_tokens: int) -> dict:
    """total / prefill (a 1-token generate()) / decode ms per step, and peak memory, of one timed peer."""
    return {
        "total_s": t_all,
        "prefill_s": t_first,
        "decode_ms_per_step": (t_all - t_first) / max(new_tokens - 1, 1) * 1e3,
        "peak_gib": peak_gib(),
    }


def median_run(run, repeats: int) -> dict:
    """``run()`` ``repeats`` times; the record of the run with the median ``total_s``, with every run's total in
    ``total_s_runs`` (and the first run's ``first_call_s``, the one that compiled, if the runs report it)."""
    records = [run() for _ in range(max(repeats, 1))]
    chosen = dict(sorted(records, key=lambda r: r["total_s"])[len(records) // 2])
    chosen["total_s_runs"] = [round(r["total_s"], 4) for r in records]
    for key in ("first_call_s", "first_call_compile_s"):
        if key in records[0]:
            chosen[key] = records[0][key]
    return chosen


def run_cascade(model, ids, mask, new_tokens, compiled=False):
    """hf_cascade; ``compiled``: fixed suffix buffers, so generate() compiles the decode step (CUDA graphs)."""
    model.set_attn_implementation("cascade")
    gen = dict(do_sample=False, pad_token_id=0)
    reset_memory()
    t_prefix, inputs = wall_time(
        lambda: hf_cascade.shared_prefix_inputs(model, ids, mask, max_new_tokens=new_tokens if compiled else None)
    )
    t_first, _ = wall_time(lambda: model.generate(**inputs, max_new_tokens=1, **gen))
    t_all, out = wall_time(lambda: model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen))
    cache = inputs["past_key_values"]
    return {
        "total_s": t_prefix + t_all,
        "prefill_s": t_prefix + t_first,
        "decode_ms_per_step": (t_all - t_first) / max(new_tokens - 1, 1) * 1e3,
        "peak_gib": peak_gib(),
        "kv_gib": cache.nbytes / 2**30,
        "new_tokens": out[:, inputs["input_ids"].shape[1] :],
    }


# hf_cascade.generate peers: the default, and each decode step (cascade_options["decode_step"]) named
# peer -> cascade_options (None: the default path)
CASCADE_GENERATE_PEERS = {"cascade_generate": None, "cascade_generate_compile": {"decode_step": "compile"},
                          "cascade_generate_graphs": {"decode_step": "graphs"},
                          "cascade_generate_layers": {"decode_step": "layers"},
                          "cascade_generate_eager_prefill": {"compile_prefill": False}}


def _options_name(options: dict | None) -> str:
    return "default" if not options else ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def run_cascade_generate(model, ids, mask, new_tokens, options=None):
    """The user's own generate() call + ``custom_generate=hf_cascade.generate`` (planning and prefill included);
    ``options``: its ``cascade_options`` (None: the default)."""
    model.set_attn_implementation("cascade")
    caches = []
    gen = dict(do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate, cascade_caches=caches,
               cascade_options=options)
    reset_memory()
    t_first, _ = wall_time(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, **gen))
    t_all, out = wall_time(lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen
    ))
    return {
        **step_timings(t_first, t_all, new_tokens),
        "decode_step": (options or {}).get("decode_step", "default"),
        "cascade_options": _options_name(options),
        "kv_gib": caches[-1].nbytes / 2**30,
        "new_tokens": out[:, ids.shape[1] :],
    }


def run_sdpa(model, ids, mask, new_tokens, compiled=False):
    """generate() with sdpa; ``compiled``: transformers' static cache, which generate() compiles (CUDA graphs)."""
    model.set_attn_implementation("sdpa")
    gen = dict(do_sample=False, pad_token_id=0)
    if compiled:
        gen["cache_implementation"] = "static"
    reset_memory()
    t_first, _ = wall_time(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, **gen))
    t_all, out = wall_time(
        lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)
    )
    return {
        **step_timings(t_first, t_all, new_tokens),
        "new_tokens": out[:, ids.shape[1] :],
    }


def run_hf_prefix_reuse(model, ids, mask, new_tokens, prefix: int, once: bool = False, **sampling):
    """transformers' documented prefix reuse: prefill the shared prefix once into a DynamicCache, copy it,
    ``batch_repeat_interleave(B)``, then ``generate(past_key_values=...)`` (the prefix is stored once per row)."""
    import copy

    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    gen = dict(sampling or dict(do_sample=False), pad_token_id=0)
    reset_memory()

    def recipe(n):
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[:1, :prefix], past_key_values=cache, use_cache=True)
        cache = copy.deepcopy(cache)
        cache.batch_repeat_interleave(ids.shape[0])
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                             **gen)
        return out, cache

    if once:
        t_all, _ = wall_time(lambda: recipe(new_tokens))
        return {"total_s": t_all}
    t_first, _ = wall_time(lambda: recipe(1))
    t_all, (out, cache) = wall_time(lambda: recipe(new_tokens))
    return {
        **step_timings(t_first, t_all, new_tokens),
        "kv_gib": dynamic_cache_nbytes(cache) / 2**30,
        "new_tokens": out[:, ids.shape[1] :],
    }


def run_generate_batch(model, ids, mask, new_tokens):
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    reset_memory()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    t_all, _ = wall_time(lambda: model.generate_batch(inputs=ids.tolist(), generation_config=config))
    model.set_attn_implementation("sdpa")
    return {"total_s": t_all, "peak_gib": peak_gib()}


def bf16_logits_gate(model, generate_kwargs: dict) -> dict:
    """The verification that gates timing: the first generated position's logits of one generate() call with sdpa,
    with transformers' eager attention and with hf_cascade (bf16 model).

    Passes (``check_ok``) when cascade is no further from sdpa than eager is: the relative L2 norm of the logit
    difference over all rows, the project's bf16 bar (exactness itself is tested in fp32, where the tokens are
    identical). ``generate_kwargs`` is the call (ids, mask, ``max_new_tokens=1``, ``output_logits=True``, ...);
    hf_cascade's is the default one-argument call with sharing forced (no cost model). Logits: [rows, vocab] fp32.
    """
    logits = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        logits[impl] = model.generate(**generate_kwargs).logits[0].float()
    model.set_attn_implementation("cascade")
    logits["cascade"] = model.generate(**generate_kwargs, custom_generate=hf_cascade.generate,
                                       cascade_options=dict(cost_model=None)).logits[0].float()
    want = logits["sdpa"]
    rel = {k: ((logits[k] - want).norm() / want.norm()).item() for k in ("eager", "cascade")}
    return {
        "first_logits_max_abs_diff": (logits["cascade"] - want).abs().max().item(),
        "eager_first_logits_max_abs_diff": (logits["eager"] - want).abs().max().item(),
        "first_logits_scale": want.abs().max().item(),
        "first_logits_rel_diff": rel["cascade"],
        "eager_first_logits_rel_diff": rel["eager"],
        "first_token_match": bool((logits["cascade"].argmax(-1) == want.argmax(-1)).all()),
        "eager_first_token_match": bool((logits["eager"].argmax(-1) == want.argmax(-1)).all()),
        "check_ok": rel["cascade"] <= rel["eager"],
    }


def gate(check: dict, what: str) -> None:
    """Stop before any timing when the check failed (the record is written first)."""
    print(f"check ({what}):", check, flush=True)
    if not check["check_ok"]:
        raise SystemExit(
            f"{what}: hf_cascade's first logits are further from sdpa than transformers' eager is (relative "
            f"difference {check['first_logits_rel_diff']:.3g} against {check['eager_first_logits_rel_diff']:.3g}); "
            "not timing a wrong answer.")


def first_logits_check(model, ids, mask, batch_rows: int = 4) -> dict:
    """Shared workload: the first ``batch_rows`` rows, greedy."""
    return bf16_logits_gate(model, dict(input_ids=ids[:batch_rows], attention_mask=mask[:batch_rows], max_new_tokens=1,
                                        do_sample=False, output_logits=True, return_dict_in_generate=True,
                                        pad_token_id=0))


SAMPLING_WORKLOADS = {
    # name: (prompts, shared system tokens, own tokens per prompt, samples per prompt, new tokens)
    "nsamples": (1, 0, 4096, 32, 64),
    "grpo": (16, 256, 512, 8, 128),
}


def make_sampling_batch(name: str, vocab: int):
    prompts, shared, own, _, _ = SAMPLING_WORKLOADS[name]
    g = torch.Generator().manual_seed(len(name))
    system = torch.randint(3, vocab, (shared,), generator=g)
    rows = torch.randint(3, vocab, (prompts, own), generator=g)
    ids = torch.cat([system.expand(prompts, -1), rows], dim=1).cuda()
    return ids, torch.ones_like(ids)


def dynamic_cache_nbytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run_sampling(model, peer: str, ids, mask, samples: int, new_tokens: int) -> dict:
    """The user's own generate() call with num_return_sequences; cascade = the same call + custom_generate;
    hf_prefix_reuse = transformers' recipe: the rows' common prefix prefilled once into a DynamicCache, repeated
    for every sample row, then generate() on the repeated rows (each prompt's own tokens prefilled per sample)."""
    if peer == "hf_prefix_reuse":
        rows = ids.repeat_interleave(samples, dim=0)
        prefix = min(common_prefix_length(rows), rows.shape[1] - 1)
        torch.manual_seed(0)
        record = run_hf_prefix_reuse(model, rows, torch.ones_like(rows), new_tokens, prefix=prefix,
                                     do_sample=True, top_k=50)
        record.pop("new_tokens", None)
        record["tokens_per_s"] = rows.shape[0] * new_tokens / record["total_s"]
        return record
    model.set_attn_implementation("cascade" if peer == "cascade" else "sdpa")
    caches = []
    extra = dict(custom_generate=hf_cascade.generate, cascade_caches=caches) if peer == "cascade" else {}
    gen = dict(do_sample=True, top_k=50, num_return_sequences=samples, pad_token_id=0, return_dict_in_generate=True)
    record = {}
    if peer == "cascade":  # the default path compiles the decode step on first use: once, untimed, same shapes
        reset_memory()
        record["first_call_s"], record["first_call_compile_s"], _ = timed_with_compile_breakdown(
            lambda: model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen, **extra
            )
        )
        caches.clear()
    reset_memory()
    torch.manual_seed(0)
    t_first, _ = wall_time(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, **gen, **extra))
    caches.clear()
    reset_memory()
    torch.manual_seed(0)
    t_all, out = wall_time(lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen, **extra
    ))
    kv = caches[-1].nbytes if caches else dynamic_cache_nbytes(out.past_key_values)
    record.update({
        **step_timings(t_first, t_all, new_tokens),
        "kv_gib": kv / 2**30,
        "tokens_per_s": out.sequences.shape[0] * new_tokens / t_all,
    })
    if caches:
        record["prefix_tree"] = caches[-1].prefix_tree.describe()
        record["compiled"] = caches[-1].is_compileable
    del out
    return record


def sampling_logits_check(model, ids, mask, samples: int) -> dict:
    """Sampling workloads: the first 2 prompts x min(samples, 4) rows (``top_k=1``: raw logits, greedy)."""
    return bf16_logits_gate(model, dict(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=1, do_sample=True,
                                        top_k=1, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                        num_return_sequences=min(samples, 4)))


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
        for peer in ("sdpa", "hf_prefix_reuse", "cascade"):
            record = {"bench": "generate_sampling", "peer": peer, **workload}
            try:
                record.update(median_run(lambda: run_sampling(model, peer, ids, mask, samples, new_tokens),
                                         args.repeats), status="ok")
                record["kv_over_unique"] = record["kv_gib"] / workload["unique_kv_gib"]
                results[peer] = record
            except torch.OutOfMemoryError:
                record["status"] = "out of memory"
            reset_memory()
            if peer == "cascade" and "cascade" in results:
                for other in ("sdpa", "hf_prefix_reuse"):
                    if other in results:
                        record[f"speedup_vs_{other}"] = results[other]["total_s"] / record["total_s"]
            writer.write(record)
            rows.append(record)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}, flush=True)
    print(f"\n{'workload':>9} {'peer':>15} {'total s':>8} {'ms/step':>8} {'KV GiB':>7} {'KV/unique':>9} "
          f"{'vs sdpa':>7} {'vs reuse':>8}")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(f"{r['workload']:>9} {r['peer']:>15} {f('total_s', '8.2f')} {f('decode_ms_per_step', '8.1f')} "
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


def make_tree_batch(levels, own: int, rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    segments = [[torch.randint(3, vocab, (tokens,), generator=g) for _ in range(groups)] for groups, tokens in levels]
    batch = []
    for r in range(rows):
        parts = [segments[l][r * groups // rows] for l, (groups, _) in enumerate(levels)]
        batch.append(torch.cat(parts + [torch.randint(3, vocab, (own,), generator=g)]))
    ids = torch.stack(batch).cuda()
    return ids, torch.ones_like(ids)


def common_prefix_length(ids) -> int:
    same = (ids == ids[:1]).all(dim=0)
    return int(same.long().cumprod(0).sum())


def sdpa_in_parts(model, ids, mask, new_tokens: int) -> tuple[float, int]:
    """generate() with sdpa as a capable user runs a batch that does not fit: the whole batch, else halves, quarters
    (one after the other). Returns (seconds of the run that fitted, number of parts); a failed try is not timed."""
    parts = 1
    while True:
        try:
            size = -(-ids.shape[0] // parts)
            t = 0.0
            for i in range(0, ids.shape[0], size):
                seconds, _ = wall_time(lambda: model.generate(
                    ids[i : i + size], attention_mask=mask[i : i + size], max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                ))
                t += seconds
            return t, parts
        except torch.OutOfMemoryError:
            if parts >= ids.shape[0]:
                raise
            parts *= 2
            reset_memory()


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
        for ids, mask in batches:
            try:
                if peer == "sdpa":
                    model.set_attn_implementation("sdpa")
                    t, parts = sdpa_in_parts(model, ids, mask, args.new_tokens)
                    split.append(parts)
                elif peer == "hf_prefix_reuse":
                    prefix = common_prefix_length(ids)
                    t = run_hf_prefix_reuse(model, ids, mask, args.new_tokens, prefix=prefix, once=True)["total_s"]
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
            finally:
                reset_memory()
        record = {
            "bench": "generate_layout_stream", "peer": peer, "pass": stream_pass, "layers": args.layers, "batch": 32,
            "new_tokens": args.new_tokens, "layouts": [[list(l) for l in levels] for levels, _ in LAYOUT_STREAM],
            "per_batch_s": per_batch, "total_s": sum(per_batch), "status": status,
            "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,
            # this process so far: imports, model build, earlier peers and passes, this one
            "process_s": time.perf_counter() - PROCESS_STARTED, "peers_in_process": args.stream_peers,
        }
        if split:
            record["sdpa_parts_per_batch"] = split
        if peer in CASCADE_GENERATE_PEERS:
            record["decode_step"] = (CASCADE_GENERATE_PEERS[peer] or {}).get("decode_step", "default")
            record["cascade_options"] = _options_name(CASCADE_GENERATE_PEERS[peer])
        if compile_per_batch:  # torch.compile phases per batch (the rest of a compiling batch: Triton, cudagraphs)
            record["compile_s_per_batch"] = compile_per_batch
            record["triton_variants_after_batch"] = variants  # hf_cascade's Triton kernels built so far
            record["triton_per_batch"] = triton_per_batch  # builds (and seconds), loads from Triton's disk cache
            record["triton_cache_files_at_start"] = args.triton_cache_files_at_start  # 0: a machine-cold stream
        if caches:  # the trees as planned: prefix levels and fixed-buffer capacity of each batch
            record["planned"] = [{"levels": c.num_levels, "max_suffix_length": c.max_suffix_length,
                                  "compiled": c.is_compileable} for c in caches]
            caches.clear()
        totals[peer] = record["total_s"]
        writer.write(record)
        print({k: v for k, v in record.items() if k != "layouts"}, flush=True)
    for ours in CASCADE_GENERATE_PEERS:
        for peer in ("sdpa", "hf_prefix_reuse"):
            if totals.get(peer) and totals.get(ours):
                print(f"layout stream (pass {stream_pass}): {ours} {totals[ours]:.1f} s, {peer} {totals[peer]:.1f} s "
                      f"({totals[peer] / totals[ours]:.2f}x)")


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
            for peer in ("sdpa", "hf_prefix_reuse"):
                a, b = totals.get((ours, stream_pass)), totals.get((peer, stream_pass))
                if a and b:
                    print(f"layout stream, a process per peer (pass {stream_pass}): {ours} {a:.1f} s, {peer} "
                          f"{b:.1f} s ({b / a:.2f}x)")


def main(argv=None):
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
                 "generate_batch"],
        help="*_compiled: generate()'s auto-compile (torch.compile, CUDA graphs) with a fixed-size cache; each "
        "compiled peer, and cascade_generate (the default path, which compiles on CUDA), runs once untimed per "
        "batch size first (compilation and graph capture, reported as warmup_s)",
    )
    parser.add_argument("--skip-after-oom", action="store_true", default=True)
    parser.add_argument(
        "--workload", nargs="+", default=["shared"], choices=["shared", "stream", *SAMPLING_WORKLOADS],
        help="shared: B rows sharing --prefix (the grid above); nsamples / grpo: sampling workloads (docstring)",
    )
    parser.add_argument("--stream-peers", nargs="+", default=["cascade_generate", "hf_prefix_reuse", "sdpa"],
                        choices=[*CASCADE_GENERATE_PEERS, "hf_prefix_reuse", "sdpa"],
                        help="peers of --workload stream")
    parser.add_argument("--stream-passes", type=int, default=1,
                        help="--workload stream: run the stream this many times in one process (pass 0 is cold)")
    parser.add_argument("--stream-process-per-peer", action="store_true",
                        help="--workload stream: run each peer in a new process of its own (each pays its own "
                        "first-call costs), one after another, and compare their pass-0 totals")
    parser.add_argument("--output", default=None, help="JSON-lines file (default benchmarks/results/generate.jsonl)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU.")
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
        "generate_batch": run_generate_batch,
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
        return
    vocab = model.config.vocab_size
    workload = dict(layers=args.layers, prefix=args.prefix, suffix=args.suffix, new_tokens=args.new_tokens)
    # Warm-up with the timed shapes (Triton specialises kernels on integer arguments: ==1, %16), so that no
    # kernel compilation or library heuristic lands inside a timed run.
    ids, mask = make_batch(min(args.batches), args.prefix, args.suffix, vocab)
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

    from torch._dynamo.utils import counters as dynamo_counters

    out_of_memory = set()
    rows = []
    for batch in args.batches:
        ids, mask = make_batch(batch, args.prefix, args.suffix, vocab)
        tokens = {}
        for peer in args.peers:
            record = {"bench": "generate", "peer": peer, "batch": batch, **workload}
            if peer in out_of_memory:
                record["status"] = "skipped: out of memory at a smaller batch"
            else:
                try:
                    if peer.endswith("_compiled") or peer in CASCADE_GENERATE_PEERS:
                        # compile + capture for this batch size, untimed (cascade_generate: its default path compiles
                        # once per model and batch size; after a --workload stream run of this size, nothing)
                        record["warmup_s"], record["warmup_compile_s"], _ = timed_with_compile_breakdown(
                            lambda: runners[peer](model, ids, mask, args.new_tokens)
                        )
                        reset_memory()
                    result = median_run(lambda: runners[peer](model, ids, mask, args.new_tokens), args.repeats)
                    new = result.pop("new_tokens", None)
                    if new is not None:
                        tokens[peer] = new
                    record.update(result, status="ok")
                    record["tokens_per_s"] = batch * args.new_tokens / result["total_s"]
                    record["dynamo_unique_graphs_so_far"] = dynamo_counters["stats"]["unique_graphs"]
                except torch.OutOfMemoryError:
                    record["status"] = "out of memory"
                    out_of_memory.add(peer)
                except Exception as err:  # a peer failing must not hide the others' numbers
                    record["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
            reset_memory()
            if peer == "sdpa" and "sdpa" in tokens:
                for other in ("cascade", "cascade_compiled", *CASCADE_GENERATE_PEERS, "sdpa_compiled", "hf_prefix_reuse"):
                    if other in tokens and other != peer:
                        record[f"greedy_tokens_equal_{other}_frac"] = (tokens[other] == tokens[peer]).float().mean().item()
            writer.write(record)
            rows.append(record)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}, flush=True)

    print(f"\n{'peer':>17} {'B':>4} {'total s':>8} {'prefill s':>9} {'ms/step':>8} {'tok/s':>8} {'peak GiB':>8}  status")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"  # noqa: E731
        print(
            f"{r['peer']:>17} {r['batch']:>4} {f('total_s', '8.2f')} {f('prefill_s', '9.2f')} "
            f"{f('decode_ms_per_step', '8.1f')} {f('tokens_per_s', '8.0f')} {f('peak_gib', '8.1f')}  {r['status']}"
        )


if __name__ == "__main__":
    main()
