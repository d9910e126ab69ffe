"""merge_attention_states: Triton kernel and torch path against the fp32 reference and float64 math.

Triton cases run under TRITON_INTERPRET=1 (CI) or on CUDA; bf16 is not tested under the
interpreter (it cannot multiply bf16) and is covered by tests/test_ops_gpu.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from hf_cascade.ops import merge_attention_states, merge_attention_states_ref, triton_available

from _ops_common import CUDA, DEVICE, BACKENDS, NEG_INF


def assert_within_rounding(actual, ref32, dtype, floor=1e-6):
    """Flash-attention rule: error <= 2x the error of rounding the fp32 reference to ``dtype``."""
    err = (actual.float() - ref32).abs().max().item()
    rounding = (ref32.to(dtype).float() - ref32).abs().max().item()
    assert err <= 2 * rounding + floor, f"max error {err:.3g} > 2 x rounding {rounding:.3g} + {floor}"


def assert_lse_close(actual, expected, atol=1e-5):
    """LSE: same -inf pattern, finite values close (fp32 natural log)."""
    assert actual.dtype == torch.float32
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf pattern differs"
    fin = torch.isfinite(expected)
    assert torch.isfinite(actual[fin]).all()
    torch.testing.assert_close(actual[fin], expected[fin], atol=atol, rtol=1e-5)


def attend64(q, k, v):
    """Independent float64 softmax attention of q [M, D] against k, v [N, D] (N may be 0)."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], NEG_INF, dtype=torch.float64, device=q.device)
    s = q @ k.T
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def random_state(shape, dtype, empty_frac=0.0, garbage=float("nan")):
    """A random attention state: out [*shape] in dtype, lse fp32; some rows empty (-inf, garbage out)."""
    out = torch.randn(shape, device=DEVICE).to(dtype)
    lse = torch.randn(shape[:-1], device=DEVICE) * 3
    empty = torch.rand(shape[:-1], device=DEVICE) < empty_frac
    lse[empty] = NEG_INF
    out[empty] = garbage
    return out, lse


# Odd shapes: a single row, head_dim 80 (not a power of two), 3-D and 2-D leading dims.
SHAPES = [(1, 64), (3, 5, 7, 80), (2, 6, 17, 64), (33, 96)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_matches_reference(backend, dtype, shape):
    out_a, lse_a = random_state(shape, dtype, empty_frac=0.2)
    out_b, lse_b = random_state(shape, torch.float32, empty_frac=0.2)  # prefix side is fp32
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, backend=backend)
    ref_out, ref_lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and out.shape == out_a.shape and lse.shape == lse_a.shape
    assert torch.isfinite(out).all(), "garbage from an empty side leaked into the output"
    assert_within_rounding(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_one_side_empty_returns_other(backend):
    out_a, lse_a = random_state((4, 3, 80), torch.float32)
    garbage = torch.full_like(out_a, float("nan"))
    for empty in (NEG_INF, float("inf"), float("nan")):  # +inf: FA2 empty rows; NaN: guarded too
        lse_e = torch.full_like(lse_a, empty)
        out, lse = merge_attention_states(out_a, lse_a, garbage, lse_e, backend=backend)
        torch.testing.assert_close(out, out_a, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, lse_a)
        out, lse = merge_attention_states(garbage, lse_e, out_a, lse_a, backend=backend)
        torch.testing.assert_close(out, out_a, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, lse_a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_both_empty_gives_zero_and_neg_inf(backend, dtype):
    shape = (2, 3, 5, 64)
    nan = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    lse_a = torch.full(shape[:-1], NEG_INF, device=DEVICE)
    lse_b = lse_a.clone()
    lse_b[0] = float("inf")  # mixed empty markers
    out, lse = merge_attention_states(nan, lse_a, nan.clone(), lse_b, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_extreme_lse_is_stable(backend):
    """Huge LSE gaps and magnitudes (1e4) must not overflow exp()."""
    out_a, _ = random_state((8, 64), torch.float32)
    out_b, _ = random_state((8, 64), torch.float32)
    lse_a = torch.tensor([1e4, -1e4, 0.0, 50.0, 1e4, -80.0, 3.0, 0.0], device=DEVICE)
    lse_b = torch.tensor([1e4, 1e4, 200.0, 50.0, 1e4 - 1, -80.0, 3.0 + 1e-6, -200.0], device=DEVICE)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, backend=backend)
    w_a = torch.sigmoid((lse_a - lse_b).double()).unsqueeze(-1)
    expected = w_a * out_a.double() + (1 - w_a) * out_b.double()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    expected_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_equals_attention_over_concatenated_keys(backend):
    """Merging states over disjoint key sets == attention over their union (float64 check)."""
    M, D, sizes = 19, 80, (7, 0, 33)  # an empty middle segment
    q = torch.randn(M, D, device=DEVICE, dtype=torch.float64) * 0.3
    keys = [torch.randn(n, D, device=DEVICE, dtype=torch.float64) for n in sizes]
    vals = [torch.randn(n, D, device=DEVICE, dtype=torch.float64) for n in sizes]
    states = [attend64(q, k, v) for k, v in zip(keys, vals)]
    full_out, full_lse = attend64(q, torch.cat(keys), torch.cat(vals))
    (oa, la), (ob, lb), (oc, lc) = [(o.float(), l.float()) for o, l in states]
    # Associativity: ((a, b), c) and (a, (b, c)) both equal the union.
    o_ab, l_ab = merge_attention_states(oa, la, ob, lb, backend=backend)
    o1, l1 = merge_attention_states(o_ab, l_ab, oc, lc, backend=backend)
    o_bc, l_bc = merge_attention_states(ob, lb, oc, lc, backend=backend)
    o2, l2 = merge_attention_states(oa, la, o_bc, l_bc, backend=backend)
    for o, l in ((o1, l1), (o2, l2)):
        torch.testing.assert_close(o.double(), full_out, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(l.double(), full_lse, atol=2e-6, rtol=1e-6)


def test_merge_rejects_bad_inputs_with_shapes_in_message():
    out = torch.zeros(2, 3, 64)
    lse = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3, 64\).*\(2, 3, 32\)"):
        merge_attention_states(out, lse, torch.zeros(2, 3, 32), lse)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        merge_attention_states(out, lse, out, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="lse_a must be float32"):
        merge_attention_states(out, lse.half(), out, lse)
    with pytest.raises(ValueError, match="backend"):
        merge_attention_states(out, lse, out, lse, backend="cuda")


def test_import_without_triton():
    """triton is an optional extra: `import hf_cascade.ops` and the torch path work without it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, hf_cascade.ops as ops\n"
        "assert not ops.triton_available()\n"
        "o, l = ops.merge_attention_states(torch.zeros(2, 8), torch.zeros(2), torch.ones(2, 8), torch.zeros(2))\n"
        "assert torch.allclose(o, torch.full((2, 8), 0.5))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
