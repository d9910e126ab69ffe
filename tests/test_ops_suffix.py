"""suffix_attention: Triton kernel and torch path against float64 masked attention per row.

Triton cases run under TRITON_INTERPRET=1 (CI) or on CUDA; bf16 is in tests/test_ops_gpu.py.
"""


import pytest
import torch

from hf_cascade.ops import (
    merge_attention_states_ref,
    suffix_attention,
    suffix_attention_ref,
)
from hf_cascade.ops._launch import suffix_triton

from _ops_common import CUDA, DEVICE, needs_triton, BACKENDS, NEG_INF


def make_qkv(B, hq, hkv, lq, s, d, dtype):
    q = torch.randn(B, hq, lq, d, device=DEVICE).to(dtype)
    k = torch.randn(B, hkv, s, d, device=DEVICE).to(dtype)
    v = torch.randn(B, hkv, s, d, device=DEVICE).to(dtype)
    return q, k, v


def suffix_f64(q, k, v, scale, visible, softcap=None):
    """Independent float64 attention; visible: bool [B, Lq, S] or None (all). Empty rows: 0 / -inf."""
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[1]
    kk = k.double().cpu().repeat_interleave(g, 1)
    vv = v.double().cpu().repeat_interleave(g, 1)
    s = q.double().cpu() @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible.cpu()[:, None], NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return p @ vv, lse


def causal_bottom_right(B, lq, s):
    i = torch.arange(lq)[:, None]
    j = torch.arange(s)[None, :]
    return (j <= s - lq + i).expand(B, lq, s)


def assert_lse_close(actual, expected, atol):
    assert actual.dtype == torch.float32
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf pattern differs"
    fin = torch.isfinite(expected)
    torch.testing.assert_close(actual[fin], expected[fin], atol=atol, rtol=1e-5)


def check(out, lse, q, exp_out, exp_lse):
    """fp32: tight vs float64. fp16: error <= 2x the rounding of the exact result to fp16."""
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), exp_out, atol=2e-5, rtol=1e-4)
        assert_lse_close(lse, exp_lse, atol=2e-5)
        return
    err = (out.double().cpu() - exp_out).abs().max().item()
    rounding = (exp_out.to(q.dtype).double() - exp_out).abs().max().item()
    assert err <= 2 * rounding + 1e-5, f"max error {err:.3g} > 2 x rounding {rounding:.3g}"
    assert_lse_close(lse, exp_lse, atol=1e-4)


# (Lq, S): decode, Lq < S, Lq == S, Lq > S (the first Lq - S queries see nothing: lse -inf).
SHAPES = [(1, 33), (17, 40), (17, 17), (17, 5)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lq,s", SHAPES)
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 1)], ids=["gqa", "mqa"])
def test_suffix_causal_bottom_right(backend, dtype, lq, s, hq, hkv):
    q, k, v = make_qkv(2, hq, hkv, lq, s, 64, dtype)
    out, lse = suffix_attention(q, k, v, scale=0.125, backend=backend)  # mask=None, causal=True
    check(out, lse, q, *suffix_f64(q, k, v, 0.125, causal_bottom_right(2, lq, s)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_suffix_full_attention_mha_odd_dim(backend, dtype):
    q, k, v = make_qkv(3, 4, 4, 17, 40, 80, dtype)
    out, lse = suffix_attention(q, k, v, scale=80 ** -0.5, causal=False, backend=backend)
    check(out, lse, q, *suffix_f64(q, k, v, 80 ** -0.5, None))


def left_padded_mask(lq, s, pads):
    """[B, Lq, S]: causal bottom-right, minus `pad` leading keys per row (generate()'s left padding)."""
    mask = causal_bottom_right(len(pads), lq, s).clone()
    for b, pad in enumerate(pads):
        mask[b, :, :pad] = False
    return mask.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("four_d", [False, True])
def test_suffix_bool_mask_left_padding(backend, dtype, four_d):
    lq, s = 17, 23
    mask = left_padded_mask(lq, s, pads=(0, 6, 20))  # row 2: its first queries see nothing
    q, k, v = make_qkv(3, 6, 2, lq, s, 64, dtype)
    m = mask[:, None] if four_d else mask
    out, lse = suffix_attention(q, k, v, scale=0.125, mask=m, causal=False, backend=backend)
    exp_out, exp_lse = suffix_f64(q, k, v, 0.125, mask)
    assert torch.isneginf(exp_lse[2, :, 0]).all()  # fully masked rows exist in this case
    check(out, lse, q, exp_out, exp_lse)
    assert torch.equal(out[2, :, 0], torch.zeros_like(out[2, :, 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_suffix_mask_batch_broadcast_and_transposed_inputs(backend):
    """A [1, Lq, S] mask broadcasts over the batch; q/k/v as transposed views of [B, L, H, D]."""
    B, lq, s = 3, 5, 19
    q = torch.randn(B, lq, 4, 64, device=DEVICE).transpose(1, 2)
    k = torch.randn(B, s, 2, 64, device=DEVICE).transpose(1, 2)
    v = torch.randn(B, s, 2, 64, device=DEVICE).transpose(1, 2)
    mask = torch.rand(1, lq, s, device=DEVICE) > 0.4
    out, lse = suffix_attention(q, k, v, scale=0.125, mask=mask, backend=backend)
    check(out, lse, q, *suffix_f64(q, k, v, 0.125, mask.expand(B, lq, s)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_prefix", [False, True])
def test_suffix_empty_kv(backend, with_prefix):
    q, k, v = make_qkv(2, 4, 2, 3, 0, 64, torch.float16)
    po = torch.randn(2, 4, 3, 64, device=DEVICE) if with_prefix else None
    pl = torch.randn(2, 4, 3, device=DEVICE) if with_prefix else None
    if with_prefix:
        pl[0, 0, 0] = NEG_INF
        po[0, 0, 0] = float("nan")  # garbage of an empty prefix row must not leak
    out, lse = suffix_attention(q, k, v, scale=0.125, prefix_out=po, prefix_lse=pl, backend=backend)
    if not with_prefix:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    else:
        expected = torch.where(torch.isneginf(pl)[..., None], 0.0, po)
        torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=1e-3)
        assert torch.equal(lse, pl)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_suffix_fused_prefix_merge_equals_separate_merge(backend, dtype, masked):
    B, hq, hkv, lq, s = 3, 6, 2, 17, 21
    q, k, v = make_qkv(B, hq, hkv, lq, s, 64, dtype)
    mask = left_padded_mask(lq, s, pads=(0, 3, 21)) if masked else None  # row 2: no suffix keys
    po = torch.randn(B, hq, lq, 64, device=DEVICE)
    pl = torch.randn(B, hq, lq, device=DEVICE) * 2
    pl[0, :2] = NEG_INF  # some rows without a prefix
    pl[1, 0, 0] = float("inf")  # FA2-style empty marker
    po[0, :2] = float("nan")
    out, lse = suffix_attention(q, k, v, scale=0.125, mask=mask, prefix_out=po, prefix_lse=pl, backend=backend)
    exp_so, exp_sl = suffix_f64(q, k, v, 0.125, mask if masked else causal_bottom_right(B, lq, s))
    exp_out, exp_lse = merge_attention_states_ref(po.double().cpu(), pl.cpu(), exp_so, exp_sl.float())
    check(out, lse, q, exp_out.double(), exp_lse.double())
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_suffix_softcap(backend, dtype):
    q, k, v = make_qkv(2, 4, 2, 17, 25, 64, dtype)
    q = q * 4
    out, lse = suffix_attention(q, k, v, scale=0.125, softcap=5.0, backend=backend)
    check(out, lse, q, *suffix_f64(q, k, v, 0.125, causal_bottom_right(2, 17, 25), softcap=5.0))


@needs_triton
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_suffix_tile_sizes(block_m, block_n):
    """Tiles that straddle positions / groups and several KV blocks give the same answer."""
    q, k, v = make_qkv(2, 6, 2, 17, 40, 64, torch.float32)
    mask = left_padded_mask(17, 40, pads=(2, 9))
    for kwargs in ({"mask": None, "causal": True}, {"mask": mask, "causal": True}):
        out, lse = suffix_triton(q, k, v, scale=0.125, softcap=None, prefix_out=None, prefix_lse=None,
                                  block_m=block_m, block_n=block_n, **kwargs)
        vis = kwargs["mask"] if kwargs["mask"] is not None else causal_bottom_right(2, 17, 40)
        check(out, lse, q, *suffix_f64(q, k, v, 0.125, vis))


def test_suffix_torch_path_matches_reference_bf16():
    q, k, v = make_qkv(2, 4, 2, 5, 9, 64, torch.bfloat16)
    out, lse = suffix_attention(q, k, v, scale=0.125, backend="torch")
    ref_out, ref_lse = suffix_attention_ref(q, k, v, scale=0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out.to(torch.bfloat16)) and torch.equal(lse, ref_lse)


def test_suffix_rejects_bad_inputs():
    q, k, v = make_qkv(2, 4, 2, 3, 7, 64, torch.float32)
    with pytest.raises(ValueError, match=r"mask must be bool \[B, Lq, S\] = \[2, 3, 7\].*\(2, 3, 8\)"):
        suffix_attention(q, k, v, scale=0.1, mask=torch.ones(2, 3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be bool"):
        suffix_attention(q, k, v, scale=0.1, mask=torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="both prefix_out and prefix_lse"):
        suffix_attention(q, k, v, scale=0.1, prefix_out=torch.zeros(2, 4, 3, 64))
    with pytest.raises(ValueError, match=r"prefix_out must be float32"):
        suffix_attention(q, k, v, scale=0.1, prefix_out=torch.zeros(2, 4, 3, 64).half(),
                         prefix_lse=torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match=r"key \(1, 2, 7, 64\) must be \[B=2"):
        suffix_attention(q, k[:1], v[:1], scale=0.1)
