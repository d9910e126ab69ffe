"""Cascade generate() == reference generate() (sdpa; eager for Gemma2), fp32 on CPU, for every generate mode.

Prompts are built like real shared-prefix workloads: a system prompt common to every row, a few-shot block
common to a group of rows, then a per-row question of varying length; the reference model gets the ordinary
left-padded batch a tokenizer returns.
"""

import pytest
import torch
import transformers

import hf_cascade
from hf_cascade.model_zoo import available_families, reference_attention, tiny_model
from hf_cascade.transformers_compat import CACHE_KWARG

MAX_NEW = 6


def make_prompts(seed=0, system=11, block=7, groups=2, per_group=2, vocab=128):
    """Token lists: [system][block of the group][question]; tokens >= 3 (0/1/2 are pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: (torch.randint(3, vocab, (n,), generator=g)).tolist()  # noqa: E731
    sys_tokens = [1] + rand(system - 1)
    rows = []
    for _ in range(groups):
        block_tokens = rand(block)
        for i in range(per_group):
            rows.append(sys_tokens + block_tokens + rand(2 + 3 * i))
    return rows


def tree_prompts(levels, own, rows, seed=0, vocab=128):
    """Token lists of ``rows`` rows sharing a tree: per level ``(groups, tokens each)`` (group g of a level holds
    rows [g * rows / groups, (g + 1) * rows / groups)), then ``own`` tokens of each row's own."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    segments = [[rand(tokens) for _ in range(groups)] for groups, tokens in levels]
    out = []
    for r in range(rows):
        row = [1]
        for (groups, _), segs in zip(levels, segments):
            row += segs[r * groups // rows]
        out.append(row + rand(own))
    return out


def pad_batch(rows, side="left", pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if side == "left":
            ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
        else:
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def model_pair(family, seed=0, **overrides):
    ref = tiny_model(family, reference_attention(family), seed=seed, **overrides)
    cas = tiny_model(family, "cascade", seed=seed, **overrides)
    assert ref.config is not cas.config
    assert ref.config._attn_implementation == reference_attention(family)
    assert cas.config._attn_implementation == "cascade"
    return ref, cas


def run_pair(ref, cas, rows, gen_kwargs, side="left", seed=None, **options):
    ids, mask = pad_batch(rows, side="left")  # the reference needs left padding to generate correctly
    cas_ids, cas_mask = pad_batch(rows, side=side)  # shared_prefix_inputs takes either
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    gen.update(gen_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    want = ref.generate(input_ids=ids, attention_mask=mask, **gen)
    inputs = hf_cascade.shared_prefix_inputs(cas, cas_ids, cas_mask, min_shared_tokens=2, **options)
    if seed is not None:
        torch.manual_seed(seed)
    got = cas.generate(**inputs, **gen)
    want_new = want.sequences[:, ids.shape[1] :]
    got_new = got.sequences[:, inputs["input_ids"].shape[1] :]
    return want, got, want_new, got_new, inputs


def assert_logits_close(want, got, atol=1e-4):
    assert len(want.logits) == len(got.logits)
    for w, g in zip(want.logits, got.logits):
        torch.testing.assert_close(g, w, atol=atol, rtol=0)


@pytest.mark.parametrize("family", available_families())
def test_greedy_multilevel_matches_reference(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=1)
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, dict(do_sample=False))
    cache = inputs[CACHE_KWARG]
    assert cache.num_levels == 2, cache  # system prompt -> few-shot block
    assert [level.num_nodes for level in cache.levels] == [1, 2]
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("layout", ["full", "suffix"])
def test_padding_side_and_layout(family, side, layout):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=2, groups=3, per_group=2)
    if side == "right":  # right-padded rows that share a prefix are refused (tests/test_silent_edges_4.py)
        with pytest.raises(ValueError, match=r'right-padded.*padding_side = "left"'):
            run_pair(ref, cas, rows, dict(do_sample=False), side=side, layout=layout)
        return
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, dict(do_sample=False), side=side, layout=layout)
    if layout == "suffix":
        assert inputs["input_ids"].shape[1] < inputs["attention_mask"].shape[1]
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_sampling_same_seed_same_tokens(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=3)
    gen = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    want, got, want_new, got_new, _ = run_pair(ref, cas, rows, gen, seed=1234)
    assert torch.equal(got_new, want_new)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_num_return_sequences_keeps_prefix_once(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=4, groups=1, per_group=2)
    gen = dict(do_sample=True, num_return_sequences=3, top_k=10)
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, gen, seed=7)
    assert got_new.shape[0] == 6
    assert torch.equal(got_new, want_new)
    cache = inputs[CACHE_KWARG]
    # The prefix is stored once (no batch dimension) although 6 rows decoded from it.
    assert all(k.dim() == 3 for level in cache.levels for k in level.keys)
    assert cache.layers[0].keys.shape[0] == 6


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_beam_search(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=5)
    gen = dict(num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True)
    want, got, want_new, got_new, _ = run_pair(ref, cas, rows, gen)
    assert torch.equal(got_new, want_new)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-4, rtol=0)


def test_eos_rows_finish_at_different_steps():
    ref, cas = model_pair("llama")
    rows = make_prompts(seed=6, groups=2, per_group=2)
    _, _, free_run, _, _ = run_pair(ref, cas, rows, dict(do_sample=False, max_new_tokens=8))
    eos = int(free_run[0, 2])  # a token row 0 emits at step 2: it stops there, the others later or never
    want, got, want_new, got_new, _ = run_pair(
        ref, cas, rows, dict(do_sample=False, max_new_tokens=8, eos_token_id=eos, output_scores=True)
    )
    assert torch.equal(got_new, want_new)
    finished = (want_new == eos).any(dim=1)
    assert finished[0] and not finished.all()
    for w, g in zip(want.scores, got.scores):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_generation_config_cache_implementation():
    ref, cas = model_pair("llama")
    for model in (ref, cas):
        model.generation_config.cache_implementation = "static"
    rows = make_prompts(seed=7)
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, dict(do_sample=False))
    assert inputs["cache_implementation"] is None
    assert torch.equal(got_new, want_new)


def test_rows_sharing_nothing_degrade_to_plain_attention():
    ref, cas = model_pair("llama")
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 2)]
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, dict(do_sample=False))
    assert inputs[CACHE_KWARG].num_levels == 0
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)


def test_one_row_fully_inside_another_row():
    # Row 0 is a prefix of row 1: the shared part must leave row 0 at least its last token.
    ref, cas = model_pair("qwen3")
    base = make_prompts(seed=9, groups=1, per_group=1)[0]
    rows = [base, base + [5, 6, 7], base[:-3]]
    want, got, want_new, got_new, _ = run_pair(ref, cas, rows, dict(do_sample=False))
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)


def test_cascade_without_prefix_is_sdpa():
    """No hf_cascade cache in play: "cascade" behaves exactly like "sdpa"."""
    ref, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=10))
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    got = cas.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    assert torch.equal(got, want)
    with torch.no_grad():
        torch.testing.assert_close(cas(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)


@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 18),
    reason="transformers 5.17's chunked prefill re-feeds the columns a pre-filled cache already holds (any cache)",
)
def test_chunked_prefill_matches_reference():
    """generate(prefill_chunk_size=k) feeds the suffixes in chunks through the cascade cache."""
    ref, cas = model_pair("llama")
    rows = make_prompts(seed=13, groups=2, per_group=2)
    want, got, want_new, got_new, _ = run_pair(ref, cas, rows, dict(do_sample=False, prefill_chunk_size=3))
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)
