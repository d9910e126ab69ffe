"""Long prompts over several GPUs: real 128K..1M-token prefill + decode, memory, the capacity check (one launch).

    torchrun --nproc_per_node 4 benchmarks/bench_long_context.py --out benchmarks/results
    torchrun --nproc_per_node 2 benchmarks/bench_long_context.py --tiny --out /tmp/cp     # CPU smoke test (gloo)

Llama-3-8B-shaped random bf16 model, the user's own calls (``context_parallel_inputs`` then ``generate``). Records go
to ``<out>/context_parallel.jsonl`` (GPU, versions, git SHA in each; ``kv="real"``: a real prefill, never synthetic):

* ``check_rounds_fp32``: 2-layer 8B-width fp32 model, 4,099-token prompt prefilled in rounds of
  ``--check-chunk`` columns per rank (several rounds at every GPU count): greedy tokens identical to 1-GPU sdpa
  ``generate()``, logits within 1e-3, on 1, 2 and all GPUs.
* ``capacity``: the longest prompt the capacity check admits on all GPUs (from its error for a prompt far too long),
  then a prompt 10% over it: every rank must raise, and how long that takes.
* ``long_prefill`` / ``long_decode`` (all GPUs, each ``--lengths``, then with phase ``longest`` the longest prompt
  the capacity check admits): prefill seconds, peak allocated and reserved
  memory beyond weights + KV (+ decode buffers), KV per GPU; then the decode step (difference of two generate()
  lengths) against its roofline (weights + this GPU's KV) / measured copy bandwidth.
* ``long_scaling`` (``--scaling-tokens``): the same prompt on 1, 2 and all GPUs and transformers' sdpa on one GPU,
  each twice (``first_seconds``: the first prefill of these shapes in the process; ``seconds``: the second;
  % of ideal = sdpa's second / (GPUs x hf_cascade's second)).
* ``ring_attention_vs_torch_cp``: one layer's exact causal attention at ``--torch-cp-tokens``, hf_cascade's zigzag
  ring against PyTorch's own ``context_parallel`` (GQA).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_context_parallel as cp  # noqa: E402
import cp_peers  # noqa: E402
import hf_cascade  # noqa: E402
from hf_cascade.parallel.fixed import DecodeBuffers  # noqa: E402,F401  (the decode buffers counted below)

GiB = 2**30


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1048576,524288,262144,131072", help="prompt lengths on all GPUs, in order")
    p.add_argument("--scaling-tokens", type=int, default=131072, help="prompt of the 1/2/N-GPU scaling (0: skip)")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens generated after each long prompt (0: prefill only, no decode timing)")
    p.add_argument("--decode-steps", type=int, default=32, help="steps of the decode timing (difference of 2 calls)")
    p.add_argument("--check-chunk", type=int, default=512, help="columns per rank per round in the fp32 check")
    p.add_argument("--torch-cp-tokens", type=int, default=524288, help="one-layer ring peer length (0: skip)")
    p.add_argument("--phases", default="check,capacity,long,scaling,peers")
    p.add_argument("--budget-s", type=float, default=540.0, help="start nothing new after this many seconds")
    p.add_argument("--tiny", action="store_true", help="CPU/gloo smoke test with a tiny model")
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args()


def memory_state() -> dict:
    if not torch.cuda.is_available():
        return dict(peak_allocated=0, peak_reserved=0, allocated=0, reserved=0)
    return dict(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())


def segment_summary() -> dict:
    """What the caching allocator holds (this rank): segments, their free bytes, the largest free blocks (GiB)."""
    if not torch.cuda.is_available():
        return {}
    segments = torch.cuda.memory_snapshot()
    free = sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"), reverse=True)
    partly = [s for s in segments if 0 < s["allocated_size"] < s["total_size"]]
    holes = sum(s["total_size"] - s["allocated_size"] for s in partly)  # what empty_cache cannot hand back
    return dict(segments=len(segments), reserved_gib=sum(s["total_size"] for s in segments) / GiB,
                free_in_segments_gib=sum(free) / GiB, segments_partly_free=len(partly),
                free_in_partly_used_segments_gib=holes / GiB,
                largest_free_blocks_mib=[round(b / 2**20, 1) for b in free[:8]],
                segment_sizes_mib=sorted((round(s["total_size"] / 2**20) for s in segments), reverse=True)[:12])


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_rounds_fp32(args, groups, record):
    """Exact: fp32 tokens identical to 1-GPU sdpa with the prompt prefilled in several rounds, 1/2/N GPUs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config = cp.llama3_8b_config(2, args.tiny)
    model = cp.build_model(config, torch.float32, cp._device(), seed=1)
    ids = cp.prompt(4099 if not args.tiny else 37, config.vocab_size)
    chunk = args.check_chunk if not args.tiny else 4
    gen = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)  # no hf_cascade cache: plain sdpa
    for n, group in groups.items():
        if group is None:
            dist.barrier()
            continue
        inputs = hf_cascade.context_parallel_inputs(model, ids, group=group, prefill_chunk_tokens=chunk)
        out = model.generate(**inputs, **gen)
        err = cp.group_max((torch.stack(out.logits) - torch.stack(ref.logits)).abs().max().item(), group)
        same = cp.group_max(float(not torch.equal(out.sequences, ref.sequences)), group) == 0
        rounds = -(-(ids.shape[1] - 1) // (n * chunk))
        record(dict(kind="check_rounds_fp32", gpus=n, prompt_tokens=ids.shape[1], prefill_chunk_tokens=chunk,
                    rounds=rounds, tokens_match=same, max_logit_err=err, passed=same and err < 1e-3))
        dist.barrier()
    del model
    torch.backends.cuda.matmul.allow_tf32 = True


def _refusal(model, length, group, memory):
    """Call context_parallel_inputs with a prompt of ``length`` tokens that must not fit: (raised?, message, s)."""
    ids = cp.prompt(length, model.config.vocab_size)
    start = time.perf_counter()
    try:
        inputs = hf_cascade.context_parallel_inputs(model, ids, group=group, memory_per_rank=memory)
    except ValueError as err:
        return True, str(err), time.perf_counter() - start
    del inputs
    return False, "", time.perf_counter() - start


def check_capacity(args, model, group, n, record):
    """The longest prompt the check admits on n GPUs; a prompt 10% over it must raise on every rank, fast."""
    import re

    memory = None if not args.tiny else 3 << 30  # measured on GPUs; a small budget (beyond the slack) on the CPU smoke test
    raised, message, _ = _refusal(model, 16 * 1048576 if not args.tiny else 10**7, group, memory)
    match = re.search(r"longest prompt that fits is about ([\d,]+) tokens", message)
    if not raised or match is None or int(match.group(1).replace(",", "")) <= 0:
        record(dict(kind="capacity", gpus=n, passed=False, error=message[:400] or "a 16M-token prompt did not raise"))
        return None
    longest = int(match.group(1).replace(",", ""))
    over = int(longest * 1.1)
    raised, message, seconds = _refusal(model, over, group, memory)
    everyone = torch.tensor([float(raised), seconds], device=cp._device())
    gathered = [torch.empty_like(everyone) for _ in range(n)]
    dist.all_gather(gathered, everyone, group=group)
    all_raised = all(bool(g[0]) for g in gathered)
    slowest = max(float(g[1]) for g in gathered)
    record(dict(kind="capacity", gpus=n, longest_admitted_tokens=longest, over_tokens=over,
                every_rank_raised=all_raised, slowest_rank_raise_s=slowest, message=message[:600],
                passed=all_raised and slowest < 30))
    return longest


def long_prompt(args, model, group, n, length, bandwidth, record):
    """One long prompt on ``n`` GPUs: prefill, memory, decode step."""
    weights = weight_bytes(model)
    cp.reset_peak()
    ids = cp.prompt(length, model.config.vocab_size)
    before = memory_state()  # after empty_cache: what the weights (and their segments' holes) hold
    seconds, inputs = cp.timed(lambda: hf_cascade.context_parallel_inputs(model, ids, group=group), group)
    cache = inputs[hf_cascade.CACHE_KWARG]
    mem = memory_state()
    kv = cache.nbytes
    beyond = mem["peak_allocated"] - weights - kv
    # The prefill's own growth: what it reserved beyond what it allocated, apart from the weights' segments.
    grown_reserved = mem["peak_reserved"] - before["reserved"]
    grown_allocated = mem["peak_allocated"] - before["allocated"]
    layout = segment_summary() if dist.get_rank() == 0 else {}
    record(dict(kind="long_prefill", gpus=n, tokens=length, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), seconds=seconds, tokens_per_s=length / seconds,
                kv="real", kv_gib_per_gpu=cp.group_max(kv, group) / GiB, weights_gib=weights / GiB,
                peak_allocated_gib=cp.group_max(mem["peak_allocated"], group) / GiB,
                peak_reserved_gib=cp.group_max(mem["peak_reserved"], group) / GiB,
                beyond_weights_kv_gib=cp.group_max(beyond, group) / GiB,
                reserved_over_allocated=cp.group_max(mem["peak_reserved"] / max(1, mem["peak_allocated"]), group),
                before_allocated_gib=cp.group_max(before["allocated"], group) / GiB,
                before_reserved_gib=cp.group_max(before["reserved"], group) / GiB,
                prefill_reserved_over_allocated=cp.group_max(grown_reserved / max(1, grown_allocated), group),
                segment_releases=cp.group_max(cache.prefill_releases, group),
                rank0_allocator=layout))
    if args.new_tokens <= 0:  # prefill only (a prompt whose prefill alone fills the launch's time); the next
        return  # prompt's reset_peak hands this one's memory back
    steps = args.decode_steps

    def gen(k):
        return model.generate(**inputs, max_new_tokens=k, min_new_tokens=k, do_sample=False)

    cp.reset_peak()
    first_s, out = cp.timed(lambda: gen(args.new_tokens), group)  # the user's call: buffers, compile, record
    new = out[:, ids.shape[1]:]
    gathered = [torch.empty_like(new) for _ in range(n)]
    dist.all_gather(gathered, new, group=group)
    agree = all(torch.equal(g, gathered[0]) for g in gathered)
    t1, _ = cp.timed(lambda: gen(1), group)
    tk, _ = cp.timed(lambda: gen(1 + steps), group)
    step_ms = 1000.0 * (tk - t1) / steps
    mem = memory_state()
    held = cache.nbytes  # prompt KV + the fixed decode buffers
    roofline_ms = 1e3 * (weights - model.get_input_embeddings().weight.nbytes + cp.group_max(held, group)) / bandwidth
    record(dict(kind="long_decode", gpus=n, context=length, kv="real", new_tokens=args.new_tokens,
                generate_s=first_s, step_ms=step_ms, roofline_ms=roofline_ms, x_roofline=step_ms / roofline_ms,
                ranks_agree=agree, decode_buffers_gib=cp.group_max(held - kv, group) / GiB,
                beyond_weights_kv_decode_gib=cp.group_max(mem["peak_allocated"] - weights - held, group) / GiB,
                peak_reserved_gib=cp.group_max(mem["peak_reserved"], group) / GiB, passed=agree))
    del inputs, cache, out
    cp.reset_peak()


def scaling(args, model, groups, record):
    """The same prompt on 1, 2, N GPUs and plain sdpa on one GPU (transformers, no hf_cascade)."""
    length = args.scaling_tokens if not args.tiny else 256
    ids = cp.prompt(length, model.config.vocab_size)
    times = {}
    for n, group in groups.items():
        if group is not None:
            first, started = None, []
            for _ in range(2):  # the group's first prefill of these shapes, then the same again
                cp.reset_peak()
                started.append(time.time())  # (wall clock: to place Triton builds logged by variant_log)
                seconds, inputs = cp.timed(lambda: hf_cascade.context_parallel_inputs(model, ids, group=group), group)
                first = seconds if first is None else first
                mem = memory_state()
                peak, reserved = cp.group_max(mem["peak_allocated"], group), cp.group_max(mem["peak_reserved"], group)
                kv = cp.group_max(inputs[hf_cascade.CACHE_KWARG].nbytes, group)
                releases = cp.group_max(inputs[hf_cascade.CACHE_KWARG].prefill_releases, group)
                del inputs
            times[n] = seconds
            record(dict(kind="long_scaling", gpus=n, tokens=length, seconds=seconds, first_seconds=first,
                        started_at=started, peak_allocated_gib=peak / GiB, peak_reserved_gib=reserved / GiB,
                        reserved_over_allocated=reserved / max(1, peak), segment_releases=releases,
                        kv_gib_per_gpu=kv / GiB))
        dist.barrier()
    if dist.get_rank() == 0:
        from transformers import DynamicCache

        sdpa_runs = []
        with cp.plain_sdpa(model):
            for _ in range(2):  # its first prefill of these shapes, then the same again
                cp.reset_peak()
                sdpa_runs.append(cp.timed(lambda: model.base_model(input_ids=ids, past_key_values=DynamicCache(),
                                                                   use_cache=True), groups[1])[0])
        sdpa_s = sdpa_runs[-1]
        record(dict(kind="long_scaling_sdpa_1gpu", gpus=1, tokens=length, seconds=sdpa_s, first_seconds=sdpa_runs[0],
                    peak_allocated_gib=memory_state()["peak_allocated"] / GiB))
        for n, t in times.items():
            record(dict(kind="long_scaling_pct", gpus=n, tokens=length, seconds=t, sdpa_1gpu_seconds=sdpa_s,
                        pct_of_ideal=100.0 * sdpa_s / (n * t)))
    cp.reset_peak()
    dist.barrier()


def main():
    args = parse_args()
    cp_args = argparse.Namespace(budget_s=args.budget_s)
    args.tiny = cp.start_process_group(args.tiny, datetime.timedelta(minutes=4))  # a failed rank: minutes, not 30
    world = dist.get_world_size()
    groups = cp.sub_groups([s for s in (1, 2, 4, 8) if s < world] + [world])
    record = cp.Recorder(args.out, cp.env_info(world))
    records = []
    recorder = lambda r: (records.append(r), record(r))  # noqa: E731
    phases = args.phases.split(",")
    lengths = [int(x) for x in args.lengths.split(",")] if not args.tiny else [300, 97]
    top = groups[world]
    if "check" in phases:
        check_rounds_fp32(args, groups, recorder)
    model = cp.build_model(cp.llama3_8b_config(32, args.tiny), torch.bfloat16 if not args.tiny else torch.float32,
                           cp._device())
    bandwidth = 3.0e12
    if torch.cuda.is_available():
        t = torch.tensor([cp_peers.copy_bandwidth()], device=cp._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        bandwidth = float(t)
        recorder(dict(kind="copy_bandwidth", tb_per_s=bandwidth / 1e12))
    with torch.no_grad():
        hf_cascade.context_parallel_inputs(model, cp.prompt(4096 if not args.tiny else 32, model.config.vocab_size),
                                           group=top)  # warm-up: NCCL communicators, kernels
        longest = check_capacity(args, model, top, world, recorder) if "capacity" in phases else None
        if "long" in phases:
            for length in lengths:
                if cp.out_of_time(cp_args):
                    recorder(dict(kind="long_prefill", gpus=world, tokens=length, skipped="time budget"))
                    continue
                long_prompt(args, model, top, world, length, bandwidth, recorder)
        if "longest" in phases and not args.tiny and not cp.out_of_time(cp_args):
            if "long" in phases or longest is None:  # the decode graphs of the prompts before hold memory: ask again
                cp.reset_peak()
                longest = check_capacity(args, model, top, world, recorder)
            if longest:
                long_prompt(args, model, top, world, longest, bandwidth, recorder)  # what the check admits, run
        if "scaling" in phases and args.scaling_tokens and not cp.out_of_time(cp_args):
            scaling(args, model, groups, recorder)
        if "peers" in phases and args.torch_cp_tokens and world > 1 and torch.cuda.is_available() \
                and not cp.out_of_time(cp_args):
            try:
                rec = cp_peers.ring_attention_peers(top, world, args.torch_cp_tokens, gqa=True)
                recorder(dict(kind="ring_attention_vs_torch_cp", gpus=world, **rec,
                              hf_cascade_speedup=rec["torch_cp_ms"] / rec["hf_cascade_ms"]))
            except Exception as err:  # noqa: BLE001 (a peer that cannot run is recorded)
                recorder(dict(kind="ring_attention_vs_torch_cp", gpus=world, error=f"{type(err).__name__}: {err}"[:300]))
    dist.barrier()
    failed = [r for r in records if r.get("passed") is False]
    if dist.get_rank() == 0:
        print(f"checks: {'FAILED ' + str(len(failed)) if failed else 'all passed'}; results in {record.path}")
    sys.stdout.flush()
    sys.stderr.flush()
    # No destroy_process_group(): with NCCL sub-groups it can hang at exit (seen on 4x H100, 2026-11-27).
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
