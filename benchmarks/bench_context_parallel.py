"""Context-parallel prefill / decode benchmark: Llama-3-8B-shaped random bf16 model, 1..N GPUs of one host.

One invocation per machine checks correctness and then times everything, on sub-groups of the launched ranks
(ranks [0], [0, 1], [0..3], ... : the 1-GPU baseline and every power of two up to N):

    torchrun --nproc_per_node 4 benchmarks/bench_context_parallel.py --out benchmarks/results
    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --lengths 32768,131072

Workloads (each record is one JSON line in ``<out>/context_parallel.jsonl``; GPU name, versions, git SHA in each):

* ``check_fp32``: 2-layer Llama-3-8B-width model, fp32, odd prompt: context-parallel generate() (every
  ``--combines`` method, every group size) must give the tokens of single-GPU sdpa generate(), logits within 1e-3.
* ``check_bf16``: the full bf16 model, 4K prompt: first-step logits vs single-GPU sdpa (cosine, max abs diff,
  top-1), greedy tokens agreement, each combine == the first one, every rank the same tokens.
* ``prefill``: ``context_parallel_inputs`` time per prompt length and GPU count (after a warm-up; median of
  ``--reps`` for prompts <= 32K, else one run), % of ideal scaling ``t_1 / (n * t_n)``, peak memory and KV bytes
  per GPU. 1-GPU runs above ``--max-1gpu-tokens`` (or that run out of memory) are extrapolated from the measured
  ones (``t = a L + b L^2``, flagged ``extrapolated``). Plus the 1-GPU sdpa prefill (transformers, no hf_cascade)
  for reference.
* ``decode``: per-step latency at each ``--decode-contexts`` length, per GPU count, for every ``--combines``
  method (default ``all_gather`` = one all-gather per layer, ``tree`` = two all-reduces, ``all_to_all``), the
  ``all_gather_kv`` baseline, and ``no_combine`` (communication removed: wrong numbers, same compute), which
  gives each combine's share of a step.
* ``longest``: the longest prompt per GPU count estimated from the measured memory (weights + per-token slope).

CPU smoke test of this script (gloo, tiny model):
``torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --tiny --out /tmp/cp``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

# Run from a checkout without installing the package (torchrun puts only benchmarks/ on sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cp_peers  # noqa: E402
import hf_cascade  # noqa: E402
import hf_cascade.parallel.fixed as fixed  # noqa: E402
from hf_cascade.decode.captured_step import _model_graphs, recorded_steps  # noqa: E402
from hf_cascade.parallel.combine import STATE_COMBINES, combine_states  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=None, help="prefill lengths (default 32768,131072 and 524288 on >= 4 GPUs)")
    p.add_argument("--decode-contexts", default="32768,131072", help="context lengths of the decode timings")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="repetitions of each prefill <= 128K (median reported)")
    p.add_argument("--max-1gpu-tokens", type=int, default=262144, help="longer 1-GPU prefills are extrapolated")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (32 in Llama-3-8B)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="skip (GPUs, length) points above this many prompt tokens per GPU (saves time on big grids)")
    p.add_argument("--combines", default=",".join(STATE_COMBINES),
                   help=f"exact combines to check and time, comma-separated (default: all of {STATE_COMBINES})")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU/gloo smoke test with a tiny model")
    p.add_argument("--phases", default="check,kernels,prefill,decode,peers",
                   help="subset of check,kernels,prefill,decode,peers to run, in this order")
    p.add_argument("--max-real-decode-context", type=int, default=131072,
                   help="longer decode contexts hold a synthetic KV of that length (flagged kv=synthetic)")
    p.add_argument("--static-peer-context", type=int, default=131072,
                   help="context of the 1-GPU static-cache compiled decode peer (0: skip)")
    p.add_argument("--no-torch-cp", dest="torch_cp", action="store_false",
                   help="skip PyTorch's context_parallel ring-attention peer")
    p.add_argument("--torch-cp-tokens", type=int, default=131072, help="sequence of the ring-attention peer")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting new measurements after this many seconds (the device tool's 10-min limit)")
    p.add_argument("--out", default="benchmarks/results", help="directory of context_parallel.jsonl")
    args = p.parse_args()
    args.combines = [c.strip() for c in args.combines.split(",") if c.strip()]
    bad = [c for c in args.combines if c not in STATE_COMBINES]
    if bad or not args.combines:
        p.error(f"--combines: unknown {bad}; choose from {STATE_COMBINES}")
    return args


# ----------------------------------------------------------------------------- setup
def llama3_8b_config(layers: int, tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=1 << 20)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=1 << 21, bos_token_id=128000, eos_token_id=128001)


def build_model(config, dtype, device, seed=0):
    """Random-init model, identical on every rank (same seed, same device type)."""
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="cascade", dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def env_info(world: int) -> dict:
    def version(name):
        try:
            return __import__(name).__version__
        except Exception:
            return None

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        sha = ""
    cuda = torch.cuda.is_available()
    return dict(
        gpu=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        gpus_launched=world, torch=torch.__version__, transformers=version("transformers"),
        triton=version("triton"), hf_cascade=hf_cascade.__version__, cuda=torch.version.cuda,
        git_sha=os.environ.get("GIT_SHA") or sha or "unknown", backend=dist.get_backend(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


class Recorder:
    def __init__(self, out_dir: str, env: dict):
        self.env, self.path = env, os.path.join(out_dir, "context_parallel.jsonl")
        if dist.get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)

    def __call__(self, record: dict) -> None:
        if dist.get_rank() == 0:
            print(json.dumps(record), flush=True)  # compact on stdout; the file gets the machine info too
            with open(self.path, "a") as f:
                f.write(json.dumps({"bench": "context_parallel", **record, **self.env}) + "\n")


_START = time.monotonic()


def out_of_time(args, group=None) -> bool:
    """Same answer on every rank of ``group`` (rank 0's clock decides)."""
    flag = torch.tensor([float(time.monotonic() - _START > args.budget_s)], device=_device())
    dist.broadcast(flag, src=0, group=group)
    return bool(flag.item())


@contextlib.contextmanager
def plain_sdpa(model):
    """``model`` running transformers' own sdpa (the peer), then its cascade attention again. Without a
    hf_cascade cache the cascade attention falls back to sdpa too, but never on cuDNN's kernel outside compiled
    graphs (hf_cascade.attention.plain_attention): a 128K prefill then took 17.3 s on an H200 against sdpa's 12.1 s."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, group) -> tuple[float, object]:
    """Run ``fn`` on the ranks of ``group``; seconds = the slowest rank's."""
    dist.barrier(group=group)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    elapsed = torch.tensor([time.perf_counter() - start], device=_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed), result


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def group_max(value: float, group) -> float:
    t = torch.tensor([float(value)], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def peak_memory() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def prompt(length: int, vocab: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)  # identical on every rank
    return torch.randint(3, vocab, (batch, length), generator=g).to(_device())


# ----------------------------------------------------------------------------- workloads
def check_fp32(args, groups, record):
    """Exactness on the GPU path (NCCL + Triton): fp32, tokens identical to 1-GPU sdpa, logits within 1e-3."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config = llama3_8b_config(2, args.tiny)
    model = build_model(config, torch.float32, _device(), seed=1)
    ids = prompt(4099 if not args.tiny else 37, config.vocab_size)
    gen = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)  # no hf_cascade cache: plain sdpa
    for n, group in groups.items():
        for combine in args.combines:
            for step in ("auto", "eager"):  # the default (recorded on CUDA) and the opt-out
                if group is None:
                    continue
                inputs = hf_cascade.context_parallel_inputs(model, ids, combine=combine, group=group, decode_step=step)
                out = model.generate(**inputs, **gen)
                again = model.generate(**inputs, **gen)  # the recorded graph replayed from the first step
                err = group_max((torch.stack(out.logits) - torch.stack(ref.logits)).abs().max().item(), group)
                same = group_max(float(not (torch.equal(out.sequences, ref.sequences)
                                            and torch.equal(again.sequences, ref.sequences))), group) == 0
                record(dict(kind="check_fp32", gpus=n, combine=combine, decode_step=step, tokens_match=same,
                            max_logit_err=err, passed=same and err < 1e-3, prompt_tokens=ids.shape[1],
                            graphs=recorded_steps(model)))
    del model
    torch.backends.cuda.matmul.allow_tf32 = True


def check_bf16(args, model, groups, record):
    """bf16, real model shape: first-step logits vs 1-GPU sdpa, token agreement, every combine == the first."""
    ids = prompt(4096 if not args.tiny else 40, model.config.vocab_size)
    gen = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    ref_first = ref.logits[0].float()
    for n, group in groups.items():
        if group is None:
            continue
        outs = {c: model.generate(**hf_cascade.context_parallel_inputs(model, ids, combine=c, group=group), **gen)
                for c in args.combines}
        main = args.combines[0]
        first = outs[main].logits[0].float()
        cos = torch.nn.functional.cosine_similarity(first, ref_first, dim=-1).min().item()
        new = outs[main].sequences[:, ids.shape[1]:]
        ref_new = ref.sequences[:, ids.shape[1]:]
        agree = (new == ref_new).float().mean().item()
        gathered = [torch.empty_like(new) for _ in range(n)]
        dist.all_gather(gathered, new, group=group)
        ranks_agree = all(torch.equal(g, gathered[0]) for g in gathered)
        combines_equal = {f"{main}_equals_{c}": torch.equal(outs[main].sequences, outs[c].sequences)
                          for c in args.combines[1:]}
        top1 = bool((first.argmax(-1) == ref_first.argmax(-1)).all())
        record(dict(kind="check_bf16", gpus=n, combine=main, first_logits_cosine=cos,
                    first_logits_max_abs_diff=(first - ref_first).abs().max().item(), top1_match=top1,
                    greedy_token_agreement=agree, ranks_agree=ranks_agree, **combines_equal,
                    # bf16 sanity check only (exactness is the fp32 check): a random-init 32-layer bf16 model has
                    # near-tied top logits, so top-1 and bitwise equality between combines are recorded, not
                    # required (on 8xH200 even the 1-GPU path, no communication, had cosine 0.9991 vs sdpa).
                    passed=ranks_agree and cos > 0.998, prompt_tokens=ids.shape[1]))


def bench_prefill(args, model, groups, lengths, record):
    measured = {}  # (n, length) -> seconds
    for n, group in groups.items():  # warm-up: Triton compilation, NCCL communicators
        if group is not None:
            hf_cascade.context_parallel_inputs(model, prompt(4096 if not args.tiny else 32, model.config.vocab_size),
                                               group=group)
        dist.barrier()
    for length in lengths:
        ids = prompt(length, model.config.vocab_size)
        for n, group in groups.items():
            if out_of_time(args):
                record(dict(kind="prefill", gpus=n, tokens=length, skipped="time budget"))
                continue
            if (n == 1 and length > args.max_1gpu_tokens) or too_many_per_gpu(args, length, n):
                continue
            if group is None:
                dist.barrier()
                continue
            reps = args.reps if length <= 32768 else 1
            times, oom = [], False
            reset_peak()
            try:
                for _ in range(reps):
                    seconds, inputs = timed(lambda: hf_cascade.context_parallel_inputs(model, ids, group=group), group)
                    times.append(seconds)
                    nbytes = inputs[hf_cascade.CACHE_KWARG].nbytes
                    del inputs
            except torch.cuda.OutOfMemoryError:
                if n != 1:
                    raise
                oom = True  # 1 GPU: no peer waits on this rank
            dist.barrier()
            if oom:
                record(dict(kind="prefill", gpus=n, tokens=length, out_of_memory=True))
                continue
            seconds = statistics.median(times)
            measured[(n, length)] = seconds

            record(dict(kind="prefill", gpus=n, tokens=length, seconds=seconds, reps=len(times),
                        tokens_per_s=length / seconds, peak_memory_gib=group_max(peak_memory(), group) / 2**30,
                        kv_gib_per_gpu=group_max(nbytes, group) / 2**30))
    # 1-GPU times that were not measured: fit t = a L + b L^2 through the measured 1-GPU points.
    ones = sorted((length, t) for (n, length), t in measured.items() if n == 1)
    for length in lengths:
        base, extrapolated = measured.get((1, length)), False
        if base is None and len(ones) >= 2:
            (l1, t1), (l2, t2) = ones[-2], ones[-1]
            b = (t2 / l2 - t1 / l1) / (l2 - l1)
            base, extrapolated = (t1 / l1 - b * l1) * length + b * length**2, True
        for n in groups:
            if n > 1 and base is not None and (n, length) in measured:
                record(dict(kind="prefill_scaling", gpus=n, tokens=length, seconds=measured[(n, length)],
                            one_gpu_seconds=base, one_gpu_extrapolated=extrapolated,
                            pct_of_ideal=100.0 * base / (n * measured[(n, length)])))
    # Reference: transformers' own single-GPU prefill (sdpa, DynamicCache), no hf_cascade.
    for length in lengths:
        if length > min(args.max_1gpu_tokens, 131072) or out_of_time(args):
            continue
        if dist.get_rank() == 0:
            from transformers import DynamicCache

            ids = prompt(length, model.config.vocab_size)
            try:
                with plain_sdpa(model):
                    seconds, _ = timed(lambda: model.base_model(input_ids=ids, past_key_values=DynamicCache(),
                                                                use_cache=True), groups[1])
                record(dict(kind="prefill_sdpa_1gpu", gpus=1, tokens=length, seconds=seconds))
            except torch.cuda.OutOfMemoryError:
                record(dict(kind="prefill_sdpa_1gpu", gpus=1, tokens=length, out_of_memory=True))
        dist.barrier()
    return measured


def _no_combine(out, lse, info, combine):
    return out, lse


def too_many_per_gpu(args, tokens, gpus):
    """Whether --max-tokens-per-gpu rules this point out (the same answer on every rank: no barrier needed)."""
    return args.max_tokens_per_gpu is not None and tokens > args.max_tokens_per_gpu * gpus


def _weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter but the input embedding table (one row read)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def _decode_inputs(args, model, group, n, context):
    """Prefilled inputs (real prefill up to --max-real-decode-context, else a synthetic KV of that length)."""
    if context <= args.max_real_decode_context:
        return hf_cascade.context_parallel_inputs(model, prompt(context, model.config.vocab_size), group=group), "real"
    return cp_peers.synthetic_inputs(model, group, n, dist.get_rank(group), context), "synthetic"


def bench_decode(args, model, groups, contexts, record, bandwidth):
    """Per-step latency of every decode method; roofline = (weights + this rank's KV) / copy bandwidth."""
    steps = args.decode_steps
    weights = _weight_bytes(model)
    for context in contexts:
        for n, group in groups.items():
            if out_of_time(args):
                record(dict(kind="decode", gpus=n, context=context, skipped="time budget"))
                continue
            if too_many_per_gpu(args, context, n):
                continue
            if group is None:
                dist.barrier()
                continue
            try:
                inputs, kv = _decode_inputs(args, model, group, n, context)
            except torch.cuda.OutOfMemoryError:
                if n != 1:
                    raise
                inputs = None
            dist.barrier()
            if inputs is None:
                record(dict(kind="decode", gpus=n, context=context, out_of_memory=True))
                reset_peak()
                continue
            cache = inputs[hf_cascade.CACHE_KWARG]
            # eager first (growing KV: the earlier default), then the recorded default and its no-combine twin
            # (the eager step appends to a copy of a synthetic KV: twice its memory; not run there)
            methods = (["eager"] if kv == "real" else []) + ["default"] + (["no_combine"] if n > 1 else [])
            step_ms = {}
            for method in methods:
                cache.decode_step = "eager" if method == "eager" else "auto"
                patched = method == "no_combine"
                if patched:
                    fixed.combine_states = _no_combine
                _model_graphs(model).graphs.clear()  # a graph recorded with the combine must not serve no_combine
                try:
                    def gen(k):
                        return model.generate(**inputs, max_new_tokens=k, min_new_tokens=k, do_sample=False)

                    gen(1 + steps)  # warm-up: buffers sized, layers compiled, the step recorded
                    t1, _ = timed(lambda: gen(1), group)
                    tk, _ = timed(lambda: gen(1 + steps), group)
                finally:
                    fixed.combine_states = combine_states
                step_ms[method] = 1000.0 * (tk - t1) / steps
                held = group_max(cache.nbytes, group)
                roofline_ms = 1e3 * (weights + held) / bandwidth
                record(dict(kind="decode", gpus=n, context=context, method=method, combine=cache.combine,
                            step_ms=step_ms[method], steps=steps, kv=kv, kv_gib_per_gpu=held / 2**30,
                            roofline_ms=roofline_ms, x_roofline=step_ms[method] / roofline_ms))
            if "no_combine" in step_ms:
                record(dict(kind="decode_combine_overhead", gpus=n, context=context, combine=cache.combine,
                            pct_of_step=100.0 * (step_ms["default"] - step_ms["no_combine"]) / step_ms["default"]))
            del inputs, cache
            _model_graphs(model).graphs.clear()
            reset_peak()
        dist.barrier()


def bench_kernels(args, groups, record):
    """Copy bandwidth, the ring block's kernels, the combine against a bare all-gather of its bytes."""
    bandwidth = torch.tensor([cp_peers.copy_bandwidth()], device=_device())
    dist.all_reduce(bandwidth, op=dist.ReduceOp.MIN)
    record(dict(kind="copy_bandwidth", tb_per_s=float(bandwidth) / 1e12))
    if dist.get_rank() == 0:
        for rec in cp_peers.block_kernels():
            record(dict(kind="ring_block_kernel", **rec))
    dist.barrier()
    for n, group in groups.items():
        if n > 1 and group is not None:
            rec = cp_peers.combine_latency(group, n, layers=args.layers)
            record(dict(kind="combine_latency", gpus=n, **rec))
        dist.barrier()
    return float(bandwidth)


def bench_peers(args, model, groups, record):
    """PyTorch's context parallelism (one layer's ring attention, per GPU count), then the 1-GPU transformers static
    cache compiled decode (the fastest 1-GPU decode a user sets up)."""
    if args.torch_cp:
        for n, group in groups.items():
            if n > 1 and group is not None and not out_of_time(args, group):
                for gqa in (False, True):
                    try:
                        rec = cp_peers.ring_attention_peers(group, n, args.torch_cp_tokens, gqa=gqa)
                        record(dict(kind="ring_attention_vs_torch_cp", gpus=n, **rec,
                                    hf_cascade_speedup=rec["torch_cp_ms"] / rec["hf_cascade_ms"]))
                    except Exception as err:  # noqa: BLE001 (recorded: the peer may not take this input)
                        record(dict(kind="ring_attention_vs_torch_cp", gpus=n, torch_cp_gqa=gqa,
                                    error=f"{type(err).__name__}: {str(err)[:300]}"))
                    reset_peak()
            dist.barrier()
    context = args.static_peer_context
    if context and not out_of_time(args) and dist.get_rank() == 0:
        try:
            rec = cp_peers.static_cache_decode(model, prompt(context, model.config.vocab_size), args.decode_steps)
            record(dict(kind="decode_static_compiled_1gpu", gpus=1, context=context, **rec))
        except Exception as err:  # noqa: BLE001 (a peer that cannot run is recorded, not fatal)
            record(dict(kind="decode_static_compiled_1gpu", gpus=1, context=context,
                        error=f"{type(err).__name__}: {str(err)[:300]}"))
        reset_peak()
    dist.barrier()


def estimate_longest(prefill_records, capacity_gib, record):
    """From (tokens, peak GiB) per GPU count: peak = fixed + slope * tokens -> tokens at the GPU's capacity."""
    by_n = {}
    for r in prefill_records:
        if "peak_memory_gib" in r:
            by_n.setdefault(r["gpus"], []).append((r["tokens"], r["peak_memory_gib"]))
    for n, points in sorted(by_n.items()):
        points.sort()
        if len(points) < 2:
            continue
        (l1, m1), (l2, m2) = points[-2], points[-1]
        slope = (m2 - m1) / (l2 - l1)
        longest = int(l2 + (capacity_gib - m2) / slope) if slope > 0 else None
        record(dict(kind="longest", gpus=n, longest_tested=l2, peak_gib_at_longest_tested=m2,
                    gib_per_1k_tokens=slope * 1024, estimated_longest_prompt=longest, capacity_gib=capacity_gib))


def start_process_group(tiny: bool, timeout: datetime.timedelta) -> bool:
    """gloo on CPU (or with ``tiny``), else NCCL with this rank's GPU; returns whether this is the CPU smoke test."""
    if tiny or not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return True
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", timeout=timeout)
    return False


def sub_groups(sizes: list[int]) -> dict:
    """``{n: the group of ranks [0, n) or None on the ranks outside it}``: every rank creates every group."""
    groups = {}
    for n in sizes:
        g = dist.new_group(list(range(n)))
        groups[n] = g if dist.get_rank() < n else None
    return groups


def main():
    args = parse_args()
    args.tiny = start_process_group(args.tiny, datetime.timedelta(minutes=30))  # 1-GPU runs: the others wait
    world = dist.get_world_size()
    groups = sub_groups([n for n in (1, 2, 4, 8, 16) if n <= world])
    record = Recorder(args.out, env_info(world))
    if args.tiny:
        lengths = [int(x) for x in (args.lengths or "64,256").split(",")]
        contexts = [128]
    else:
        default = "32768,131072,524288" if world >= 4 else "32768,131072"
        lengths = [int(x) for x in (args.lengths or default).split(",")]
        contexts = [int(x) for x in args.decode_contexts.split(",")]

    records = []
    recorder = lambda r: (records.append(r), record(r))  # noqa: E731
    phases = set(args.phases.split(","))
    check = "check" in phases and not args.skip_check
    if check:
        check_fp32(args, groups, recorder)
    model = build_model(llama3_8b_config(args.layers, args.tiny), torch.bfloat16 if not args.tiny else torch.float32,
                        _device())
    if check:
        check_bf16(args, model, groups, recorder)
    bandwidth = None
    with torch.no_grad():
        for phase in args.phases.split(","):  # in the order given: the first phases get the time budget first
            if phase == "kernels" and torch.cuda.is_available():
                bandwidth = bench_kernels(args, groups, recorder)
            elif phase == "prefill":
                bench_prefill(args, model, groups, lengths, recorder)
            elif phase == "decode":
                bench_decode(args, model, groups, contexts, recorder, bandwidth or 3.0e12)
            elif phase == "peers" and torch.cuda.is_available():
                bench_peers(args, model, groups, recorder)
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0
    if capacity:
        estimate_longest([r for r in records if r.get("kind") == "prefill"], capacity, recorder)
    dist.barrier()
    failed = [r for r in records if r.get("passed") is False]
    if dist.get_rank() == 0:
        print(f"checks: {'FAILED ' + str(len(failed)) if failed else 'all passed'}; results in {record.path}")
    dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
