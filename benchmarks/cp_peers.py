"""Peers and floors for ``bench_context_parallel.py`` (imported by it; every function runs on the ranks it names).

* :func:`copy_bandwidth`: the GPU's device-to-device copy bandwidth (bytes read + written per second), the
  roofline's denominator.
* :func:`combine_latency`: one layer's combine (``combine_all_gather`` of a decode step's state) against the bare
  NCCL all-gather of the same bytes, both recorded into a CUDA graph (32 in a row, as a step runs them), so the
  number is the device time the step pays, not the host's launch cost.
* :func:`block_kernels`: a ring block (causal, bf16) by PyTorch's flash kernel against hf_cascade's suffix kernel:
  time, and the LSE/output error against an fp32 reference.
* :func:`ring_attention_peers`: one layer's ring attention over a long sequence, hf_cascade's zigzag ring against
  PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``, load-balanced
  ring over sdpa). (The whole-model form failed: transformers builds a mask for the sharded positions, which
  context_parallel cannot shard; results of 2026-11-26.)
* :func:`static_cache_decode`: transformers' static cache with the decode step under ``torch.compile``
  (``mode="reduce-overhead"``: CUDA graphs), one GPU: the fastest 1-GPU decode a transformers user sets up.
* :func:`synthetic_inputs`: a context-parallel cache holding random KV of a given length (decode timing at lengths
  whose prefill would not fit the lease; the step reads the same bytes; flagged ``kv="synthetic"``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from common import copy_bandwidth_gbs, cuda_time


def _cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` by CUDA events (:func:`common.cuda_time`)."""
    return cuda_time(fn, warmup=warmup, repeat=reps)["ms"] / 1e3


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, read + write counted (:func:`common.copy_bandwidth_gbs`)."""
    return copy_bandwidth_gbs() * 1e9


def combine_latency(group, n: int, heads: int = 32, head_dim: int = 128, layers: int = 32) -> dict:
    """Per-layer device time of the combine and of the bare all-gather of its bytes (CUDA graphs, ``layers`` in a
    row). Ranks of ``group`` only."""
    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel.combine import _all_gather_flat, combine_all_gather

    info = resolve_group(group)
    out = torch.randn(1, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(1, heads, 1, device="cuda")
    packed = torch.randn(heads * (head_dim + 1), device="cuda")
    gathered = torch.empty(n * packed.numel(), device="cuda")

    def combines():
        for _ in range(layers):
            combine_all_gather(out, lse, info)

    def gathers():
        for _ in range(layers):
            _all_gather_flat(gathered, packed, info)

    result = {"message_bytes": packed.numel() * 4}
    for name, fn in (("combine", combines), ("all_gather", gathers)):
        fn()  # communicators and kernels ready before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            fn()
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        dist.barrier(group=group)
        result[f"{name}_us_per_layer"] = 1e6 * _cuda_time(graph.replay) / layers
    return result


def block_kernels(length: int = 16384, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> list[dict]:
    """A causal ring block of ``length`` tokens (bf16): flash vs suffix kernel time; errors on a 2K block."""
    from hf_cascade.ops.fused_attention import fused_attention
    from hf_cascade.ops.reference import fused_attention_ref
    from hf_cascade.ops.suffix_attention import suffix_attention

    records = []
    scale = head_dim ** -0.5
    for n_tok, timed in ((2048, False), (length, True)):
        g = torch.Generator(device="cuda").manual_seed(n_tok)
        q = torch.randn(1, heads, n_tok, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, kv_heads, n_tok, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, kv_heads, n_tok, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        kernels = {
            "cudnn": lambda: fused_attention(q, k, v, scale=scale, causal=True, kernel="cudnn"),
            "flash": lambda: fused_attention(q, k, v, scale=scale, causal=True),
            "suffix": lambda: suffix_attention(q, k, v, scale=scale, causal=True),
        }
        if not timed:
            ref_out, ref_lse = fused_attention_ref(q.float(), k.float(), v.float(), scale=scale, causal=True)
            rounding = ((ref_out.bfloat16().float() - ref_out).norm() / ref_out.norm()).item()
        for name, fn in kernels.items():
            rec = {"kernel": name, "tokens": n_tok}
            if timed:
                seconds = _cuda_time(fn, reps=5, warmup=1)
                flops = 4 * heads * head_dim * n_tok * n_tok / 2
                rec.update(ms=1e3 * seconds, tflops=flops / seconds / 1e12)
            else:
                out, lse = fn()
                rec.update(out_rel_err=((out.float() - ref_out).norm() / ref_out.norm()).item(),
                           lse_max_abs_err=(lse - ref_lse).abs().max().item(), bf16_rounding_rel_err=rounding)
            records.append(rec)
    from hf_cascade.ops.fused_attention import cudnn_attention_agrees
    records.append({"kernel": "cudnn", "agrees_with_flash": cudnn_attention_agrees(q.device)})
    return records


def ring_attention_peers(group, n: int, length: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                         gqa: bool = False) -> dict:
    """One layer's exact causal attention over ``length`` tokens sharded on the ``n`` ranks of ``group`` (bf16):
    hf_cascade's zigzag ring (:func:`~hf_cascade.parallel.ring.ring_attention`) against PyTorch's own context
    parallelism (``context_parallel`` over ``F.scaled_dot_product_attention(is_causal=True)``, load-balanced ring).
    ``gqa``: PyTorch's gets ``kv_heads`` heads and ``enable_gqa=True``; else the KV heads repeated to ``heads`` (as
    transformers' ``repeat_kv`` gives them). Device time per layer, the slowest rank's."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel.layout import ZigzagLayout
    from hf_cascade.parallel.ring import ring_attention

    info = resolve_group(group)
    scale = head_dim ** -0.5
    layout = ZigzagLayout(length, n)
    c = layout.chunk
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, heads, 2 * c, head_dim, **opts)
    k = torch.randn(1, kv_heads, 2 * c, head_dim, **opts)
    v = torch.randn(1, kv_heads, 2 * c, head_dim, **opts)
    result = {"tokens": length}
    dist.barrier(group=group)
    result["hf_cascade_ms"] = 1e3 * _cuda_time(lambda: ring_attention(q, k, v, layout=layout, info=info,
                                                                       scale=scale), reps=5, warmup=1)
    del q, k, v
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options
        _cp_options.enable_load_balance = True
    except ImportError:
        pass
    mesh = DeviceMesh.from_group(group, "cuda")
    kv = kv_heads if gqa else heads
    Q = torch.randn(1, heads, length, head_dim, **opts)
    K = torch.randn(1, kv, length, head_dim, **opts)
    V = torch.randn(1, kv, length, head_dim, **opts)
    extra = {"enable_gqa": True} if gqa else {}
    dist.barrier(group=group)
    with context_parallel(mesh, buffers=[Q, K, V], buffer_seq_dims=[2, 2, 2], no_restore_buffers={Q, K, V}):
        result["torch_cp_ms"] = 1e3 * _cuda_time(
            lambda: F.scaled_dot_product_attention(Q, K, V, is_causal=True, scale=scale, **extra), reps=5, warmup=1)
    result["torch_cp_gqa"] = gqa
    times = torch.tensor([result["hf_cascade_ms"], result["torch_cp_ms"]], device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    result["hf_cascade_ms"], result["torch_cp_ms"] = times.tolist()
    return result


def static_cache_decode(model, ids: torch.Tensor, steps: int) -> dict:
    """transformers' StaticCache + ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``, as
    generate(cache_implementation="static") runs it: sdpa prefill of ``ids`` ``[1, L]``, then greedy decode steps.
    Returns the compile (first steps) and per-step times. One GPU (this rank)."""
    from transformers import StaticCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        length = ids.shape[1]
        cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def decode(i):
            position = torch.tensor([length + i], device=ids.device)
            logits = step(input_ids=token, past_key_values=cache, cache_position=position,
                          position_ids=position[None], use_cache=True).logits
            return logits[:, -1].argmax(-1, keepdim=True)

        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(3):  # compile + CUDA-graph recording
            token = decode(i)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(3, 3 + steps):
            token = decode(i)
        torch.cuda.synchronize()
        return {"compile_s": compile_s, "step_ms": 1e3 * (time.perf_counter() - start) / steps}
    finally:
        model.set_attn_implementation(previous)


def synthetic_inputs(model, group, n: int, rank: int, context: int) -> dict:
    """``context_parallel_inputs`` of a short prompt, then every layer's prompt shard replaced by random KV so the
    cache holds ``context`` prompt tokens (``context / n`` per rank, ascending columns): a decode step reads exactly
    the bytes a prefilled cache of that length holds. For timing only (the tokens are meaningless)."""
    import hf_cascade
    from hf_cascade.transformers_compat import CACHE_KWARG

    short = torch.randint(3, model.config.vocab_size, (1, 8 * n + 1), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(0))
    inputs = hf_cascade.context_parallel_inputs(model, short, group=group)
    cache = inputs[CACHE_KWARG]
    per_rank = context // n
    for layer in cache.layers:
        k = layer.keys
        shape = (1, k.shape[1], per_rank, k.shape[3])
        layer.keys = torch.randn(shape, device="cuda", dtype=k.dtype)
        layer.values = torch.randn(shape, device="cuda", dtype=k.dtype)
        layer.cols = torch.arange(rank * per_rank, (rank + 1) * per_rank, device="cuda")
        layer.length = per_rank * n
        layer._buffers = None
    cache._prompt_length = cache._base_length = per_rank * n
    cache._base_counts = [per_rank] * n
    cache._counts = list(cache._base_counts)
    ids = torch.randint(3, model.config.vocab_size, (1, per_rank * n + 1), device="cuda")
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    return inputs
