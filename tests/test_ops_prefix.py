"""shared_prefix_attention: Triton kernel and torch path against float64 attention over each node.

The float64 check is independent of hf_cascade's reference: it loops over rows and heads and
repeats KV heads explicitly. Triton cases run under TRITON_INTERPRET=1 (CI) or on CUDA; bf16 is in
tests/test_ops_gpu.py (the interpreter cannot multiply bf16).
"""


import pytest
import torch

from hf_cascade.ops import (
    plan_shared_prefix,
    shared_prefix_attention,
    shared_prefix_attention_ref,
)
from hf_cascade.ops._launch import prefix_triton

from _ops_common import CUDA, DEVICE, needs_triton, BACKENDS, NEG_INF

# Node lengths: an empty node, a 1-token node, 17 tokens, and 511 (spans several KV blocks and
# splits, not a multiple of any block size).
NODE_LENS = (0, 1, 17, 511)
# Batch rows -> node: node 3 has non-adjacent rows 0 and 3, row 1 has no node, row 5 sits on the
# empty node (all four get out 0 / lse -inf or real values accordingly).
ROW_NODE = (3, -1, 2, 3, 1, 0)


def make_inputs(hq, hkv, lq, d, dtype, lens=NODE_LENS, row_node=ROW_NODE):
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    T = int(starts[-1])
    q = torch.randn(len(row_node), hq, lq, d, device=DEVICE).to(dtype)
    k = torch.randn(hkv, T, d, device=DEVICE).to(dtype)
    v = torch.randn(hkv, T, d, device=DEVICE).to(dtype)
    rows = torch.tensor(row_node, dtype=torch.int64, device=DEVICE)
    return q, k, v, rows, starts


def prefix_attention_f64(q, k, v, row_node, starts, scale, softcap=None):
    """Plain softmax attention per row over its node's keys, float64, explicit KV-head repeat."""
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[0]
    out = torch.zeros(B, Hq, Lq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), NEG_INF, dtype=torch.float64)
    for b, n in enumerate(row_node.tolist()):
        if n < 0 or starts[n + 1] == starts[n]:
            continue
        kk = k[:, starts[n]:starts[n + 1]].double().cpu().repeat_interleave(g, 0)  # [Hq, L, D]
        vv = v[:, starts[n]:starts[n + 1]].double().cpu().repeat_interleave(g, 0)
        s = q[b].double().cpu() @ kk.transpose(1, 2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[b] = torch.softmax(s, -1) @ vv
        lse[b] = torch.logsumexp(s, -1)
    return out, lse


def assert_lse_close(actual, expected, atol):
    assert actual.dtype == torch.float32
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf pattern differs"
    fin = torch.isfinite(expected)
    torch.testing.assert_close(actual[fin], expected[fin], atol=atol, rtol=1e-5)


def check(out, lse, q, k, v, rows, starts, scale, softcap=None):
    """fp32: tight vs float64. fp16: flash-attention rule against the fp32 reference."""
    B, Hq, Lq, D = q.shape
    assert out.shape == (B, Hq, Lq, D) and out.dtype == torch.float32
    assert lse.shape == (B, Hq, Lq) and lse.dtype == torch.float32
    exp_out, exp_lse = prefix_attention_f64(q, k, v, rows, starts, scale, softcap)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), exp_out, atol=2e-5, rtol=1e-4)
        assert_lse_close(lse, exp_lse, atol=2e-5)
        return
    # Low precision: the kernel rounds P to q.dtype before the PV product, like flash-attention.
    ref_out, _ = shared_prefix_attention_ref(q, k, v, rows, starts, scale=scale, softcap=softcap)
    err = (out - ref_out).abs().max().item()
    rounding = (ref_out.to(q.dtype).float() - ref_out).abs().max().item()
    assert err <= 2 * rounding + 1e-5, f"max error {err:.3g} > 2 x rounding {rounding:.3g}"
    # LSE only sees fp32-accumulated q.k of the same fp16 inputs: close to the float64 value.
    assert_lse_close(lse, exp_lse, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lq", [1, 17])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_prefix_matches_float64(backend, dtype, lq, hq, hkv):
    q, k, v, rows, starts = make_inputs(hq, hkv, lq, 64, dtype)
    scale = 64 ** -0.5
    out, lse = shared_prefix_attention(q, k, v, rows, starts, scale=scale, backend=backend)
    check(out, lse, q, k, v, rows, starts, scale)
    # Rows without a node and rows on the empty node: out exactly 0, lse -inf.
    for b in (1, 5):
        assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [80, 96])  # padded BLOCK_D = 128 with masking
def test_prefix_odd_head_dim(backend, d):
    q, k, v, rows, starts = make_inputs(6, 2, 3, d, torch.float32, lens=(5, 70), row_node=(1, 0, 1))
    out, lse = shared_prefix_attention(q, k, v, rows, starts, scale=d ** -0.5, backend=backend)
    check(out, lse, q, k, v, rows, starts, d ** -0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_softcap(backend, dtype):
    q, k, v, rows, starts = make_inputs(4, 2, 5, 64, dtype, lens=(40, 9), row_node=(1, 0, 0))
    q = q * 4  # large scores so the cap matters
    out, lse = shared_prefix_attention(q, k, v, rows, starts, scale=0.125, softcap=5.0, backend=backend)
    check(out, lse, q, k, v, rows, starts, 0.125, softcap=5.0)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_prefix_kv_splits(num_splits):
    """Every split count gives the same answer (9 splits leave empty splits on short nodes)."""
    q, k, v, rows, starts = make_inputs(6, 2, 2, 64, torch.float32, lens=(1, 17, 300), row_node=(2, 1, 0, 2))
    plan = plan_shared_prefix(rows, starts)
    out, lse = prefix_triton(q, k, v, plan, scale=0.125, softcap=None, num_splits=num_splits,
                              block_m=16, block_n=16)
    check(out, lse, q, k, v, rows, starts, 0.125)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_single_node_all_rows_and_noncontiguous_query(backend):
    """The common case: one shared prompt for the whole batch; query is a transposed view."""
    B, Hq, Hkv, Lq, D = 5, 4, 2, 17, 64
    q = torch.randn(B, Lq, Hq, D, device=DEVICE).transpose(1, 2)  # transformers' layout
    k = torch.randn(Hkv, 33, D, device=DEVICE)
    v = torch.randn(Hkv, 33, D, device=DEVICE)
    rows = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    starts = torch.tensor([0, 33])
    out, lse = shared_prefix_attention(q, k, v, rows, starts, scale=0.125, backend=backend)
    check(out, lse, q, k, v, rows, starts, 0.125)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_plan_reuse_and_no_keys(backend):
    q, k, v, rows, starts = make_inputs(4, 2, 1, 64, torch.float32)
    plan = plan_shared_prefix(rows, starts)
    first = shared_prefix_attention(q, k, v, rows, starts, scale=0.1, backend=backend, plan=plan)
    again = shared_prefix_attention(q, k, v, rows, starts, scale=0.1, backend=backend, plan=plan)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # T = 0 (no nodes at all, every row -1): out 0, lse -inf.
    empty = torch.zeros(2, 0, 64, device=DEVICE)
    rows0 = torch.full((q.shape[0],), -1, dtype=torch.int64, device=DEVICE)
    out, lse = shared_prefix_attention(q, empty, empty, rows0, torch.zeros(1, dtype=torch.int64),
                                       scale=0.1, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_prefix_rejects_bad_inputs():
    q, k, v, rows, starts = make_inputs(6, 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match=r"multiple of key heads.*\(4, "):
        shared_prefix_attention(q, k[:1].expand(4, -1, -1), v[:1].expand(4, -1, -1), rows, starts, scale=0.1)
    with pytest.raises(ValueError, match=r"row_node values must be in \[-1, 3\]"):
        shared_prefix_attention(q, k, v, torch.tensor([4, 0, 0, 0, 0, 0]), starts, scale=0.1)
    with pytest.raises(ValueError, match="nondecreasing"):
        shared_prefix_attention(q, k, v, rows, torch.tensor([0, 5, 3, 10, 529]), scale=0.1)
    with pytest.raises(ValueError, match=r"\[Hkv, T, D\]"):
        shared_prefix_attention(q, k[None], v[None], rows, starts, scale=0.1)
    with pytest.raises(ValueError, match="dtype"):
        shared_prefix_attention(q.half(), k, v, rows, starts, scale=0.1)
    plan = plan_shared_prefix(rows[:3], starts)
    with pytest.raises(ValueError, match="plan"):
        shared_prefix_attention(q, k, v, rows, starts, scale=0.1, plan=plan)
