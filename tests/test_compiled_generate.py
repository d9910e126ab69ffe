"""Fixed suffix buffers (``max_new_tokens`` / ``max_suffix_length``) and compiled decoding, fp32 on CPU.

A cache with fixed buffers is what transformers compiles: generate() then runs the decode step through
``torch.compile`` (on CUDA by default with CUDA graphs; here on CPU with ``fullgraph=True``, so any graph break
fails the test). Tokens must equal the reference (sdpa; eager for Gemma2) in every case.
"""

import pytest
import torch
from transformers import CompileConfig

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.step_context import TRACE
from hf_cascade.transformers_compat import CACHE_KWARG
from test_generate import assert_logits_close, make_prompts, model_pair, pad_batch, run_pair, tree_prompts

MAX_NEW = 6


def cpu_compile_config(backend="aot_eager"):
    config = CompileConfig(backend=backend, mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral"])
def test_fixed_buffers_eager_match_reference(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=31)
    want, got, want_new, got_new, inputs = run_pair(
        ref, cas, rows, dict(do_sample=False), max_new_tokens=MAX_NEW
    )
    cache = inputs[CACHE_KWARG]
    assert cache.is_compileable and cache.max_suffix_length == inputs["input_ids"].shape[1] - cache.prefix_length + MAX_NEW
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)
    # The buffers are full now: every suffix column written once.
    assert cache.suffix_length == cache.max_suffix_length - 1  # the last token is sampled, never fed back


@pytest.mark.parametrize("mode", ["beam", "sample", "return_sequences"])
def test_fixed_buffers_generation_modes(mode):
    ref, cas = model_pair("llama")
    rows = make_prompts(seed=32)
    gen = {
        "beam": dict(num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True),
        "sample": dict(do_sample=True, top_k=20),
        "return_sequences": dict(do_sample=True, num_return_sequences=2, top_k=10),
    }[mode]
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, gen, seed=5, max_new_tokens=MAX_NEW)
    assert torch.equal(got_new, want_new)
    if mode == "beam":
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_decode_matches_reference_without_recompiling(family):
    """generate() compiles the decode step (fullgraph); a second batch with the same layout reuses the graph."""
    ref, cas = model_pair(family)
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    config = cpu_compile_config()
    torch._dynamo.reset()
    frames = []
    rows = make_prompts(seed=33)
    # The second batch: other tokens, the same sharing structure (a bijection of the vocabulary, bos kept).
    relabeled = [[t if t < 3 else 3 + (7 * (t - 3) + 5) % 125 for t in row] for row in rows]
    for batch in (rows, relabeled):
        ids, mask = pad_batch(batch)
        want = ref.generate(input_ids=ids, attention_mask=mask, **gen)
        inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=MAX_NEW)
        got = cas.generate(**inputs, compile_config=config, **gen)
        assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
        assert torch.equal(got[:, inputs["input_ids"].shape[1] :], want[:, ids.shape[1] :])
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] >= 1 and frames[1] == frames[0], f"the second batch recompiled: {frames}"
    assert TRACE.binding is None  # the trace-time binding never leaks into eager runs


def test_compiled_decode_with_inductor():
    """The custom op through AOTAutograd + Inductor (C++ on CPU): the path CUDA graphs use on a GPU."""
    pytest.importorskip("torch._inductor")
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("Inductor on CPU needs a C++ compiler")
    ref, cas = model_pair("qwen2")  # MHA
    ids, mask = pad_batch(make_prompts(seed=35))
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    want = ref.generate(input_ids=ids, attention_mask=mask, **gen)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=MAX_NEW)
    got = cas.generate(**inputs, compile_config=cpu_compile_config("inductor"), **gen)
    assert torch.equal(got[:, inputs["input_ids"].shape[1] :], want[:, ids.shape[1] :])


def test_from_prefix_fixed_buffers_reused_across_batches_and_unmasked_forward():
    ref, cas = model_pair("llama")
    g = torch.Generator().manual_seed(36)
    prefix = torch.randint(3, 128, (13,), generator=g)
    cache = CascadeCache.from_prefix(cas, prefix, max_suffix_length=5 + MAX_NEW)
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    buffers = None
    for batch in (3, 3, 2):
        ids = torch.cat([prefix.expand(batch, -1), torch.randint(3, 128, (batch, 5), generator=g)], dim=1)
        mask = torch.ones_like(ids)
        want = ref.generate(input_ids=ids, attention_mask=mask, **gen)
        got = cas.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **gen)
        assert torch.equal(got, want)
        if buffers is not None and batch == 3:
            assert cache.layers[0].keys.data_ptr() == buffers  # same buffers for the same batch size
        buffers = cache.layers[0].keys.data_ptr()
    # A forward with no attention mask at all: the cache masks its own unwritten columns.
    cache.reset()
    ids = torch.cat([prefix[None], torch.randint(3, 128, (1, 4), generator=g)], dim=1)
    with torch.no_grad():
        want = ref(ids).logits[:, -4:]
        got = cas(ids[:, 13:], past_key_values=cache).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_fixed_buffers_too_small_is_a_clear_error():
    _, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=37))
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_suffix_length"):
        cas.generate(**inputs, max_new_tokens=4, pad_token_id=0, do_sample=False, disable_compile=True)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_buffer_sizes(bad):
    _, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=38))
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_cascade.shared_prefix_inputs(cas, ids, mask, max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_suffix_length"):
        CascadeCache.from_prefix(cas, ids[0, :5], max_suffix_length=bad)


def test_growing_cache_is_not_compileable():
    _, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=39))
    assert not hf_cascade.shared_prefix_inputs(cas, ids, mask)[CACHE_KWARG].is_compileable


def test_fixed_buffers_crop_both_conventions():
    _, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=40))
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=MAX_NEW)
    cas.generate(**inputs, max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    cache = inputs[CACHE_KWARG]
    length = cache.suffix_length
    cache.crop(-2)  # transformers >= 5.18: drop 2 tokens
    assert cache.suffix_length == length - 2
    cache.crop(cache.prefix_length + 1)  # 5.17 legacy: keep this absolute length
    assert cache.suffix_length == 1 and int(cache.get_seq_length()) == cache.prefix_length + 1
    with pytest.raises(ValueError, match="immutable"):
        cache.crop(-2)


# Batches with other sharing trees: 1 to 3 levels, other lengths and node counts, and fixed buffers of two
# capacity buckets (64 and 128 suffix columns with MAX_NEW_STREAM new tokens).
LAYOUT_STREAM = [
    ([(1, 40)], 6),
    ([(1, 10), (4, 10)], 6),
    ([(1, 80)], 2),
    ([(1, 5), (2, 20), (4, 5)], 6),
    ([(1, 10)], 12),
]
MAX_NEW_STREAM = 60


def test_one_argument_path_compiles_once_for_new_layouts():
    """custom_generate=hf_cascade.generate with fixed buffers (the CUDA default; here forced on CPU): batches with
    other sharing trees (1-3 levels, other lengths and nodes, another buffer bucket) reuse the compiled step; only
    the batch size makes another graph (as transformers' static cache does for a new size). The prefill forwards
    (compiled with the compiled step) compile once per kind of forward (one row or several, with or without a
    padding mask), which the first two layouts show: the later ones compile nothing."""
    from torch._dynamo.utils import counters

    ref, cas = model_pair("llama")
    gen = dict(max_new_tokens=MAX_NEW_STREAM, pad_token_id=0, do_sample=False)
    graphs, shapes = [], set()
    for seed, (levels, own) in enumerate(LAYOUT_STREAM):
        ids, mask = pad_batch(tree_prompts(levels, own, rows=8, seed=60 + seed))
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(min_shared_tokens=2, fixed_buffers=True),
                           compile_config=cpu_compile_config(), **gen)
        assert caches[0].is_compileable
        shapes.add((caches[0].num_levels, caches[0].max_suffix_length))
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), seed
        graphs.append(counters["stats"]["unique_graphs"])
    assert {levels for levels, _ in shapes} == {1, 2, 3} and len({cap for _, cap in shapes}) == 2, shapes
    assert len(set(graphs[1:])) == 1, f"a new layout recompiled: unique graphs after each batch {graphs}"


def test_one_argument_path_reuses_its_buffers_across_calls():
    """hf_cascade.generate takes a call's fixed buffers and prefix KV from the model's StepBuffers and keeps them
    for the next call: a call with the same shapes reads the same addresses, each tensor at the address the same
    tensor had (its CUDA graphs replay, not record again), a call with other shapes gets its own, and every call stays exact."""
    from hf_cascade.step_buffers import step_buffers

    ref, cas = model_pair("llama")
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False)
    # Other tokens, same shapes; then another tree.
    batches = [pad_batch(tree_prompts(levels, own, rows=6, seed=70 + i))
               for i, (levels, own) in enumerate([([(1, 20), (2, 6)], 5), ([(1, 20), (2, 6)], 5), ([(1, 33)], 3)])]
    addresses = []
    for ids, mask in batches:
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(min_shared_tokens=2, fixed_buffers=True),
                           compile_config=cpu_compile_config(), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen))
        # Per role (a recorded CUDA graph reads each tensor at its address): not only the same set of addresses.
        addresses.append([t.data_ptr() for t in caches[0].step_buffer_tensors()])
        kept = step_buffers(cas).nbytes
        assert kept == sum(t.numel() * t.element_size() for t in caches[0].step_buffer_tensors())
    assert addresses[1] == addresses[0], "a call with the first call's shapes did not get its buffers back"
    assert addresses[2] != addresses[1]
    # A one-token call (a prefill, no decode step) leaves the kept set alone.
    kept = step_buffers(cas).nbytes
    ids, mask = batches[0]
    cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                 cascade_options=dict(min_shared_tokens=2, fixed_buffers=True), compile_config=cpu_compile_config(),
                 **dict(gen, max_new_tokens=1))
    assert step_buffers(cas).nbytes == kept


def test_step_buffers_are_never_shared_by_two_holders():
    from hf_cascade.step_buffers import StepBuffers

    pool = StepBuffers()
    a = pool.take((2, 3), torch.float32, "cpu")
    pool.keep([a])
    b = pool.take((2, 3), torch.float32, "cpu")  # the kept one
    c = pool.take((2, 3), torch.float32, "cpu")  # none left: a new one
    assert b is a and c is not a and torch.equal(c, torch.zeros(2, 3))
    pool.keep([c])
    assert pool.take((3, 2), torch.float32, "cpu") is not c and pool.nbytes == c.numel() * 4


def test_batch_sizes_share_one_compiled_step():
    """Greedy batches of 5, 6 and 7 rows run at the bucket of 8 (rows added, finished from the first step, cut from
    the output): one graph for the three sizes; tokens and scores of the real rows equal the reference's."""
    from torch._dynamo.utils import counters

    ref, cas = model_pair("llama")
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=False, output_scores=True,
               return_dict_in_generate=True)
    graphs = []
    for rows in (5, 6, 7):
        ids, mask = pad_batch(tree_prompts([(1, 17), (2, 5)], 4, rows=rows, seed=80 + rows))
        want = ref.generate(ids, attention_mask=mask, **gen)
        eos = int(want.sequences[0, ids.shape[1] + 1])  # a token row 0 makes: rows finish at different steps
        want = ref.generate(ids, attention_mask=mask, eos_token_id=eos, **gen)
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(min_shared_tokens=2, fixed_buffers=True), eos_token_id=eos,
                           compile_config=cpu_compile_config(), **gen)
        assert caches[0].layers[0].keys.shape[0] == 8  # planned and run at the bucket
        assert torch.equal(got.sequences, want.sequences), rows
        assert len(got.scores) == len(want.scores)
        for a, b in zip(got.scores, want.scores):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0], f"a new batch size compiled again: unique graphs {graphs}"


@pytest.mark.parametrize("buckets", [None, True])
def test_batch_buckets_when_sampling(buckets):
    """Sampling adds no rows by default (a seed gives the same samples as the reference); batch_buckets=True adds
    them (the real rows' outputs only are returned)."""
    ref, cas = model_pair("llama")
    ids, mask = pad_batch(tree_prompts([(1, 17)], 4, rows=3, seed=90))
    gen = dict(max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=True, top_k=20)
    torch.manual_seed(1)
    want = ref.generate(ids, attention_mask=mask, **gen)
    caches = []
    torch.manual_seed(1)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                       cascade_options=dict(min_shared_tokens=2, fixed_buffers=True, batch_buckets=buckets),
                       compile_config=cpu_compile_config(), **gen)
    assert got.shape == want.shape
    assert caches[0].layers[0].keys.shape[0] == (4 if buckets else 3)
    if buckets is None:
        assert torch.equal(got, want)


def test_prefix_level_stored_once_for_all_layers():
    """A prefilled level's KV of every layer is one [layers, Hkv, T, D] tensor (what a compiled step takes as one
    input per level); the compiled step's slots are those tensors, not copies. Layers with KV of other shapes are
    packed apart, and fixed buffers then refuse with the fix named."""
    from hf_cascade.prefill import _pack_layers

    _, cas = model_pair("llama")
    prefix = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(37))
    cache = CascadeCache.from_prefix(cas, prefix, max_suffix_length=4 + MAX_NEW)
    level = cache.levels[0]
    base = level.keys[0]._base
    assert base is not None and base.shape == (len(level.keys), *level.keys[0].shape)
    assert all(k._base is base for k in level.keys)
    keys, values = cache._pad_prefix_levels()
    assert keys[-1] is base and values[-1] is level.values[0]._base  # the real level: the stored tensor itself
    assert all(t.shape[1:] == (base.shape[1], 2, base.shape[3]) for t in keys[:-1])  # empty padding slots

    rows = [torch.randn(2, 3, 5, 4), torch.randn(2, 1, 5, 4)]  # KV heads 3 and 1
    packed = _pack_layers(rows, [5, 2])
    assert [p.shape for p in packed] == [(3, 7, 4), (1, 7, 4)] and packed[0]._base is None
    torch.testing.assert_close(packed[1][:, 5:], rows[1][1, :, 3:])
    level.keys[1] = level.keys[1][:1].clone()  # as a model whose layers hold KV of other shapes
    with pytest.raises(NotImplementedError, match="fixed_buffers=False"):
        cache._pad_prefix_levels()
