"""cascade_attention (prefix levels + suffix in L + 1 launches) against float64 attention per row.

Each row attends, per level, all keys of its node at that level (none when its node is -1 or
empty), then its own suffix keys under the causal / bool mask. The float64 check concatenates
those keys per row and runs plain softmax attention. Triton cases run under TRITON_INTERPRET=1
(CI) or on CUDA; bf16 is in tests/test_ops_gpu.py.
"""


import pytest
import torch

from hf_cascade.ops import cascade_attention, plan_shared_prefix
from hf_cascade.ops._launch import cascade_triton, launch_cascade, launch_configs

from _ops_common import CUDA, DEVICE, needs_triton, BACKENDS, NEG_INF


def make_level(hkv, d, dtype, lens, row_node):
    starts = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    T = int(starts[-1])
    k = torch.randn(hkv, T, d, device=DEVICE).to(dtype)
    v = torch.randn(hkv, T, d, device=DEVICE).to(dtype)
    rows = torch.tensor(row_node, dtype=torch.int64)
    return k, v, rows, starts


def cascade_f64(q, ks, vs, levels, scale, visible):
    """Per row: keys of its node at every level (seen by every query), then its masked suffix."""
    B, Hq, Lq, D = q.shape
    g = Hq // ks.shape[1]
    out = torch.zeros(B, Hq, Lq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), NEG_INF, dtype=torch.float64)
    for b in range(B):
        kk, vv, vis = [], [], []
        for k, v, rows, starts in levels:
            n = int(rows[b])
            if n >= 0:
                a, e = int(starts[n]), int(starts[n + 1])
                kk.append(k[:, a:e])
                vv.append(v[:, a:e])
                vis.append(torch.ones(Lq, e - a, dtype=torch.bool))
        kk.append(ks[b])
        vv.append(vs[b])
        vis.append(visible[b].cpu())
        kk = torch.cat(kk, 1).double().cpu().repeat_interleave(g, 0)
        vv = torch.cat(vv, 1).double().cpu().repeat_interleave(g, 0)
        s = (q[b].double().cpu() @ kk.transpose(1, 2) * scale).masked_fill(~torch.cat(vis, 1)[None], NEG_INF)
        row_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[..., None])
        out[b] = p @ vv
        lse[b] = row_lse
    return out, lse


def check(out, lse, q, exp_out, exp_lse):
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    tol = 2e-5 if q.dtype == torch.float32 else 2e-3  # fp16: P rounded before the PV product
    torch.testing.assert_close(out.double().cpu(), exp_out, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(exp_lse)), "-inf pattern differs"
    fin = torch.isfinite(exp_lse)
    torch.testing.assert_close(lse.double().cpu()[fin], exp_lse[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("two-pass", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lq,masked", [(1, False), (5, False), (5, True)], ids=["decode", "causal", "mask"])
def test_cascade_two_levels_matches_float64(backend, dtype, lq, masked):
    """Triton: prefix + suffix programs in one launch, then the state combine ("triton" on the CPU
    interpreter), or the suffix kernel merging the prefix states in its prologue ("two-pass")."""
    B, hq, hkv, d, S = 5, 6, 2, 64, 9
    # Level 0: one shared prompt for rows 0-3, row 4 has none. Level 1: three nodes, one empty
    # (row 2), non-adjacent rows on node 2, and 300 keys so that the KV splits are exercised.
    levels = [make_level(hkv, d, dtype, (70,), (0, 0, 0, 0, -1)),
              make_level(hkv, d, dtype, (300, 0, 33), (2, 0, 1, 2, 0))]
    q = torch.randn(B, hq, lq, d, device=DEVICE).to(dtype)
    ks = torch.randn(B, hkv, S, d, device=DEVICE).to(dtype)
    vs = torch.randn(B, hkv, S, d, device=DEVICE).to(dtype)
    i, j = torch.arange(lq)[:, None], torch.arange(S)[None, :]
    visible = (j <= S - lq + i).expand(B, lq, S).clone()
    mask = None
    if masked:  # left padding; row 4 sees no suffix key and has no prefix at level 0
        visible &= (torch.arange(S) >= torch.tensor([0, 2, 4, 0, S])[:, None])[:, None, :]
        mask = visible.to(DEVICE)
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    if backend == "two-pass":
        out, lse = cascade_triton(q, ks, vs, prefixes, scale=0.125, mask=mask, causal=True, softcap=None,
                                   fuse_suffix=False)
    else:
        out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.125, mask=mask, causal=True, backend=backend)
    if backend != "torch":
        assert out.transpose(1, 2).is_contiguous()  # transformers' layout is free
    check(out, lse, q, *cascade_f64(q, ks, vs, levels, 0.125, visible))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cascade_no_suffix_keys_and_no_prefix_rows(backend):
    """S = 0: the result is the prefix state; a row with no keys anywhere gets out 0, lse -inf."""
    B, hq, hkv, d = 3, 4, 2, 64
    k, v, rows, starts = make_level(hkv, d, torch.float32, (40,), (0, -1, 0))
    q = torch.randn(B, hq, 1, d, device=DEVICE)
    ks = torch.zeros(B, hkv, 0, d, device=DEVICE)
    plan = plan_shared_prefix(rows, starts, device=DEVICE)
    out, lse = cascade_attention(q, ks, ks, [(k, v, plan)], scale=0.125, backend=backend)
    exp_out, exp_lse = cascade_f64(q, ks, ks, [(k, v, rows, starts)], 0.125, torch.ones(B, 1, 0, dtype=torch.bool))
    check(out, lse, q, exp_out, exp_lse)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@needs_triton
def test_cascade_plan_reuse_is_deterministic():
    """The cached launch schedule gives the same bits on every call (no state left between calls)."""
    k, v, rows, starts = make_level(2, 64, torch.float32, (129, 7), (1, 0, 0, 1))
    plan = plan_shared_prefix(rows, starts, device=DEVICE)
    q = torch.randn(4, 4, 1, 64, device=DEVICE)
    ks = torch.randn(4, 2, 3, 64, device=DEVICE)
    first = cascade_attention(q, ks, ks, [(k, v, plan)], scale=0.1, backend="triton")
    again = cascade_attention(q, ks, ks, [(k, v, plan)], scale=0.1, backend="triton")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def fused_with_splits(q, ks, vs, prefixes, splits, mask=None):
    """The fused launch form with ``splits`` KV splits per level and BLOCK_N 16 (more splits and blocks than the
    heuristics pick at these sizes): ``launch_cascade(..., fuse_suffix=True)``."""
    fuse, configs = launch_configs(q, ks, prefixes, fuse_suffix=True)
    assert fuse
    configs = [(sched, n, block_m, 16, warps, stages)
               for n, (sched, _, block_m, _, warps, stages) in zip(splits, configs)]
    return launch_cascade(q, ks, vs, [(k, v) for k, v, _ in prefixes], configs, True, scale=0.2, mask=mask,
                          causal=True, softcap=None)


def split_levels(hkv, d, dtype):
    """Two levels; rows 3 and 4 have no keys at the last level (no node / an empty node), row 3 none at all."""
    return [make_level(hkv, d, dtype, (37, 20), (0, 1, 0, -1, 1, 0)),
            make_level(hkv, d, dtype, (150, 0, 45), (2, 0, 2, -1, 1, 0))]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("lq,S", [(1, 5), (3, 7), (3, 0)], ids=["decode", "causal", "no-suffix"])
def test_fused_many_splits_matches_torch(dtype, hq, hkv, lq, S):
    """The fused launch form with more states per entry than the heuristics give at these sizes: 5 KV splits at
    the last level (the fused launch) and 3 at the first (an earlier launch), merged with the suffix state by the
    combine; head_dim 24 (masked), rows without keys at a level and without any key, an empty suffix. Against the
    fp32 torch path."""
    B, d = 6, 24
    torch.manual_seed(1)
    levels = split_levels(hkv, d, dtype)
    q = torch.randn(B, hq, lq, d, device=DEVICE).to(dtype)
    ks = torch.randn(B, hkv, S, d, device=DEVICE).to(dtype)
    vs = torch.randn(B, hkv, S, d, device=DEVICE).to(dtype)
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    out, lse = fused_with_splits(q, ks, vs, prefixes, (3, 5))
    ref_out, ref_lse = cascade_attention(q, ks, vs, prefixes, scale=0.2, causal=True, backend="torch")
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf pattern differs"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
    if S == 0:  # row 3 has no key anywhere
        assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isneginf(lse[3]).all()


@needs_triton
def test_fused_twice_same_bits():
    """A second call on the same tensors gives the same bits (no state kept between calls). The first call's
    outputs are poisoned with NaN before the second, so an entry the second call leaves unwritten would show."""
    B, hq, hkv, lq, d, S = 6, 6, 2, 2, 24, 5
    torch.manual_seed(2)
    levels = split_levels(hkv, d, torch.float32)
    q = torch.randn(B, hq, lq, d, device=DEVICE)
    ks = torch.randn(B, hkv, S, d, device=DEVICE)
    vs = torch.randn(B, hkv, S, d, device=DEVICE)
    mask = torch.rand(B, lq, S, device=DEVICE) > 0.3
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    out, lse = fused_with_splits(q, ks, vs, prefixes, (2, 4), mask)
    first_out, first_lse = out.clone(), lse.clone()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    del out, lse
    again_out, again_lse = fused_with_splits(q, ks, vs, prefixes, (2, 4), mask)
    assert torch.equal(again_out, first_out) and torch.equal(again_lse, first_lse)
    ref_out, _ = cascade_attention(q, ks, vs, prefixes, scale=0.2, mask=mask, backend="torch")
    torch.testing.assert_close(again_out, ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("two-pass", marks=needs_triton)])
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_key_length_hides_unwritten_keys(backend, lq, masked):
    """Fixed buffers: the first ``key_length`` suffix keys are written, the rest of the capacity is not; those are
    invisible as if masked, and the Triton kernels do not read them (NaN there changes nothing). GQA, a row without
    a prefix, a row whose mask leaves it no suffix key."""
    B, hq, hkv, d, S, written = 4, 6, 2, 32, 13, 8
    torch.manual_seed(3)
    levels = [make_level(hkv, d, torch.float32, (40,), (0, 0, 0, -1))]
    q = torch.randn(B, hq, lq, d, device=DEVICE)
    ks = torch.randn(B, hkv, S, d, device=DEVICE)
    vs = torch.randn(B, hkv, S, d, device=DEVICE)
    garbage = float("nan") if backend != "torch" else 1e4  # (the torch path masks, so it reads them: finite)
    ks[:, :, written:] = garbage
    vs[:, :, written:] = garbage
    i, j = torch.arange(lq)[:, None], torch.arange(S)[None, :]
    visible = (j <= S - lq + i).expand(B, lq, S).clone()  # causal, bottom-right over the capacity
    mask = None
    if masked:  # causal over the written keys, left padding, row 2 sees no suffix key
        visible = ((j <= written - lq + i)[None] & (j >= torch.tensor([0, 2, S, 1])[:, None, None])).clone()
        mask = visible.to(DEVICE)
    length = torch.tensor(written, device=DEVICE)
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE)) for k, v, rows, starts in levels]
    if backend == "two-pass":
        out, lse = cascade_triton(q, ks, vs, prefixes, scale=0.125, mask=mask, causal=True, softcap=None,
                                   fuse_suffix=False, key_length=length)
    else:
        out, lse = cascade_attention(q, ks, vs, prefixes, scale=0.125, mask=mask, causal=True, backend=backend,
                                     key_length=length)
    check(out, lse, q, *cascade_f64(q, ks[:, :, :written], vs[:, :, :written], levels, 0.125,
                                    visible[:, :, :written]))


def test_key_length_must_be_one_integer_on_the_device():
    k, v, rows, starts = make_level(2, 64, torch.float32, (10,), (0, 0))
    prefixes = [(k, v, plan_shared_prefix(rows, starts, device=DEVICE))]
    q = torch.randn(2, 4, 1, 64, device=DEVICE)
    ks = torch.randn(2, 2, 3, 64, device=DEVICE)
    for bad in (2, torch.tensor([1, 2], device=DEVICE), torch.tensor(1.0, device=DEVICE)):
        with pytest.raises(ValueError, match="key_length"):
            cascade_attention(q, ks, ks, prefixes, scale=0.1, key_length=bad)


def test_cascade_rejects_bad_inputs():
    k, v, rows, starts = make_level(2, 64, torch.float32, (10,), (0, 0))
    plan = plan_shared_prefix(rows, starts, device=DEVICE)
    q = torch.randn(2, 4, 1, 64, device=DEVICE)
    ks = torch.randn(2, 2, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="prefix key heads"):
        cascade_attention(q, ks, ks, [(k[:1], v[:1], plan)], scale=0.1)
    with pytest.raises(ValueError, match="PrefixPlan"):
        cascade_attention(q, ks, ks, [(k, v, None)], scale=0.1)
    with pytest.raises(ValueError, match="plan"):
        cascade_attention(q, ks, ks, [(k, v, plan_shared_prefix(rows[:1], starts, device=DEVICE))], scale=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", [0, 2])
def test_planned_op_any_layout_same_shapes(backend, pad):
    """The compiled step's op (ops/cascade_wrapper.py): the layout arrives as index tensors and every launch choice comes from
    shapes, so two layouts with equal shapes (what a CUDA-graph replay sees) are both exact. Odd shapes: GQA 6/2,
    d=24, a node with no rows, rows with no node at a level, an empty node. ``pad``: empty levels in front, as a
    compiled step of a shallower tree takes them (their keys hold garbage that no row may read)."""
    from hf_cascade.ops.cascade_wrapper import planned_attention, step_inputs
    from hf_cascade.ops.plan import plan_cascade

    torch.manual_seed(0)
    B, Hq, Hkv, D, S = 5, 6, 2, 24, 7
    dtype = torch.float32
    layouts = [  # (row_nodes per level, node lengths per level): same T per level, other trees
        ([[0, 0, 1, 1, 1], [0, -1, 1, 2, 2]], [[9, 4], [3, 0, 5]]),
        ([[1, 1, 1, 0, 0], [2, 2, -1, 0, 1]], [[6, 7], [4, 2, 2]]),
    ]
    q = torch.randn(B, Hq, 1, D, device=DEVICE, dtype=dtype)
    ks = torch.randn(B, Hkv, S, D, device=DEVICE, dtype=dtype)
    vs = torch.randn(B, Hkv, S, D, device=DEVICE, dtype=dtype)
    mask = torch.ones(B, 1, S, dtype=torch.bool, device=DEVICE)
    mask[1, :, :3] = False  # a row whose first suffix columns are padding
    for row_nodes, lens in layouts:
        levels = [make_level(Hkv, D, dtype, l, r) for l, r in zip(lens, row_nodes)]
        plan = plan_cascade(torch.tensor(row_nodes), [s.tolist() for *_, s in levels], B, torch.device(DEVICE))
        garbage = [torch.full((Hkv, 2, D), 1e4, device=DEVICE, dtype=dtype) for _ in range(pad)]
        keys, values = garbage + [k for k, *_ in levels], garbage + [v for _, v, *_ in levels]
        tensors = [t for level in step_inputs(plan, q, ks, keys) for t in level]
        assert len(tensors) == 6 * (pad + len(levels))
        out, lse = planned_attention(q, ks, vs, keys, values, tensors, mask, D ** -0.5, None, backend=backend)
        exp_out, exp_lse = cascade_f64(q, ks, vs, levels, D ** -0.5, mask.expand(B, 1, S))
        torch.testing.assert_close(out.transpose(1, 2).double().cpu(), exp_out, atol=2e-5, rtol=2e-5)
        fin = torch.isfinite(exp_lse)
        torch.testing.assert_close(lse.double().cpu()[fin], exp_lse[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_op_key_length(backend):
    """The compiled / recorded step's op with ``key_length`` (fixed buffers written up to it): exact against the
    written keys only; on Triton the unwritten columns (NaN here) are not read."""
    from hf_cascade.ops.cascade_wrapper import planned_attention, step_inputs
    from hf_cascade.ops.plan import plan_cascade

    torch.manual_seed(4)
    B, Hq, Hkv, D, S, written = 5, 6, 2, 24, 11, 6
    row_nodes, lens = [[0, 0, 1, 1, -1]], [[9, 4]]
    levels = [make_level(Hkv, D, torch.float32, l, r) for l, r in zip(lens, row_nodes)]
    plan = plan_cascade(torch.tensor(row_nodes), [s.tolist() for *_, s in levels], B, torch.device(DEVICE))
    q = torch.randn(B, Hq, 1, D, device=DEVICE)
    ks = torch.randn(B, Hkv, S, D, device=DEVICE)
    vs = torch.randn(B, Hkv, S, D, device=DEVICE)
    ks[:, :, written:] = vs[:, :, written:] = float("nan") if backend != "torch" else 1e4
    mask = torch.ones(B, 1, S, dtype=torch.bool, device=DEVICE)
    mask[1, :, :2] = False
    keys, values = [k for k, *_ in levels], [v for _, v, *_ in levels]
    tensors = [t for level in step_inputs(plan, q, ks, keys) for t in level]
    out, lse = planned_attention(q, ks, vs, keys, values, tensors, mask, D ** -0.5, None,
                                 backend=backend, key_length=torch.tensor(written, device=DEVICE))
    exp_out, exp_lse = cascade_f64(q, ks[:, :, :written], vs[:, :, :written], levels, D ** -0.5,
                                   mask[:, :, :written].expand(B, 1, written))
    torch.testing.assert_close(out.transpose(1, 2).double().cpu(), exp_out, atol=2e-5, rtol=2e-5)
    fin = torch.isfinite(exp_lse)
    torch.testing.assert_close(lse.double().cpu()[fin], exp_lse[fin], atol=1e-4, rtol=1e-5)


def test_planned_op_reads_one_layer_of_stacked_levels():
    """The compiled step passes each level's KV of every layer as one ``[layers, Hkv, T, D]`` tensor and the layer
    index: the op reads that layer's keys, the same answer as given that layer's tensors (and not another's)."""
    from hf_cascade.ops.cascade_wrapper import step_inputs
    from hf_cascade.ops.plan import plan_cascade

    torch.manual_seed(1)
    B, Hq, Hkv, D, S, layers = 3, 4, 2, 16, 5, 3
    q = torch.randn(B, Hq, 1, D, device=DEVICE)
    ks, vs = torch.randn(B, Hkv, S, D, device=DEVICE), torch.randn(B, Hkv, S, D, device=DEVICE)
    mask = torch.ones(B, 1, S, dtype=torch.bool, device=DEVICE)
    row_nodes, lens = [[0, 0, 1]], [[6, 3]]
    plan = plan_cascade(torch.tensor(row_nodes), [[0, 6, 9]], B, torch.device(DEVICE))
    stacked_k = torch.randn(layers, Hkv, sum(lens[0]), D, device=DEVICE)
    stacked_v = torch.randn(layers, Hkv, sum(lens[0]), D, device=DEVICE)
    tensors = [t for level in step_inputs(plan, q, ks, [stacked_k[0]]) for t in level]
    op = torch.ops.hf_cascade.cascade_attention
    for layer in range(layers):
        got, got_lse = op(q, ks, vs, [stacked_k], [stacked_v], tensors, mask, D ** -0.5, None, layer)
        want, want_lse = op(q, ks, vs, [stacked_k[layer]], [stacked_v[layer]], tensors, mask, D ** -0.5, None)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    other, _ = op(q, ks, vs, [stacked_k[0]], [stacked_v[0]], tensors, mask, D ** -0.5, None)
    assert not torch.allclose(got, other)


def test_wrapper_plans_once_and_runs_eager_or_the_op():
    """CascadeWrapper, the caches' one door (ops/cascade_wrapper.py): ``plan`` builds once per layout (a new batch
    size, key count or rows object re-plans; ``reset`` drops the plan and the op's index tensors); ``run`` launches
    eagerly, planning the op's index tensors on the way once prefix slots are set, and in a static step calls the op
    on the slots and the layer index: the same attention, as exact as the eager launch."""
    from hf_cascade.ops.cascade_wrapper import CascadeWrapper, LevelKV, PrefixSlots

    torch.manual_seed(2)
    B, Hq, Hkv, D, S, layers = 3, 4, 2, 16, 5, 2
    q = torch.randn(B, Hq, 1, D, device=DEVICE)
    ks, vs = torch.randn(B, Hkv, S, D, device=DEVICE), torch.randn(B, Hkv, S, D, device=DEVICE)
    mask = torch.ones(B, 1, S, dtype=torch.bool, device=DEVICE)
    mask[2, :, :2] = False
    row_nodes = torch.tensor([[0, 0, 1]])
    stacked_k = torch.randn(layers, Hkv, 9, D, device=DEVICE)
    stacked_v = torch.randn(layers, Hkv, 9, D, device=DEVICE)
    wrapper = CascadeWrapper()
    plan = wrapper.plan(row_nodes, [[0, 6, 9]], B, torch.device(DEVICE))
    assert wrapper.plan(row_nodes, [[0, 6, 9]], B, torch.device(DEVICE)) is plan
    assert wrapper.plan(row_nodes.clone(), [[0, 6, 9]], B, torch.device(DEVICE)) is not plan
    wrapper.prefix_slots = PrefixSlots([stacked_k], [stacked_v])
    level = LevelKV(list(stacked_k.unbind(0)), list(stacked_v.unbind(0)))
    levels = [make_level(Hkv, D, torch.float32, [6, 3], [0, 0, 1])]
    for layer in range(layers):
        eager, eager_lse = wrapper.run(layer, q, ks, vs, [level], scale=D ** -0.5, mask=mask)
        assert wrapper.op_inputs is not None and len(wrapper.op_inputs) == 6
        got, got_lse = wrapper.run(layer, q, ks, vs, [level], scale=D ** -0.5, mask=mask, static=True)
        torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_lse, eager_lse, atol=1e-4, rtol=1e-5)
        levels[0] = (stacked_k[layer], stacked_v[layer], *levels[0][2:])
        exp_out, _ = cascade_f64(q, ks, vs, levels, D ** -0.5, mask.expand(B, 1, S))
        torch.testing.assert_close(eager.transpose(1, 2).double().cpu(), exp_out, atol=2e-5, rtol=2e-5)
    wrapper.reset()
    assert wrapper.layout is None and wrapper.op_inputs is None and wrapper.prefix_slots is not None
