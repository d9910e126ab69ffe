"""Context-parallel primitives on CPU/gloo: zigzag layout, ring attention, all-gather / tree / all-to-all combine.

Each distributed check runs in one spawn of 2 or 4 gloo processes (module-scoped fixture); every worker returns
its max errors against full attention over the gathered sequence, computed in fp64 on every rank, and the tests
assert on them. fp32 everywhere; tolerance 2e-5 (fp32 rounding of a softmax over <= 64 keys). The combines are
also held to 1e-6 against each other and against fp32 attention over all keys in one process (``EXACT_TOL``).
"""

from __future__ import annotations

import pytest
import torch

from hf_cascade.parallel.layout import ZigzagLayout

TOL = 2e-5
# Combines vs each other and vs one-process fp32 attention: out is an O(1) average of N(0, 1) values and lse ~4, so
# a few fp32 roundings of the merge (ulp 6e-8 / 4.8e-7); observed <= 2.4e-7 (out) and 4.8e-7 (lse).
EXACT_TOL = 1e-6
COMBINE_METHODS = ("all_gather", "tree", "all_to_all")


# ----------------------------------------------------------------------------- layout (no processes)
@pytest.mark.parametrize("length,world", [(0, 2), (1, 2), (7, 2), (8, 2), (13, 4), (16, 4), (5, 3), (9, 1)])
def test_zigzag_layout_partitions_the_sequence(length, world):
    layout = ZigzagLayout(length, world)
    assert layout.padded_length % (2 * world) == 0 and layout.padded_length - length < 2 * world
    cols = [layout.columns(r) for r in range(world)]
    assert all(c.numel() == layout.local_length for c in cols)
    assert torch.equal(torch.sort(torch.cat(cols)).values, torch.arange(layout.padded_length))
    real = [layout.real_columns(r) for r in range(world)]
    assert [x.numel() for x in real] == [layout.num_real(r) for r in range(world)]
    owners = layout.owners()
    for r in range(world):
        assert torch.equal(torch.nonzero(owners == r).flatten(), real[r])
        first, second = layout.chunk_ids(r)
        assert first == r and second == 2 * world - 1 - r
    # Balanced: the real token counts differ by less than one chunk + padding.
    counts = [x.numel() for x in real]
    assert max(counts) - min(counts) <= layout.chunk + (layout.padded_length - length)


def test_zigzag_shard_unshard_roundtrip():
    layout = ZigzagLayout(11, 2)
    x = torch.arange(3 * 11).view(3, 11)
    shards = [layout.shard(x, r, dim=1, pad_value=-1) for r in range(2)]
    assert shards[0].shape == (3, 2 * layout.chunk)
    assert torch.equal(layout.unshard(shards, dim=1), x)
    assert (shards[0][:, layout.columns(0) >= 11] == -1).all()


def test_zigzag_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        ZigzagLayout(4, 0)
    with pytest.raises(ValueError, match="length 5"):
        ZigzagLayout(5, 2).shard(torch.zeros(2, 6), 0)


# ----------------------------------------------------------------------------- distributed workers
def _full_attention(q, k, v, scale, visible):
    """fp64 reference: q [B,Hq,L,D], k/v [B,Hkv,S,D], visible bool [B,L,S] -> (out, lse); empty rows -> 0, -inf."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    return p @ v, lse


# (batch, q heads, kv heads, sequence length, head dim, left padding per row)
RING_CASES = {
    "gqa_odd_length": (1, 4, 2, 13, 16, None),
    "mqa_exact_multiple": (1, 4, 1, 24, 8, None),
    "mha_tiny_sequence": (1, 2, 2, 3, 8, None),
    "gqa_left_padded_batch": (3, 4, 2, 19, 8, [0, 5, 11]),
}


def _ring_worker(rank, world, cases):
    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel.ring import ring_attention, ring_exchange_numel

    info = resolve_group()
    errors = {}
    for name, (B, Hq, Hkv, T, D, pads) in cases.items():
        torch.manual_seed(0)
        q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
        valid = torch.ones(B, T, dtype=torch.bool)
        for b, p in enumerate(pads or []):
            valid[b, :p] = False
        cols = torch.arange(T)
        visible = (cols[None, :] <= cols[:, None])[None] & valid[:, None, :]
        ref_out, ref_lse = _full_attention(q, k, v, 0.3, visible)

        layout = ZigzagLayout(T, world)
        key_valid = None
        if pads:
            key_valid = torch.cat([valid, torch.ones(B, layout.padded_length - T, dtype=torch.bool)], dim=1)
        shard = [layout.shard(x, rank, dim=2) for x in (q, k, v)]
        out, lse = ring_attention(*shard, layout=layout, info=info, scale=0.3, key_valid=key_valid)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        # The same through exchange buffers kept from call to call (the prefill's workspace): NaN-filled and larger
        # than needed, used twice, the same bits.
        exchange = torch.full((ring_exchange_numel(shard[1]) + 5,), float("nan"))
        same = []
        for _ in range(2):
            out_x, lse_x = ring_attention(*shard, layout=layout, info=info, scale=0.3, key_valid=key_valid,
                                          exchange=exchange)
            same.append(torch.equal(out_x, out) and torch.equal(lse_x, lse))
        mine = layout.columns(rank) < T  # drop end padding
        real = layout.real_columns(rank)
        # Rows a query can attend: not a left-padding query.
        has_keys = valid[:, real]  # [B, n_real]
        exp_out = ref_out[:, :, real]
        exp_lse = ref_lse[:, :, real]
        got_out, got_lse = out[:, :, mine].double(), lse[:, :, mine].double()
        err_out = (got_out - exp_out).abs().amax(dim=(1, 3))  # [B, n_real]
        err_lse = torch.where(has_keys[:, None], (got_lse - exp_lse).abs(), 0.0).amax(dim=1)
        pad_rows_ok = bool(((got_lse == float("-inf")) | has_keys[:, None]).all() and
                           (torch.where(has_keys[:, None, :, None], 0.0, got_out.abs()) == 0).all())
        errors[name] = (float(err_out.max()) if err_out.numel() else 0.0,
                        float(err_lse.max()) if err_lse.numel() else 0.0, pad_rows_ok, all(same))
    return errors


# (batch, q heads, kv heads, q_len, head dim, total keys)
COMBINE_CASES = {
    "decode_gqa": (2, 4, 2, 1, 16, 37),
    "heads_not_divisible": (1, 6, 3, 1, 8, 9),
    "multi_query_tokens": (2, 4, 1, 3, 8, 21),
    "fewer_keys_than_ranks": (1, 4, 2, 1, 8, 2),
}


def _combine_worker(rank, world, cases):
    from hf_cascade.ops.suffix_attention import suffix_attention
    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel.combine import all_gather_kv, combine_states

    info = resolve_group()
    errors = {}
    for name, (B, Hq, Hkv, Lq, D, S) in cases.items():
        torch.manual_seed(1)
        q, k, v = torch.randn(B, Hq, Lq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
        visible = torch.rand(B, Lq, S) > 0.3
        visible[0, 0] = False  # one query row sees no key at all
        ref_out, ref_lse = _full_attention(q, k, v, 0.25, visible)
        # Uneven, random split of the keys over ranks (a rank may get none).
        owner = torch.randint(0, world, (S,))
        owner[: min(S, world)] = torch.arange(min(S, world)).flip(0)
        mine = torch.nonzero(owner == rank).flatten()
        o, lse = suffix_attention(q, k[:, :, mine], v[:, :, mine], scale=0.25, mask=visible[:, :, mine])
        # One process, all keys, fp32: what the combines must reproduce to ~1e-6.
        one_out, one_lse = suffix_attention(q, k, v, scale=0.25, mask=visible)
        # Garbage (NaN) in the outputs of empty states: the merge must ignore it, not propagate it.
        o_nan = torch.where((lse == float("-inf")).unsqueeze(-1), float("nan"), o)
        finite = ref_lse > float("-inf")
        result = {}
        for method in COMBINE_METHODS:
            out, lse_c = combine_states(o, lse, info, method)
            out_nan, lse_nan = combine_states(o_nan, lse, info, method)
            result[method] = dict(
                err_out=float((out.double() - ref_out).abs().max()),
                err_lse=float(torch.where(finite, lse_c.double() - ref_lse, 0.0).abs().max()),
                empty_ok=bool((lse_c[~finite] == float("-inf")).all() and (out[~finite] == 0).all()),
                err_one_out=float((out - one_out).abs().max()),
                err_one_lse=float(torch.where(finite, lse_c - one_lse, 0.0).abs().max()),
                nan_ignored=bool(torch.equal(out_nan, out) and torch.equal(lse_nan, lse_c)),
                dtypes=(out.dtype, lse_c.dtype),
                out=out,
                lse=lse_c,
            )
        # Low-precision outputs come back in their dtype; the LSE stays fp32.
        out_bf16, lse_bf16 = combine_states(o.bfloat16(), lse, info, "all_gather")
        result["all_gather"]["bf16_dtypes"] = (out_bf16.dtype, lse_bf16.dtype)
        result["all_gather"]["bf16_err"] = float((out_bf16.float() - result["all_gather"]["out"]).abs().max())
        lengths = [int((owner == r).sum()) for r in range(world)]
        kk, vv, cols = all_gather_kv(k[:, :, mine], v[:, :, mine], mine, lengths, info)
        order = torch.argsort(cols)
        gathered_ok = bool(torch.equal(kk[:, :, order], k) and torch.equal(vv[:, :, order], v))
        errors[name] = (result, gathered_ok)
    return errors


def _primitives_worker(rank, world):
    # One spawn per world size runs every case: starting gloo workers costs more than the checks.
    return _ring_worker(rank, world, RING_CASES), _combine_worker(rank, world, COMBINE_CASES)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def distributed_results(request):
    from hf_cascade.parallel._testing import run_on_gloo

    world = request.param
    results = run_on_gloo(_primitives_worker, world, timeout_s=300)
    return world, [r[0] for r in results], [r[1] for r in results]


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention_matches_full_causal_attention(distributed_results, case):
    world, ring, _ = distributed_results
    for rank in range(world):
        err_out, err_lse, pad_rows_ok, exchange_same = ring[rank][case]
        assert exchange_same, f"rank {rank}: the ring through kept exchange buffers gave other bits"
        assert err_out < TOL, f"rank {rank}: out max error {err_out}"
        assert err_lse < TOL, f"rank {rank}: lse max error {err_lse}"
        assert pad_rows_ok, f"rank {rank}: left-padding queries must give out 0, lse -inf"


@pytest.mark.parametrize("case", list(COMBINE_CASES))
@pytest.mark.parametrize("method", COMBINE_METHODS)
def test_combine_matches_full_attention(distributed_results, case, method):
    world, _, combine = distributed_results
    for rank in range(world):
        r = combine[rank][case][0][method]
        assert r["err_out"] < TOL, f"{method} rank {rank}: out max error {r['err_out']} vs fp64"
        assert r["err_lse"] < TOL, f"{method} rank {rank}: lse max error {r['err_lse']} vs fp64"
        assert r["err_one_out"] < EXACT_TOL, f"{method} rank {rank}: out vs 1-process fp32: {r['err_one_out']}"
        assert r["err_one_lse"] < EXACT_TOL, f"{method} rank {rank}: lse vs 1-process fp32: {r['err_one_lse']}"
        assert r["empty_ok"], f"{method} rank {rank}: a query with no keys anywhere must get out 0, lse -inf"
        assert r["nan_ignored"], f"{method} rank {rank}: NaN in an empty state's output must not change the result"
        assert r["dtypes"] == (torch.float32, torch.float32)
        # Every rank holds the same result, bit for bit.
        assert torch.equal(r["out"], combine[0][case][0][method]["out"]), f"{method}: rank {rank} differs from rank 0"
        assert torch.equal(r["lse"], combine[0][case][0][method]["lse"]), f"{method}: rank {rank} differs from rank 0"


@pytest.mark.parametrize("case", list(COMBINE_CASES))
def test_combines_agree_and_gather_kv(distributed_results, case):
    world, _, combine = distributed_results
    for rank in range(world):
        result, gathered_ok = combine[rank][case]
        assert gathered_ok, f"rank {rank}: all_gather_kv must return every key once"
        for method in ("tree", "all_to_all"):
            assert (result["all_gather"]["out"] - result[method]["out"]).abs().max() < EXACT_TOL
            finite = result[method]["lse"] > float("-inf")
            assert torch.equal(finite, result["all_gather"]["lse"] > float("-inf"))
            diff = torch.where(finite, result["all_gather"]["lse"] - result[method]["lse"], 0.0)
            assert diff.abs().max() < EXACT_TOL
        assert result["all_gather"]["bf16_dtypes"] == (torch.bfloat16, torch.float32)
        assert result["all_gather"]["bf16_err"] < 1e-2  # bf16 inputs: 8 mantissa bits


def test_combine_local_handles_empty_partials():
    from hf_cascade.parallel.combine import combine_local

    outs = torch.tensor([[[1.0, 2.0]], [[float("nan"), 0.0]]])  # [N=2, 1, D=2]; second partial is empty garbage
    lses = torch.tensor([[0.5], [float("-inf")]])
    out, lse = combine_local(outs, lses)
    assert torch.equal(out, torch.tensor([[1.0, 2.0]])) and torch.allclose(lse, torch.tensor([0.5]))
    out, lse = combine_local(outs, torch.full((2, 1), float("-inf")))
    assert torch.equal(out, torch.zeros(1, 2)) and lse.item() == float("-inf")


def test_combine_local_n_way_is_exact_and_stable():
    from hf_cascade.parallel.combine import combine_local

    torch.manual_seed(0)
    # 5 partial states, LSEs far apart (exp would overflow without the max shift); two empty (-inf, +inf).
    outs = torch.randn(5, 3, 4)
    lses = torch.tensor([[300.0, -2.0, 0.0], [299.0, float("-inf"), 1.0], [float("inf")] * 3,
                         [float("-inf")] * 3, [310.0, -3.0, float("nan")]])
    out, lse = combine_local(outs, lses)
    valid = torch.isfinite(lses)
    ref_lse = torch.logsumexp(torch.where(valid, lses, float("-inf")).double(), dim=0)
    w = torch.where(valid, torch.exp(lses.double() - ref_lse), 0.0)
    ref_out = (w.unsqueeze(-1) * torch.where(valid.unsqueeze(-1), outs.double(), 0.0)).sum(0)
    assert (lse.double() - ref_lse).abs().max() < 5e-5  # lse ~300: fp32 spacing 3e-5 there
    assert (out.double() - ref_out).abs().max() < 1e-6
    with pytest.raises(ValueError, match="all_gather"):
        from hf_cascade.parallel.combine import check_combine

        check_combine("allgather")
