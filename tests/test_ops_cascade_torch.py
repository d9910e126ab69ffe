"""cascade_attention's PyTorch path (``ops/reference.py``'s ``cascade_attention_ref``: every level and the suffix in
one softmax) on layouts that take each of its ways to read a level: one matmul against all keys ("dense"), each
row's node keys gathered ("gather"), node by node ("nodes"), and a level no row reads ("empty"); against float64
attention per row, and against the composition of the public ops (per level, merge, suffix) where a soft cap is
applied."""

import pytest
import torch

from hf_cascade.ops import (cascade_attention, merge_attention_states, plan_shared_prefix, shared_prefix_attention,
                            suffix_attention)

from test_ops_cascade import cascade_f64, check, make_level

# (node lengths, node of each row) per level, and the way each level is read
LAYOUTS = {
    # a shared prompt (no mask), then three short nodes and rows without one (a small level: one matmul)
    "dense": ([((70,), (0,) * 6), ((5, 4, 4), (0, 0, 1, 1, 2, -1))], ["dense", "dense"]),
    # ten nodes of 20 keys, four rows each (40 rows x 200 keys: too many to read all, short enough to gather)
    "gather": ([((12,), (0,) * 40), ((20,) * 10, tuple(r // 4 for r in range(40)))], ["dense", "gather"]),
    # gathered with padding: nodes of unequal length, a row without a node
    "gather-padded": ([(tuple(20 + 3 * n for n in range(10)), tuple(-1 if r == 7 else r // 4 for r in range(40)))],
                      ["gather"]),
    # one long node read by one row, a short one by the rest: node by node
    "nodes": ([((9,), (0,) * 6), ((1000, 10), (0, 1, 1, 1, 1, -1))], ["dense", "nodes"]),
    # a level whose only node is empty
    "empty": ([((30,), (0, 0, 0, 0)), ((0,), (0, 0, 0, 0))], ["dense", "empty"]),
}


def _composition(query, key, value, prefixes, *, scale, softcap, backend):
    """The composition of the three public ops: per level shared_prefix_attention, merged level by level, then
    suffix_attention merging the prefix state (causal suffix)."""
    prefix_out = prefix_lse = None
    for k_pre, v_pre, plan in prefixes:
        o, lse = shared_prefix_attention(query, k_pre, v_pre, plan.rows, plan.node_starts_dev, scale=scale,
                                         softcap=softcap, backend=backend, plan=plan)
        if prefix_out is None:
            prefix_out, prefix_lse = o, lse
        else:
            prefix_out, prefix_lse = merge_attention_states(prefix_out, prefix_lse, o, lse, backend=backend)
    return suffix_attention(query, key, value, scale=scale, causal=True, softcap=softcap, prefix_out=prefix_out,
                            prefix_lse=prefix_lse, backend=backend)


def _levels(name, hkv, d, dtype):
    spec, ways = LAYOUTS[name]
    levels = [make_level(hkv, d, dtype, tuple(lens), rows) for lens, rows in spec]
    prefixes = [(k, v, plan_shared_prefix(rows, starts)) for k, v, rows, starts in levels]
    assert [plan.torch_way for _, _, plan in prefixes] == ways
    return levels, prefixes


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lq,masked", [(1, False), (4, False), (4, True)], ids=["decode", "causal", "mask"])
def test_each_way_matches_float64(name, dtype, lq, masked):
    hq, hkv, d, S = 6, 2, 32, 7
    levels, prefixes = _levels(name, hkv, d, dtype)
    B = len(levels[0][2])
    q = torch.randn(B, hq, lq, d).to(dtype)
    ks, vs = torch.randn(B, hkv, S, d).to(dtype), torch.randn(B, hkv, S, d).to(dtype)
    i, j = torch.arange(lq)[:, None], torch.arange(S)[None, :]
    visible = (j <= S - lq + i).expand(B, lq, S).clone()
    mask = None
    if masked:  # left padding; the last row sees no suffix key
        starts = torch.tensor([r % 3 for r in range(B - 1)] + [S])
        visible &= (torch.arange(S) >= starts[:, None])[:, None, :]
        mask = visible
    out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.2, mask=mask, causal=True, backend="torch")
    assert out.transpose(1, 2).is_contiguous()  # transformers' layout
    check(out, lse, q, *cascade_f64(q, ks, vs, levels, 0.2, visible))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_soft_cap_matches_the_composition(name):
    hq, hkv, d, S, lq = 4, 2, 16, 5, 3
    levels, prefixes = _levels(name, hkv, d, torch.float32)
    B = len(levels[0][2])
    q = torch.randn(B, hq, lq, d) * 4
    ks, vs = torch.randn(B, hkv, S, d), torch.randn(B, hkv, S, d)
    out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.3, softcap=5.0, causal=True, backend="torch")
    ref_out, ref_lse = _composition(q, ks, vs, prefixes, scale=0.3, softcap=5.0, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_no_keys_anywhere():
    """No suffix keys and a level no row reads: out 0, lse -inf."""
    k, v, rows, starts = make_level(2, 16, torch.float32, (0,), (0, 0))
    q = torch.randn(2, 4, 1, 16)
    ks = torch.zeros(2, 2, 0, 16)
    out, lse = cascade_attention(q, ks, ks, [(k, v, plan_shared_prefix(rows, starts))], scale=0.25, backend="torch")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
