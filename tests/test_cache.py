"""CascadeCache.from_prefix + generate(past_key_values=cache): exactness, reuse, memory, and bad input."""

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.model_zoo import tiny_model
from hf_cascade.transformers_compat import CACHE_KWARG

from test_generate import assert_logits_close, model_pair, pad_batch

P = 13
GEN = dict(max_new_tokens=5, pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_logits=True)


def prefix_batch(prefix, suffixes):
    """Rows laid out [prefix | pads | suffix], as the prompt-reuse convention expects."""
    width = max(len(s) for s in suffixes)
    ids = torch.zeros((len(suffixes), len(prefix) + width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, : len(prefix)] = torch.tensor(prefix)
    mask[:, : len(prefix)] = 1
    for i, s in enumerate(suffixes):
        ids[i, ids.shape[1] - len(s) :] = torch.tensor(s)
        mask[i, ids.shape[1] - len(s) :] = 1
    return ids, mask


def random_tokens(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_from_prefix_generate_matches_reference_and_serves_several_batches(family):
    ref, cas = model_pair(family)
    prefix = random_tokens(P, 0)
    cache = CascadeCache.from_prefix(cas, torch.tensor(prefix))
    prefix_bytes = cache.nbytes
    for batch_seed, lengths in ((1, (3, 6, 1)), (2, (4, 2))):  # two batches, one cache, one prefill
        suffixes = [random_tokens(n, batch_seed * 10 + i) for i, n in enumerate(lengths)]
        ids, mask = prefix_batch(prefix, suffixes)
        got = cas.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
        ref_ids, ref_mask = pad_batch([prefix + s for s in suffixes])
        want = ref.generate(ref_ids, attention_mask=ref_mask, **GEN)
        assert torch.equal(got.sequences[:, ids.shape[1] :], want.sequences[:, ref_ids.shape[1] :])
        assert_logits_close(want, got)
        # Memory: the prefix once + every row's suffix (the last token's KV is never written).
        kv_heads, head_dim, layers = 2, cas.config.head_dim, cas.config.num_hidden_layers
        per_token = 2 * layers * kv_heads * head_dim * 4  # K and V, fp32
        suffix_tokens = len(lengths) * (ids.shape[1] - P + GEN["max_new_tokens"] - 1)
        assert prefix_bytes == P * per_token
        assert cache.nbytes == prefix_bytes + suffix_tokens * per_token


def test_memory_prefix_stored_once_vs_dynamic_cache():
    _, cas = model_pair("llama")
    prefix, rows = random_tokens(64, 3), 8
    cache = CascadeCache.from_prefix(cas, [prefix])
    ids, mask = prefix_batch(prefix, [random_tokens(4, 40 + i) for i in range(rows)])
    cas.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    dynamic = DynamicCache(config=cas.config)
    cas.generate(ids, attention_mask=mask, past_key_values=dynamic, max_new_tokens=2, pad_token_id=0)
    dynamic_bytes = sum(t.numel() * t.element_size() for layer in dynamic.layers for t in (layer.keys, layer.values))
    # 8 rows x (64 + 5) tokens replicated vs 64 once + 8 x 5.
    assert cache.nbytes * 4 < dynamic_bytes
    assert cache.nbytes == dynamic_bytes * (64 + 8 * 5) // (8 * (64 + 5))


def test_shared_prefix_inputs_on_top_of_prefix_cache():
    ref, cas = model_pair("llama")
    system = random_tokens(P, 5)
    blocks = [random_tokens(6, 6), random_tokens(6, 7)]
    rows = [system + blocks[i // 2] + random_tokens(2 + i, 8 + i) for i in range(4)]
    cache = CascadeCache.from_prefix(cas, system)
    inputs = hf_cascade.shared_prefix_inputs(cas, *pad_batch(rows), prefix_cache=cache, min_shared_tokens=2)
    new_cache = inputs[CACHE_KWARG]
    assert new_cache.levels[0] is cache.levels[0]  # the system prompt is reused, not prefilled again
    assert new_cache.num_levels == 2
    got = cas.generate(**inputs, **GEN)
    ref_ids, ref_mask = pad_batch(rows)
    want = ref.generate(ref_ids, attention_mask=ref_mask, **GEN)
    assert torch.equal(got.sequences[:, inputs["input_ids"].shape[1] :], want.sequences[:, ref_ids.shape[1] :])
    assert_logits_close(want, got)


def test_cache_reorder_select_and_crop():
    _, cas = model_pair("llama")
    rows = [random_tokens(8, 1) + random_tokens(3 + i, 20 + i) for i in range(3)]
    inputs = hf_cascade.shared_prefix_inputs(cas, *pad_batch(rows), min_shared_tokens=2)
    cache = inputs[CACHE_KWARG]
    cas.generate(**inputs, max_new_tokens=1, pad_token_id=0)  # prefill of the suffixes only
    length = cache.get_seq_length()
    assert length == inputs["input_ids"].shape[1]
    assert cache.get_mask_sizes(1, 0) == (length - cache.prefix_length + 1, cache.prefix_length)
    cache.crop(-2)
    assert cache.get_seq_length() == length - 2
    with pytest.raises(ValueError, match="immutable"):
        cache.crop(-(length))
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert cache.layers[0].keys.shape[0] == 2 and cache.row_nodes.shape[1] == 2
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.layers[1].keys.shape[0] == 2


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def cascade_model():
    return tiny_model("llama", "cascade")


def test_register_twice_is_harmless():
    hf_cascade.register()
    hf_cascade.register()
    assert AttentionInterface()["cascade"] is hf_cascade.attention.cascade_attention_forward


def test_model_not_loaded_with_cascade():
    sdpa = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match="attn_implementation='cascade'"):
        CascadeCache.from_prefix(sdpa, [3, 4, 5])
    with pytest.raises(ValueError, match="attn_implementation='cascade'"):
        hf_cascade.shared_prefix_inputs(sdpa, torch.tensor([[3, 4, 5]]))


@pytest.mark.parametrize("name", ["bloom", "falcon"])
def test_model_without_attention_interface(name):
    # Families whose attention does not go through AttentionInterface (GPT-J did until transformers 5.24).
    from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig

    if name == "bloom":
        cfg = BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)
    else:
        cfg = FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with pytest.raises(NotImplementedError, match="does not route attention through transformers' AttentionInterface"):
        CascadeCache.from_prefix(model, [3, 4])


def test_encoder_decoder_rejected():
    from transformers import AutoModelForSeq2SeqLM, T5Config

    cfg = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64, d_kv=16)
    model = AutoModelForSeq2SeqLM.from_config(cfg)
    with pytest.raises((ValueError, NotImplementedError), match="encoder-decoder|cascade"):
        hf_cascade.shared_prefix_inputs(model, torch.tensor([[3, 4, 5]]))


def test_kv_sharing_model_rejected(cascade_model):
    model = copy.deepcopy(cascade_model)
    model.config.num_kv_shared_layers = 1
    with pytest.raises(NotImplementedError, match="shares KV"):
        CascadeCache.from_prefix(model, [3, 4, 5])


@pytest.mark.parametrize(
    "prefix, match",
    [
        ([], "non-empty"),
        ([[3, 4], [5, 6]], r"\[P\] or \[1, P\]"),
        (torch.tensor([3.0, 4.0]), "int64"),
        ([3, 400], "vocabulary"),
    ],
)
def test_from_prefix_bad_prefix(cascade_model, prefix, match):
    with pytest.raises(ValueError, match=match):
        CascadeCache.from_prefix(cascade_model, prefix)


def test_wrong_device_ids(cascade_model):
    ids = torch.tensor([[3, 4, 5]], device="meta")
    with pytest.raises(ValueError, match="model.device"):
        hf_cascade.shared_prefix_inputs(cascade_model, ids)


def test_mismatched_mask(cascade_model):
    ids = torch.tensor([[3, 4, 5], [3, 4, 6]])
    with pytest.raises(ValueError, match="attention_mask"):
        hf_cascade.shared_prefix_inputs(cascade_model, ids, torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="Row 1 of `attention_mask` is all zeros"):
        hf_cascade.shared_prefix_inputs(cascade_model, ids, torch.tensor([[1, 0, 1], [0, 0, 0]]))


def test_prefix_cache_rows_must_start_with_prefix(cascade_model):
    cache = CascadeCache.from_prefix(cascade_model, [3, 4, 5, 6])
    rows = torch.tensor([[3, 4, 5, 6, 9], [3, 4, 7, 6, 9]])
    with pytest.raises(ValueError, match="Row 1's real tokens do not start with the 4-token prefix"):
        hf_cascade.shared_prefix_inputs(cascade_model, rows, prefix_cache=cache)
    # A prompt no longer than the prefix leaves nothing to generate from.
    with pytest.raises(ValueError, match="at least one more token"):
        hf_cascade.shared_prefix_inputs(cascade_model, torch.tensor([[3, 4, 5, 6]]), prefix_cache=cache)


def test_reusing_cache_with_another_model(cascade_model):
    other = tiny_model("llama", "cascade", seed=1)
    cache = CascadeCache.from_prefix(cascade_model, [3, 4, 5, 6])
    ids, mask = prefix_batch([3, 4, 5, 6], [[7, 8]])
    with pytest.raises(ValueError, match="different model"):
        other.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert cache.layers[0].get_seq_length() == 0  # nothing half-updated: the prefix is intact, no stray suffix
    out = cascade_model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 2)


def test_batch_not_matching_the_planned_rows(cascade_model):
    rows = torch.tensor([[3, 4, 5, 6, 9], [3, 4, 5, 6, 8]])
    inputs = hf_cascade.shared_prefix_inputs(cascade_model, rows, min_shared_tokens=2)
    ids = torch.cat([inputs["input_ids"]] * 1 + [inputs["input_ids"][:1]])
    mask = torch.cat([inputs["attention_mask"]] * 1 + [inputs["attention_mask"][:1]])
    with pytest.raises(ValueError, match="planned for 2 rows"):
        cascade_model.generate(ids, attention_mask=mask, past_key_values=inputs[CACHE_KWARG], max_new_tokens=2)


def test_sliding_window_exceeded_is_exact():
    """Was a NotImplementedError (issue 33): keys that slid out of a query's window are now skipped exactly."""
    model = tiny_model("mistral", "cascade", sliding_window=8)
    ref = tiny_model("mistral", "sdpa", sliding_window=8)
    cache = CascadeCache.from_prefix(model, random_tokens(6, 1))
    ids, mask = prefix_batch(random_tokens(6, 1), [random_tokens(5, 2)])
    gen = dict(max_new_tokens=4, pad_token_id=0, do_sample=False)
    assert torch.equal(model.generate(ids, attention_mask=mask, past_key_values=cache, **gen),
                       ref.generate(ids, attention_mask=mask, **gen))


def test_model_scan_is_kept_per_model_and_redone_after_a_module_is_replaced():
    from hf_cascade.model_scan import attention_modules, non_embedding_parameters

    model, other = tiny_model("llama", "cascade", seed=0), tiny_model("llama", "cascade", seed=1)
    ids, mask = prefix_batch([3, 4, 5, 6], [[7, 8]])
    kept = attention_modules(model)
    cache = CascadeCache.from_prefix(model, [3, 4, 5, 6])
    # Kept across caches and forwards (Llama's forward builds a new ModuleList, self.layers[:n], every call).
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert attention_modules(model) is kept and cache._modules is kept
    assert attention_modules(other) is not kept
    with pytest.raises(ValueError, match="`prefix_cache` was built with a different model"):
        hf_cascade.shared_prefix_inputs(other, ids, mask, prefix_cache=cache)

    # A replaced attention module: found by the next scan; the cache built before still serves only the modules
    # it was built with.
    layer = model.model.layers[1]
    replaced, count = layer.self_attn, non_embedding_parameters(model)
    layer.self_attn = copy.deepcopy(replaced)
    fresh = attention_modules(model)
    assert fresh is not kept and layer.self_attn in fresh[1] and replaced not in fresh[1]
    with pytest.raises(ValueError, match="different model"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    new_cache = CascadeCache.from_prefix(model, [3, 4, 5, 6])
    out = model.generate(ids, attention_mask=mask, past_key_values=new_cache, max_new_tokens=2, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 2)
    # The kept parameter count follows a replaced module too (a registered parameter).
    assert non_embedding_parameters(model) == count
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    assert non_embedding_parameters(model) == model.num_parameters(exclude_embeddings=True) != count


