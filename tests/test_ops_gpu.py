"""GPU checks of the Triton kernels: bf16/fp16/fp32 against the fp32 reference on random shapes.

Run on the device machine: ``python -m pytest -q -m gpu tests/test_ops_gpu.py``. Compiled Triton
(not the interpreter) is what runs here, so this also catches compile-only problems (constexpr
globals, dot shapes, int64 offsets) that TRITON_INTERPRET=1 does not.
"""

import random

import pytest
import torch

from hf_cascade.ops import (
    cascade_attention,
    merge_attention_states,
    merge_attention_states_ref,
    plan_shared_prefix,
    shared_prefix_attention,
    shared_prefix_attention_ref,
    suffix_attention,
    suffix_attention_ref,
    triton_available,
)
from hf_cascade.ops._launch import cascade_triton, launch_configs
from hf_cascade.ops._launch import prefix_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADS = [(32, 8), (8, 8), (16, 1), (6, 2)]  # Llama-3-8B GQA, MHA, MQA, odd group


def assert_within_rounding(actual, ref32, dtype, floor=1e-5):
    """Flash-attention rule: error <= 2x the error of rounding the fp32 reference to ``dtype``.

    fp32 inputs: the kernel uses exact ("ieee") fp32 dots, so compare tightly instead.
    """
    err = (actual.float() - ref32).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4, f"fp32 max error {err:.3g}"
        return
    rounding = (ref32.to(dtype).float() - ref32).abs().max().item()
    assert err <= 2 * rounding + floor, f"max error {err:.3g} > 2 x rounding {rounding:.3g} + {floor}"


def assert_lse_close(actual, expected, atol):
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf pattern differs"
    fin = torch.isfinite(expected)
    torch.testing.assert_close(actual[fin], expected[fin], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_prefix_random_shapes(seed, dtype):
    rng = random.Random(seed)
    hq, hkv = rng.choice(HEADS)
    d = rng.choice([64, 80, 96, 128, 256])
    lq = rng.choice([1, 1, 7, 64])
    lens = [rng.choice([0, 1, 17, 300, 511, 4096]) for _ in range(rng.randint(1, 4))]
    B = rng.randint(1, 24)
    row_node = torch.tensor([rng.randrange(-1, len(lens)) for _ in range(B)], device="cuda")
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    gen = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(B, hq, lq, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(hkv, int(starts[-1]), d, device="cuda", generator=gen).to(dtype)
    v = torch.randn_like(k)
    scale = d ** -0.5
    out, lse = shared_prefix_attention(q, k, v, row_node, starts, scale=scale)  # auto -> triton
    ref_out, ref_lse = shared_prefix_attention_ref(q, k, v, row_node, starts, scale=scale)
    assert out.dtype == torch.float32
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_prefix_splits_agree(num_splits, dtype):
    B, hq, hkv, d = 64, 32, 8, 128  # Llama-3-8B decode step
    q = torch.randn(B, hq, 1, d, device="cuda").to(dtype)
    k = torch.randn(hkv, 4096, d, device="cuda").to(dtype)
    v = torch.randn_like(k)
    rows = torch.zeros(B, dtype=torch.int64, device="cuda")
    starts = torch.tensor([0, 4096])
    plan = plan_shared_prefix(rows, starts)
    out, lse = prefix_triton(q, k, v, plan, scale=d ** -0.5, softcap=None, num_splits=num_splits)
    ref_out, ref_lse = shared_prefix_attention_ref(q, k, v, rows, starts, scale=d ** -0.5)
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_suffix_random_shapes(seed, dtype):
    rng = random.Random(100 + seed)
    hq, hkv = rng.choice(HEADS)
    d = rng.choice([64, 80, 96, 128, 256])
    B = rng.randint(1, 16)
    lq = rng.choice([1, 1, 17, 128])
    S = lq + rng.choice([0, 3, 64, 700])
    mode = rng.choice(["causal", "full", "mask"])
    softcap = rng.choice([None, None, 50.0])
    q = torch.randn(B, hq, lq, d, device="cuda").to(dtype)
    k = torch.randn(B, hkv, S, d, device="cuda").to(dtype)
    v = torch.randn_like(k)
    mask = None
    if mode == "mask":  # left padding, one row fully padded
        pads = torch.randint(0, S + 1, (B,), device="cuda")
        mask = torch.arange(S, device="cuda")[None, None, :] >= pads[:, None, None]
        mask = mask & (torch.arange(S, device="cuda")[None, :] <= S - lq + torch.arange(lq, device="cuda")[:, None])
    with_prefix = rng.random() < 0.5
    po = torch.randn(B, hq, lq, d, device="cuda") if with_prefix else None
    pl = torch.randn(B, hq, lq, device="cuda") if with_prefix else None
    kwargs = dict(scale=d ** -0.5, mask=mask, causal=mode == "causal", softcap=softcap,
                  prefix_out=po, prefix_lse=pl)
    out, lse = suffix_attention(q, k, v, **kwargs)  # auto -> triton
    ref_out, ref_lse = suffix_attention_ref(q, k, v, **kwargs)
    assert out.dtype == dtype
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_merge(dtype):
    out_a = torch.randn(64, 32, 1, 128, device="cuda").to(dtype)
    out_b = torch.randn(64, 32, 1, 128, device="cuda")
    lse_a = torch.randn(64, 32, 1, device="cuda")
    lse_b = torch.randn(64, 32, 1, device="cuda")
    lse_a[0] = float("-inf")
    lse_b[1] = float("inf")
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, atol=1e-5)


def test_gpu_fused_cascade_matches_plain_attention_bf16():
    """Prefix pass + fused suffix pass == plain causal attention over [prefix | suffix] per row."""
    B, hq, hkv, d, P, S, lq = 8, 32, 8, 128, 1000, 37, 5
    q = torch.randn(B, hq, lq, d, device="cuda").to(torch.bfloat16)
    kp = torch.randn(hkv, P, d, device="cuda").to(torch.bfloat16)
    vp = torch.randn_like(kp)
    ks = torch.randn(B, hkv, S, d, device="cuda").to(torch.bfloat16)
    vs = torch.randn_like(ks)
    rows = torch.zeros(B, dtype=torch.int64, device="cuda")
    po, pl = shared_prefix_attention(q, kp, vp, rows, torch.tensor([0, P]), scale=d ** -0.5)
    out, _ = suffix_attention(q, ks, vs, scale=d ** -0.5, prefix_out=po, prefix_lse=pl)
    k_full = torch.cat([kp.expand(B, -1, -1, -1), ks], 2)
    v_full = torch.cat([vp.expand(B, -1, -1, -1), vs], 2)
    ref, _ = suffix_attention_ref(q, k_full, v_full, scale=d ** -0.5)  # causal bottom-right
    assert_within_rounding(out, ref, torch.bfloat16)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype,fused", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True),
                                         (torch.float32, False)])
def test_gpu_cascade_random_levels(seed, dtype, fused):
    """cascade_attention's two launch forms == the three ops composed: fused (last prefix level and suffix
    in one launch + state combine) and two-pass (suffix kernel merging the prefix states in its prologue)."""
    rng = random.Random(200 + seed)
    hq, hkv = rng.choice(HEADS)
    d = rng.choice([64, 128])  # few distinct compiles: this file runs in CI time on the device
    B = rng.choice([3, 64])
    lq = rng.choice([1, 1, 9])
    S = lq + rng.choice([0, 5, 130])
    gen = torch.Generator("cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(dtype)  # noqa: E731
    q, ks, vs = rnd(B, hq, lq, d), rnd(B, hkv, S, d), rnd(B, hkv, S, d)
    prefixes = []
    for _ in range(rng.randint(1, 2)):
        lens = [rng.choice([0, 1, 100, 1000, 5000]) for _ in range(rng.randint(1, 3))]
        row_node = torch.tensor([rng.randrange(-1, len(lens)) for _ in range(B)])
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        k, v = rnd(hkv, int(starts[-1]), d), rnd(hkv, int(starts[-1]), d)
        prefixes.append((k, v, plan_shared_prefix(row_node, starts, device="cuda"), row_node, starts))
    scale = d ** -0.5
    out, lse = cascade_triton(q, ks, vs, [p[:3] for p in prefixes], scale=scale, mask=None, causal=True,
                               softcap=None, fuse_suffix=fused)
    ref_out = ref_lse = None
    for k, v, _, row_node, starts in prefixes:
        o, l_ = shared_prefix_attention_ref(q, k, v, row_node, starts, scale=scale)
        ref_out, ref_lse = (o, l_) if ref_out is None else merge_attention_states_ref(ref_out, ref_lse, o, l_)
    ref_out, ref_lse = suffix_attention_ref(q, ks, vs, scale=scale, prefix_out=ref_out, prefix_lse=ref_lse)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, atol=1e-3)
    # The public op (cost model picks the form) gives the same answer.
    out2, _ = cascade_attention(q, ks, vs, [p[:3] for p in prefixes], scale=scale)
    assert_within_rounding(out2, ref_out, dtype)


def test_gpu_cascade_under_cuda_graph_is_repeatable():
    """Replaying a captured decode step gives the eager result, bit for bit (no state kept between calls)."""
    B, hq, hkv, d, P, S = 32, 32, 8, 128, 4096, 64
    q = torch.randn(B, hq, 1, d, device="cuda").to(torch.bfloat16)
    kp, vp = torch.randn(hkv, P, d, device="cuda").bfloat16(), torch.randn(hkv, P, d, device="cuda").bfloat16()
    ks, vs = torch.randn(B, hkv, S, d, device="cuda").bfloat16(), torch.randn(B, hkv, S, d, device="cuda").bfloat16()
    plan = plan_shared_prefix(torch.zeros(B, dtype=torch.int64), torch.tensor([0, P]), device="cuda")
    step = lambda: cascade_attention(q, ks, vs, [(kp, vp, plan)], scale=d ** -0.5)[0]  # noqa: E731
    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_gpu_fused_cascade_cuda_graph_replays_new_queries():
    """A captured fused decode step (prefix + suffix launch, then the state combine) is exact on every replay
    with new queries copied in: nothing of one replay leaks into the next. Each replay against the fp32 torch
    path."""
    B, hq, hkv, d, P, S = 32, 32, 8, 128, 4096, 128
    rnd = lambda *shape: torch.randn(*shape, device="cuda").bfloat16()  # noqa: E731
    q, kp, vp, ks, vs = rnd(B, hq, 1, d), rnd(hkv, P, d), rnd(hkv, P, d), rnd(B, hkv, S, d), rnd(B, hkv, S, d)
    rows, starts = torch.zeros(B, dtype=torch.int64), torch.tensor([0, P])
    prefixes = [(kp, vp, plan_shared_prefix(rows, starts, device="cuda"))]
    assert launch_configs(q, ks, prefixes)[0], "this decode step should take the fused launch"
    step = lambda: cascade_attention(q, ks, vs, prefixes, scale=d ** -0.5)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for _ in range(3):
        q.copy_(rnd(B, hq, 1, d))
        graph.replay()
        ref_out, ref_lse = shared_prefix_attention_ref(q, kp, vp, rows.cuda(), starts, scale=d ** -0.5)
        ref_out, ref_lse = suffix_attention_ref(q, ks, vs, scale=d ** -0.5, prefix_out=ref_out, prefix_lse=ref_lse)
        assert_within_rounding(out, ref_out, torch.bfloat16)
        assert_lse_close(lse, ref_lse, atol=1e-3)


def test_gpu_first_use_warms_the_triton_key():
    """On a CUDA machine ``import hf_cascade`` (and the registration when transformers' registry loads) starts no
    thread and leaves ``os.environ`` alone; ``prepare_triton()`` (the first use) starts one daemon thread that leaves
    Triton's cache key in Triton's own lru_cache (a new process: the key is not computed yet there), which a kernel
    module's import (the first launch) waits for, and shares the kernel cache with torch.compile without setting ``TRITON_CACHE_DIR``."""
    import subprocess
    import sys

    code = (
        "import os, threading\n"
        "env, threads = dict(os.environ), set(threading.enumerate())\n"
        "import hf_cascade, transformers.modeling_utils\n"
        "assert set(threading.enumerate()) == threads and 'TRITON_CACHE_DIR' not in os.environ\n"
        "from hf_cascade.ops._backend import prepare_triton, warm_triton_key, _triton_key_function\n"
        "thread = prepare_triton()\n"
        "assert thread is not None and thread.daemon and prepare_triton() is thread and warm_triton_key() is thread\n"
        "import hf_cascade.ops._kv_write_kernel\n"  # the first launch's import waits for the thread (10 s at most)
        "assert not thread.is_alive()\n"
        "thread.join(60)\n"
        "assert _triton_key_function().cache_info().currsize == 1\n"
        "assert 'TRITON_CACHE_DIR' not in os.environ\n"
        "from triton import knobs\n"
        "from torch._inductor.runtime.cache_dir_utils import triton_cache_dir\n"
        "assert knobs.cache.dir == triton_cache_dir(0), knobs.cache.dir\n"
    )
    drop = ("TRITON_INTERPRET", "HF_CASCADE_WARM_TRITON_KEY", "TRITON_CACHE_DIR")
    env = {k: v for k, v in __import__("os").environ.items() if k not in drop}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_gpu_prefix_schedule_is_queued_without_waiting_for_the_gpu():
    """A plan's kernel schedule is built at a layer's first call, while the prefill of the prefix nodes still runs:
    its index tensors are copied like kernels, never with a wait for the queued work (seen on an H100: a 52 ms host
    wait in a B=32, P=4K generate() call, after which the GPU waited for the host's suffix prefill launches)."""
    plan = plan_shared_prefix(torch.tensor([0, 1, 0, -1, 1]), torch.tensor([0, 700, 900]), device="cuda")
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # work in flight
        busy = busy @ busy / 45.0
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched = plan.schedule(4, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sched.tile_node.device.type == "cuda" and sched.num_tiles == len(sched.tile_node)
    assert sched.rows.tolist() == [0, 2, 1, 4, 3]
