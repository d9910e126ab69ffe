"""The peers of the end-to-end generate() benchmarks and their workloads' batches (moved out of
``bench_generate.py``, which re-exports them): a Llama-3-8B-shaped model, hf_cascade's calls, generate() with sdpa,
transformers' prefix-reuse recipe, transformers' continuous batching (``generate_batch``, :mod:`cb_peer`), the bf16
gate that stops a run before timing a wrong answer, and the sampling workloads' peers."""

from __future__ import annotations

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cb_peer  # noqa: E402
from common import timed_with_compile_breakdown, wall_time  # noqa: E402

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


def make_batch(batch: int, prefix: int, suffix: int, vocab: int, device="cuda"):
    g = torch.Generator().manual_seed(batch)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    rows = torch.randint(3, vocab, (batch, suffix), generator=g)
    ids = torch.cat([shared.expand(batch, -1), rows], dim=1).to(device)
    return ids, torch.ones_like(ids)


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reset_memory():
    gc.collect()
    if torch.cuda.is_available():
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


class PeerFailed(RuntimeError):
    """A peer's call failed; ``record`` is what it recorded (its settings and ``status``)."""

    def __init__(self, record: dict):
        super().__init__(record.get("status", "failed"))
        self.record = record


def run_generate_batch(model, ids, mask, new_tokens, config: str = "defaults", calls: int = 1,
                       settings: dict | None = None, **sampling):
    """transformers' continuous batching with prefix sharing (:func:`cb_peer.run_generate_batch`) on the rows of
    ``ids`` (no padding: every row is a full prompt), greedy unless ``sampling`` (``do_sample=True, top_k=...``);
    ``config``: a :data:`cb_peer.CB_CONFIGS` name, ``settings`` added to it. ``new_tokens`` in the record: a
    tensor, as the other peers'."""
    rows = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
    gen = cb_peer.sampling_config(new_tokens, sampling.get("top_k", 50)) if sampling.get("do_sample") \
        else cb_peer.greedy_config(new_tokens)
    record = cb_peer.run_generate_batch(model, rows, gen, config, calls=calls, settings=settings)
    tokens = record.pop("new_tokens")
    record.pop("peer")  # the caller's peer name stays (``generate_batch`` is the defaults' older name)
    if record["status"] != "ok":
        raise PeerFailed(record)
    if tokens and len({len(t) for t in tokens}) == 1:
        record["new_tokens"] = torch.tensor(tokens, device=ids.device)
    return record


CB_PEERS = {f"generate_batch_{name}": name for name in cb_peer.CB_CONFIGS}
CB_PEERS["generate_batch"] = "defaults"  # the name earlier runs used for the defaults


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


def make_sampling_batch(name: str, vocab: int, device="cuda", dims: tuple | None = None):
    """The prompts of a sampling workload (``dims``: its ``SAMPLING_WORKLOADS`` entry, or smaller ones)."""
    prompts, shared, own, _, _ = dims or SAMPLING_WORKLOADS[name]
    g = torch.Generator().manual_seed(len(name))
    system = torch.randint(3, vocab, (shared,), generator=g)
    rows = torch.randint(3, vocab, (prompts, own), generator=g)
    ids = torch.cat([system.expand(prompts, -1), rows], dim=1).to(device)
    return ids, torch.ones_like(ids)


def dynamic_cache_nbytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run_sampling(model, peer: str, ids, mask, samples: int, new_tokens: int, cb_calls: int = 1,
                 cb_settings: dict | None = None) -> dict:
    """The user's own generate() call with num_return_sequences; cascade = the same call + custom_generate;
    hf_prefix_reuse = transformers' recipe: the rows' common prefix prefilled once into a DynamicCache, repeated
    for every sample row, then generate() on the repeated rows (each prompt's own tokens prefilled per sample);
    generate_batch_* (:data:`CB_PEERS`): the repeated rows, ``cb_calls`` calls (rows sharing a prompt share its
    complete pages)."""
    if peer in CB_PEERS:
        rows = ids.repeat_interleave(samples, dim=0)
        record = run_generate_batch(model, rows, mask.repeat_interleave(samples, dim=0), new_tokens, CB_PEERS[peer],
                                    calls=cb_calls, settings=cb_settings, do_sample=True, top_k=50)
        record.pop("new_tokens", None)
        record["samples_via"] = "repeated rows"
        if "total_s" in record:
            record["tokens_per_s"] = rows.shape[0] * new_tokens / record["total_s"]
        return record
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


def make_tree_batch(levels, own: int, rows: int, vocab: int, seed: int, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    segments = [[torch.randint(3, vocab, (tokens,), generator=g) for _ in range(groups)] for groups, tokens in levels]
    batch = []
    for r in range(rows):
        parts = [segments[l][r * groups // rows] for l, (groups, _) in enumerate(levels)]
        batch.append(torch.cat(parts + [torch.randint(3, vocab, (own,), generator=g)]))
    ids = torch.stack(batch).to(device)
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


# The tree workload (issue 51): 64 rows; 1,024 tokens shared by all, then 4 documents of 2,048 tokens, each shared by
# 16 rows; 64 own tokens per row; 64 new tokens, greedy.
TREE_LEVELS, TREE_OWN, TREE_ROWS, TREE_SEED = [(1, 1024), (4, 2048)], 64, 64, 51
