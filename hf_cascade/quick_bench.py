"""The benchmark of ``python -m hf_cascade bench``: greedy ``generate()`` timed with and without
``custom_generate=hf_cascade.generate``, on the installed package alone (no checkout, no download).

The workload is the README's headline row: a Llama-3-8B-shaped model with random bf16 weights, ``batch`` rows
sharing one ``prefix``-token prompt, each with ``suffix`` tokens of its own, ``new_tokens`` new tokens per row (every
row makes all of them: the random model has no end-of-sequence token). Both peers run the same call on the same
weights; ``sdpa`` is the stock attention with transformers' dynamic cache. Each peer is called once untimed (it
compiles and builds its kernels: that call's time is reported as ``first_call_s``), then ``repeats`` times; the
median is reported. The repository's ``benchmarks/`` suites measure more peers and workloads.

:func:`run` measures (a dict), :func:`format_report` writes what the command prints.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

# Llama-3-8B's shape (the weights are random: nothing is downloaded).
def _config_value(config, name: str):
    """``config.name``, or (transformers >= 5.18 keeps ``rope_theta`` there) ``config.rope_parameters[name]``."""
    if hasattr(config, name):
        return getattr(config, name)
    return (getattr(config, "rope_parameters", None) or {}).get(name)


LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=16384,
    rope_theta=500000.0,
)
PEERS = ("sdpa", "cascade")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_model(layers: int = 32, *, device="cuda", dtype: torch.dtype = torch.bfloat16, sizes: dict | None = None):
    """A Llama-3-8B-shaped causal LM of ``layers`` decoder layers with random weights (seeded) on ``device``, loaded
    with ``attn_implementation="cascade"`` and no end-of-sequence token. ``sizes``: config overrides (a smaller
    model, e.g. for tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers, **(sizes or {})},
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def shared_prefix_batch(batch: int, prefix: int, suffix: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: ``batch`` rows of one shared ``prefix``-token prompt + ``suffix`` tokens of
    their own (random ids, seeded), no padding."""
    g = torch.Generator().manual_seed(batch)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    own = torch.randint(3, vocab, (batch, suffix), generator=g)
    ids = torch.cat([shared.expand(batch, -1), own], dim=1).to(device)
    return ids, torch.ones_like(ids)


def _seconds(fn, cuda: bool):
    """Wall seconds of ``fn()``, the device's queued work included, and its result."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def run(
    *,
    layers: int = 32,
    batch: int = 32,
    prefix: int = 4096,
    suffix: int = 64,
    new_tokens: int = 64,
    repeats: int = 3,
    device: str = "cuda",
    dtype: str = "bfloat16",
    model=None,
) -> dict:
    """Time both peers on the workload (see the module's docstring); ``model``: one already built (with
    ``attn_implementation="cascade"``) instead of :func:`build_model`'s."""
    import hf_cascade
    from hf_cascade.ops._backend import prepare_triton

    if min(layers, batch, prefix, new_tokens, repeats) < 1 or suffix < 0:
        raise ValueError("bench: --layers, --batch, --prefix, --new-tokens and --repeats must be >= 1 and --suffix "
                         f">= 0; got {layers}, {batch}, {prefix}, {new_tokens}, {repeats} and {suffix}.")
    if dtype not in DTYPES:
        raise ValueError(f"bench: dtype must be one of {sorted(DTYPES)}; got {dtype!r}.")
    prepare_triton()  # Triton's cache key hashed while the model is built (CUDA only; see its docstring)
    start = time.perf_counter()
    if model is None:
        model = build_model(layers, device=device, dtype=DTYPES[dtype])
    build_s = time.perf_counter() - start
    cuda = model.device.type == "cuda"
    ids, mask = shared_prefix_batch(batch, prefix, suffix, model.config.vocab_size, model.device)
    call = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0)
    extra = {"sdpa": {}, "cascade": {"custom_generate": hf_cascade.generate}}
    peers, tokens = {}, {}
    try:
        for peer in PEERS:
            model.set_attn_implementation(peer)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            generate = lambda: model.generate(ids, **call, **extra[peer])  # noqa: E731
            first_s, out = _seconds(generate, cuda)
            runs = [_seconds(generate, cuda)[0] for _ in range(repeats)]
            tokens[peer] = out[:, ids.shape[1]:]
            peers[peer] = {"seconds": statistics.median(runs), "runs": runs, "first_call_s": first_s,
                           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    finally:
        model.set_attn_implementation("cascade")
    config = model.config
    shaped = all(_config_value(config, k) == v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers")
    return {
        "model": f"{'Llama-3-8B-shaped' if shaped else 'Llama'} model, random weights ({config.num_hidden_layers} "
        "layers)",
        "model_shape": f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} q / {config.num_key_value_heads} kv heads",
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(model.device) if cuda else str(model.device),
        "build_s": build_s,
        "batch": batch,
        "prefix": prefix,
        "suffix": suffix,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "peers": peers,
        "speedup": peers["sdpa"]["seconds"] / peers["cascade"]["seconds"],
        "identical_rows": int((tokens["sdpa"] == tokens["cascade"]).all(dim=1).sum()),
    }


def format_report(r: dict) -> str:
    """What ``python -m hf_cascade bench`` prints, from :func:`run`'s dict."""
    sdpa, cascade = r["peers"]["sdpa"], r["peers"]["cascade"]
    call = f"model.generate(ids, attention_mask=mask, max_new_tokens={r['new_tokens']}, do_sample=False)"
    median = f"generate(), median of {r['repeats']}"
    faster = f"{r['speedup']:.1f}x faster" if r["speedup"] >= 1.05 else f"{r['speedup']:.2f}x the speed"
    lines = [
        f"hf_cascade bench: {r['model']}, {r['dtype']} on {r['device']} (built in {r['build_s']:.1f} s)",
        f"{r['batch']} rows sharing a {r['prefix']:,}-token prompt + {r['suffix']} tokens of their own, "
        f"{r['new_tokens']} new tokens each (greedy)",
        f"  sdpa:    {call}",
        "  cascade: the same call + custom_generate=hf_cascade.generate",
        "",
        f"{'':<30}{'sdpa':>10}{'cascade':>10}",
        f"{median:<30}{sdpa['seconds']:>8.2f} s{cascade['seconds']:>8.2f} s   {faster}",
        f"{'first call (compiles, builds)':<30}{sdpa['first_call_s']:>8.2f} s{cascade['first_call_s']:>8.2f} s",
    ]
    if sdpa["peak_gib"] is not None:
        lines.append(f"{'peak GPU memory':<30}{sdpa['peak_gib']:>6.1f} GiB{cascade['peak_gib']:>6.1f} GiB")
    lines.append(f"identical tokens: {r['identical_rows']}/{r['batch']} rows"
                 + ("" if r["identical_rows"] == r["batch"] or r["dtype"] == "float32" else
                    f" ({r['dtype']} rounding differs between the two attention paths and can flip near-tie tokens "
                    "of a random model)"))
    return "\n".join(lines)
