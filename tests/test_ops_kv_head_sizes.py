"""Keys and values of different head sizes (MLA-style: q/k 192 wide, v 128; and odd sizes both ways) through every
pass: shared prefix (KV splits and their combine), suffix (with a prefix state), the fused cascade launch and the
two-pass form, the torch path, and fixed suffix buffers (``key_length``). Against float64 attention per row (fp32;
Triton under TRITON_INTERPRET=1 or on CUDA; the interpreter cannot run bf16 dots).
"""

import pytest
import torch

from hf_cascade.ops import cascade_attention, plan_shared_prefix, shared_prefix_attention, suffix_attention
from hf_cascade.ops._launch import cascade_triton
from hf_cascade.ops._launch import prefix_triton

from _ops_common import BACKENDS, DEVICE, NEG_INF, needs_triton

DIMS = [(24, 12), (12, 20), (40, 33)]  # (D of q/k, Dv): wider keys, wider values, odd (masked head_dim)


def _level(hkv, d, dv, lens, row_node):
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    k = torch.randn(hkv, int(starts[-1]), d, device=DEVICE)
    v = torch.randn(hkv, int(starts[-1]), dv, device=DEVICE)
    return k, v, torch.tensor(row_node, dtype=torch.int64), starts


def _f64(q, ks, vs, levels, scale, visible):
    """Per row: every key of its node at each level, then its suffix under ``visible`` [B, Lq, S]."""
    B, Hq, Lq, _ = q.shape
    g, dv = Hq // ks.shape[1], vs.shape[-1]
    out = torch.zeros(B, Hq, Lq, dv, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), NEG_INF, dtype=torch.float64)
    for b in range(B):
        kk, vv, vis = [], [], []
        for k, v, rows, starts in levels:
            n = int(rows[b])
            if n >= 0:
                lo, hi = int(starts[n]), int(starts[n + 1])
                kk.append(k[:, lo:hi]), vv.append(v[:, lo:hi]), vis.append(torch.ones(Lq, hi - lo, dtype=torch.bool))
        kk.append(ks[b]), vv.append(vs[b]), vis.append(visible[b].cpu())
        kk = torch.cat(kk, 1).double().cpu().repeat_interleave(g, 0)
        vv = torch.cat(vv, 1).double().cpu().repeat_interleave(g, 0)
        s = (q[b].double().cpu() @ kk.transpose(1, 2) * scale).masked_fill(~torch.cat(vis, 1)[None], NEG_INF)
        row_lse = torch.logsumexp(s, -1)
        out[b] = torch.exp(s - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[..., None]) @ vv
        lse[b] = row_lse
    return out, lse


def _check(out, lse, want_out, want_lse):
    assert out.shape == want_out.shape, (out.shape, want_out.shape)
    torch.testing.assert_close(out.double().cpu(), want_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double().cpu()[finite], want_lse[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("two-pass", marks=needs_triton)])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("lq", [1, 4])
def test_cascade_with_different_kv_head_sizes(backend, dims, lq):
    torch.manual_seed(0)
    d, dv = dims
    B, hq, hkv, S = 4, 6, 2, 7
    levels = [_level(hkv, d, dv, (50,), (0, 0, 0, -1)), _level(hkv, d, dv, (140, 9), (1, 0, -1, 0))]
    q = torch.randn(B, hq, lq, d, device=DEVICE)
    ks, vs = torch.randn(B, hkv, S, d, device=DEVICE), torch.randn(B, hkv, S, dv, device=DEVICE)
    i, j = torch.arange(lq)[:, None], torch.arange(S)[None, :]
    visible = (j <= S - lq + i).expand(B, lq, S) & (torch.arange(S) >= torch.tensor([0, 2, 0, 3])[:, None])[:, None]
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    mask = visible.to(DEVICE)
    if backend == "two-pass":
        out, lse = cascade_triton(q, ks, vs, prefixes, scale=0.15, mask=mask, causal=True, softcap=None,
                                   fuse_suffix=False)
    else:
        out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.15, mask=mask, backend=backend)
    _check(out, lse, *_f64(q, ks, vs, levels, 0.15, visible))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cascade_with_different_kv_head_sizes_and_unwritten_columns(backend):
    """Fixed suffix buffers: columns from ``key_length`` on are not written (never read)."""
    torch.manual_seed(1)
    d, dv, B, hq, hkv, S = 20, 12, 3, 4, 2, 9
    levels = [_level(hkv, d, dv, (30,), (0, 0, 0))]
    q = torch.randn(B, hq, 1, d, device=DEVICE)
    ks, vs = torch.randn(B, hkv, S, d, device=DEVICE), torch.randn(B, hkv, S, dv, device=DEVICE)
    written = torch.tensor(5, device=DEVICE)
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.2, backend=backend, key_length=written,
                                 mask=torch.ones(1, 1, S, dtype=torch.bool, device=DEVICE))
    visible = (torch.arange(S) < 5).expand(B, 1, S)
    _check(out, lse, *_f64(q, ks, vs, levels, 0.2, visible))


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_pass_mla_sizes_with_kv_splits(num_splits):
    """192-wide keys, 128-wide values (DeepSeek-V3), the KV splits and their combine kernel."""
    torch.manual_seed(2)
    k, v, rows, starts = _level(1, 192, 128, (70, 41), (1, 0, 1))
    q = torch.randn(3, 2, 2, 192, device=DEVICE)
    plan = plan_shared_prefix(rows, starts, device=DEVICE)
    out, lse = prefix_triton(q, k, v, plan, scale=192 ** -0.5, softcap=None, num_splits=num_splits)
    empty = torch.zeros(3, 1, 0, 192)
    _check(out, lse, *_f64(q, empty, torch.zeros(3, 1, 0, 128), [(k, v, rows, starts)], 192 ** -0.5,
                           torch.zeros(3, 2, 0, dtype=torch.bool)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_suffix_pass_with_a_prefix_state_of_the_value_width(backend):
    torch.manual_seed(3)
    d, dv, B, hq, hkv, S, lq = 24, 40, 2, 4, 2, 6, 3
    k, v, rows, starts = _level(hkv, d, dv, (11,), (0, 0))
    q = torch.randn(B, hq, lq, d, device=DEVICE)
    ks, vs = torch.randn(B, hkv, S, d, device=DEVICE), torch.randn(B, hkv, S, dv, device=DEVICE)
    p_out, p_lse = shared_prefix_attention(q, k, v, rows, starts, scale=0.3, backend=backend)
    assert p_out.shape == (B, hq, lq, dv)
    out, lse = suffix_attention(q, ks, vs, scale=0.3, prefix_out=p_out, prefix_lse=p_lse, backend=backend)
    visible = (torch.arange(S)[None, :] <= S - lq + torch.arange(lq)[:, None]).expand(B, lq, S)
    _check(out, lse, *_f64(q, ks, vs, [(k, v, rows, starts)], 0.3, visible))


def test_mismatched_value_widths_are_refused():
    q = torch.randn(2, 2, 1, 16)
    k_pre, v_pre, rows, starts = _level(1, 16, 8, (5,), (0, 0))
    ks, vs = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 12)
    with pytest.raises(ValueError, match=r"prefix values' head_dim \(8\) must equal the suffix values' \(12\)"):
        cascade_attention(q, ks, vs, [(k_pre, v_pre, plan_shared_prefix(rows, starts))], scale=0.25)
    with pytest.raises(ValueError, match=r"key and value must be \[B, Hkv, S, D\] and \[B, Hkv, S, Dv\]"):
        suffix_attention(q, ks, vs[:, :, :2], scale=0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_buffer_write_with_different_kv_head_sizes(backend):
    """write_suffix_kv into fixed buffers [B, H, S, D] / [B, H, S, Dv] (the compiled decode step's write)."""
    from hf_cascade.ops.kv_write import write_suffix_kv
    from hf_cascade.ops.reference import write_suffix_kv_ref

    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(2, 3, 2, 24, generator=g), torch.randn(2, 3, 2, 13, generator=g)
    keys, values = torch.randn(2, 3, 7, 24, generator=g), torch.randn(2, 3, 7, 13, generator=g)
    positions, length = torch.tensor([3, 4]), torch.tensor(3)
    want = [t.clone() for t in (keys, values, length)]
    write_suffix_kv_ref(key, value, *want[:2], positions, want[2])
    write_suffix_kv(key, value, keys, values, positions, length, backend=backend)
    assert torch.equal(keys, want[0]) and torch.equal(values, want[1]) and int(length) == 5
    with pytest.raises(ValueError, match=r"\[B, H, S, D\] / \[B, H, S, Dv\]"):
        write_suffix_kv(key, value, keys, values[..., :12], positions, length, backend=backend)


def test_static_suffix_layer_holds_values_of_their_own_width():
    from hf_cascade.suffix_layers import StaticSuffixLayer

    layer = StaticSuffixLayer(6)
    k, v = layer.update(torch.randn(2, 1, 3, 24), torch.randn(2, 1, 3, 10))
    assert k.shape == (2, 1, 6, 24) and v.shape == (2, 1, 6, 10) and int(layer.cumulative_length) == 3
