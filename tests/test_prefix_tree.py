"""find_shared_prefixes: nested sharing, folding of short segments, the last-token rule, the cost model veto."""

import pytest

from hf_cascade import find_shared_prefixes
from hf_cascade.cost_model import CascadeCostModel


def test_nested_levels_and_row_chains():
    system, a, b = list(range(10, 20)), list(range(30, 36)), list(range(40, 46))
    rows = [system + a + [1, 2], system + b + [3], system + a + [4, 5, 6], system + b + [7, 8], [99, 98, 97]]
    tree = find_shared_prefixes(rows, min_shared_tokens=3)
    assert [len(level) for level in tree.levels] == [1, 2]
    assert tree.levels[0][0].tokens == tuple(system) and tree.levels[0][0].rows == (0, 1, 2, 3)
    assert {n.tokens for n in tree.levels[1]} == {tuple(a), tuple(b)}
    assert tree.row_prefix_len == [16, 16, 16, 16, 0]
    assert tree.row_nodes[0] == [0, 0, 0, 0, -1]
    assert tree.row_nodes[1][0] == tree.row_nodes[1][2] != tree.row_nodes[1][1] == tree.row_nodes[1][3]
    assert tree.levels[1][0].parent == 0 and tree.levels[1][0].start == 10
    assert tree.saved_tokens == 16 * 4 - (10 + 6 + 6)


def test_rows_as_lists_tuples_arrays_and_tensors_give_one_tree():
    import numpy as np
    import torch

    system, a, b = list(range(10, 20)), list(range(30, 36)), list(range(40, 46))
    rows = [system + a + [1, 2], system + b + [3], system + a + [4, 5, 6], system + b + [7, 8], [99, 98, 97]]
    want = find_shared_prefixes(rows, min_shared_tokens=3)
    for as_row in (tuple, np.array, torch.tensor, lambda r: [torch.tensor(t) for t in r],
                   lambda r: [np.int64(r[0]), *r[1:]]):
        tree = find_shared_prefixes([as_row(r) for r in rows], min_shared_tokens=3)
        assert tree.row_nodes == want.row_nodes and tree.row_prefix_len == want.row_prefix_len
        assert [[(n.tokens, n.rows) for n in level] for level in tree.levels] == \
            [[(n.tokens, n.rows) for n in level] for level in want.levels]
        assert all(type(t) is int for level in tree.levels for n in level for t in n.tokens)


def test_short_common_run_folds_into_children():
    # Rows share 2 tokens, then two groups share 6 more each: with min_shared_tokens=4 the 2-token run
    # cannot be a node; each child node carries it (8 tokens), at level 0.
    rows = [[5, 6, 10, 11, 12, 13, 14, 15, 1], [5, 6, 10, 11, 12, 13, 14, 15, 2],
            [5, 6, 20, 21, 22, 23, 24, 25, 3], [5, 6, 20, 21, 22, 23, 24, 25, 4]]
    tree = find_shared_prefixes(rows, min_shared_tokens=4)
    assert len(tree.levels) == 1 and len(tree.levels[0]) == 2
    assert all(len(n.tokens) == 8 and n.start == 0 for n in tree.levels[0])


def test_last_token_never_shared_and_limits():
    rows = [[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6, 7]]
    tree = find_shared_prefixes(rows, min_shared_tokens=1)
    assert tree.row_prefix_len == [3, 3, 3]  # identical rows still feed their last token to the model
    assert find_shared_prefixes(rows, min_shared_tokens=1, max_levels=0).levels == []
    assert find_shared_prefixes([[1, 2, 3]], min_shared_tokens=1).levels == []
    with pytest.raises(ValueError, match="min_rows"):
        find_shared_prefixes(rows, min_rows=1)


def test_cost_model_vetoes_what_measured_slower():
    model = CascadeCostModel()
    assert model.share(64, 16384, 256)  # the showcase: long prefix, wide batch
    assert model.share(8, 4096, 128)
    assert not model.share(8, 64, 1024)  # a short segment before long suffixes: bytes barely change, 448 tokens saved
    assert not model.share(1, 4096, 0) and not model.share(2, 0, 5)
    # The decode kernel alone: fewer than 8 rows never beat per-row KV (H100) ...
    decode_only = CascadeCostModel(min_saved_tokens=10**9, prefill_us_per_token=0.0)
    assert not decode_only.share(4, 16384, 0)
    # ... but folded, 4 rows would prefill and keep 3 more copies of 16K tokens: stored once.
    assert model.share(4, 16384, 0)
    # GRPO-shaped: 16 prompts x 8 samples share a 256-token system prompt: byte ratio 1.4, but 32,512 tokens of
    # per-row copies (prefill and memory) are saved.
    assert model.share(128, 256, 641) and not decode_only.share(128, 256, 641)


def test_cost_model_weighs_the_prefill_a_level_saves_against_its_decode_steps():
    # The layout stream's trees (H100, Llama-3-8B: 36 us of prefill per prompt token, 540 us per step for a level):
    # 8 nodes of 512 tokens, 4 of 32 rows each: 1,536 tokens saved per node (55 ms) against 64 steps x 540 us x 4/32.
    stream = CascadeCostModel(batch_rows=32, new_tokens=64)
    assert stream.share(4, 512, 64)
    assert stream.share(2, 256, 64)  # 16 nodes of 256 tokens, 2 rows each: 9.2 ms saved, 2.2 ms charged
    # A node charged the whole level (batch_rows unknown): 256 saved tokens do not pay for 64 steps of a level.
    assert not CascadeCostModel(new_tokens=64).share(2, 256, 64)
    # More decode steps make the level dearer: 1,536 saved tokens (55 ms) against 4,096 steps x 67.5 us.
    assert not CascadeCostModel(batch_rows=32, new_tokens=4096).share(4, 512, 64)


def test_cost_model_on_the_first_tier_charges_each_node_its_own_attention_calls():
    """The first tier attends node by node: a TRL rollout's level of 16 prompts of ~250 tokens x 8 samples, 256 new
    tokens (Qwen2.5-1.5B shape: 28 layers, ~6.2 us of prefill per prompt token) is folded into the rows there (each
    node 256 steps x ~236 us against 10.9 ms of prefill saved), and kept on
    the Triton tier (one launch per level, a node charged 8/128 of it); the system prompt shared by all 128 rows is
    kept on both."""
    layers, prefill_us = 28, 6.2
    triton = CascadeCostModel(batch_rows=128, new_tokens=256, prefill_us_per_token=prefill_us,
                              level_us_per_step=540.0 * layers / 32)
    first_tier = CascadeCostModel(batch_rows=128, new_tokens=256, prefill_us_per_token=prefill_us, builtin=True,
                                  builtin_node_us_per_step=270.0 * layers / 32)
    assert triton.share(8, 250, 0) and not first_tier.share(8, 250, 0)
    assert triton.share(128, 40, 250) and first_tier.share(128, 40, 250)
    # Long documents still pay for their calls on the first tier: 16 rows x 2,048 tokens (memory and prefill).
    assert first_tier.share(16, 2048, 64)


def test_cost_model_keeps_a_level_of_small_nodes_that_saves_prefill():
    """The layout stream's tree [(1, 2048), (8, 512)] + 64 own tokens, 32 rows (tokens scaled down 8x here; the
    constants scaled with them): with the prefill counted the 8 nodes of 4 rows are a level; by the decode kernel
    alone they would be folded into the rows."""
    rows, scale = [], 8
    system = list(range(1000, 1000 + 2048 // scale))
    for r in range(32):
        group = list(range(5000 + 1000 * (r // 4), 5000 + 1000 * (r // 4) + 512 // scale))
        rows.append(system + group + [70000 + 100 * r + i for i in range(64 // scale)])
    with_prefill = CascadeCostModel(batch_rows=32, new_tokens=64 // scale, min_saved_tokens=2048 // scale)
    tree = find_shared_prefixes(rows, keep_node=with_prefill.share)
    assert [len(level) for level in tree.levels] == [1, 8]
    decode_only = CascadeCostModel(new_tokens=64 // scale, min_saved_tokens=2048 // scale, prefill_us_per_token=0.0)
    assert [len(level) for level in find_shared_prefixes(rows, keep_node=decode_only.share).levels] == [1]


def test_cost_model_scales_its_prefill_constants_to_the_model():
    from hf_cascade.tiny import tiny_model

    model = tiny_model("llama")
    scaled = CascadeCostModel.for_model(model, new_tokens=100, batch_rows=12)
    layers = model.config.num_hidden_layers
    assert scaled.new_tokens == 100 and scaled.batch_rows == 12
    assert scaled.level_us_per_step == pytest.approx(540.0 * layers / 32)
    assert scaled.builtin_node_us_per_step == pytest.approx(270.0 * layers / 32) and not scaled.builtin
    assert CascadeCostModel.for_model(model, builtin=True).builtin
    assert scaled.prefill_us_per_token == pytest.approx(
        36.0 * model.num_parameters(exclude_embeddings=True) / 7.50e9)
    # A tiny model's prefill is cheap: small segments are left to the rows (the byte ratio still decides).
    assert not scaled.share(4, 512, 64)
    assert CascadeCostModel.for_model(model, min_rows=2).min_rows == 2
    rows = [list(range(10, 30)) + [i] for i in range(3)]
    seen = []
    veto = find_shared_prefixes(rows, min_shared_tokens=1, keep_node=lambda r, t, s: seen.append((r, t, s)) or False)
    assert veto.levels == [] and seen[0] == (3, 20, 1.0)


def test_tensor_rows_padded_with_minus_one_give_the_tree_of_lists(monkeypatch):
    import random

    import torch

    from hf_cascade import prefix_tree

    # Tiny comparison blocks: every common prefix spans several of them, on both paths.
    monkeypatch.setattr(prefix_tree, "_TENSOR_BLOCK_ELEMENTS", 7)
    monkeypatch.setattr(prefix_tree, "_BLOCK", 3)
    rng = random.Random(0)
    for case in range(150):
        vocab = rng.choice([2, 3, 50])  # small vocabularies: accidental sharing everywhere
        system = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        groups = [[rng.randrange(vocab) for _ in range(rng.randint(0, 9))] for _ in range(rng.randint(1, 3))]
        rows = [system + rng.choice(groups) + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
                for _ in range(rng.randint(0, 7))]
        if rows and case % 10 == 0:
            rows[0] = []  # an empty row shares nothing
        width = max((len(r) for r in rows), default=0) + rng.randint(0, 2)
        padded = torch.full((len(rows), width), -1, dtype=rng.choice([torch.int64, torch.int32]))
        for r, row in enumerate(rows):
            padded[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
        options = dict(min_shared_tokens=rng.choice([1, 2, 4]), min_rows=rng.choice([2, 3]),
                       max_levels=rng.choice([0, 1, 2, 4]))
        vetoes = ([], [])
        trees = [
            find_shared_prefixes(form, **options,
                                 keep_node=lambda r, t, s, seen=seen: seen.append((r, t, s)) or (r + t) % 3 > 0)
            for form, seen in zip((rows, padded), vetoes)
        ]
        want, got = trees
        assert vetoes[0] == vetoes[1], case
        assert got.row_nodes == want.row_nodes and got.row_prefix_len == want.row_prefix_len, case
        assert [[(n.tokens, n.rows, n.parent, n.start) for n in level] for level in got.levels] == \
            [[(n.tokens, n.rows, n.parent, n.start) for n in level] for level in want.levels], case
        assert all(type(n.tokens) is tuple and all(type(t) is int for t in n.tokens)
                   for level in got.levels for n in level)


@pytest.mark.parametrize("rows, match", [
    ([[1, 2, 3], [1, -1, 3]], "`rows` row 1 holds a negative entry"),  # padding before a token
    ([[1, 2, 3], [1, 2, -2]], "`rows` row 1 holds a negative entry"),  # not the -1 padding
    ([1, 2, 3], "2-D integer tensor"),
    ([[1.0, 2.0]], "2-D integer tensor"),
])
def test_tensor_rows_bad_padding(rows, match):
    import torch

    with pytest.raises(ValueError, match=match):
        find_shared_prefixes(torch.tensor(rows))
