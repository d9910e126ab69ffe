"""Third sweep of inputs and models that used to give wrong answers without a word (issue 34): each is now exact
against sdpa (fp32, same weights), a clear error naming the cause, or loses nothing.

Tiny random models are built from the real transformers configs (no downloads); the real sizes are in comments.
"""

import copy

import pytest
import torch
import transformers

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.model_zoo import TINY_SIZES, tiny_model
from hf_cascade.transformers_compat import CACHE_KWARG

from test_cache import prefix_batch, random_tokens
from test_generate import make_prompts, model_pair, pad_batch

GEN = dict(max_new_tokens=4, pad_token_id=0, do_sample=False)
ONE_ARGUMENT = dict(custom_generate=hf_cascade.generate, cascade_options=dict(min_shared_tokens=2))
BASE = TINY_SIZES  # model_zoo's tiny sizes, for families outside model_zoo.FAMILIES


def _config(name: str, **overrides):
    """A tiny config of a family outside model_zoo.FAMILIES."""
    if name == "diffllama":
        return transformers.DiffLlamaConfig(**BASE, **overrides)
    mla = dict(BASE, num_key_value_heads=4, kv_lora_rank=16,  # 512 in DeepSeek-V3
               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,  # 64, 128, 128
               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32)
    if name == "deepseek_v2":
        return transformers.DeepseekV2Config(**mla, q_lora_rank=None, n_shared_experts=1, **overrides)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**mla, q_lora_rank=16, n_group=1, topk_group=1, **overrides)
    if name == "llama4":  # attention_chunk_size 8192 in Llama 4 Scout
        return transformers.Llama4TextConfig(**BASE, num_local_experts=2, intermediate_size_mlp=128, **overrides)
    raise ValueError(name)


def _pair(config):
    ref = tiny_model(config=copy.deepcopy(config), attn_implementation="sdpa")
    cas = tiny_model(config=copy.deepcopy(config), attn_implementation="cascade")
    assert ref.config._attn_implementation == "sdpa" and cas.config._attn_implementation == "cascade"
    return ref, cas


def _count_forwards(model):
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    return forwards, handle


# ------------------------------------------------------------------ models that transform K/V after cache.update
@pytest.mark.parametrize("name, cause", [
    ("diffllama", "differential attention"),
    ("deepseek_v2", "multi-head latent attention"),
    ("deepseek_v3", "multi-head latent attention"),
])
def test_models_transforming_kv_after_the_cache_update_are_refused_before_any_work(name, cause):
    """They lost the shared prefix silently (first-step logits off by 0.16-0.30); now refused, naming the model."""
    ref, cas = _pair(_config(name))
    ids, mask = pad_batch(make_prompts(seed=1))
    forwards, handle = _count_forwards(cas)
    try:
        with pytest.raises(NotImplementedError, match=rf"\({type(cas).__name__}\).*{cause}.*'sdpa'"):
            cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT)
        with pytest.raises(NotImplementedError, match=cause):
            CascadeCache.from_prefix(cas, random_tokens(9, 0))
        with pytest.raises(NotImplementedError, match=cause):
            hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2)
    finally:
        handle.remove()
    assert forwards == []
    # Without an hf_cascade cache "cascade" is still exactly sdpa for them.
    assert torch.equal(cas.generate(ids, attention_mask=mask, **GEN), ref.generate(ids, attention_mask=mask, **GEN))


class _TransformingCache:
    """What a model that transforms K/V after the update hands its attention: the cache's keys, recomputed."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, key, value, layer_idx, *args, **kwargs):
        keys, values = self.cache.update(key, value, layer_idx, *args, **kwargs)
        return keys * 1.0, values  # equal values, another tensor: not what the cache returned

    def __getattr__(self, name):
        return getattr(self.cache, name)


def test_any_layer_not_given_the_cached_kv_is_refused_naming_the_model():
    """The general safety net (a model no list knows): the layer's attention was not handed the K/V the cache
    returned, so it would run over the row's own tokens without the prefix. It raises, naming the model."""
    _, cas = model_pair("llama")
    attention = cas.model.layers[1].self_attn
    forward = attention.forward

    def transforming_forward(*args, **kwargs):
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                kwargs[name] = _TransformingCache(kwargs[name])
        return forward(*args, **kwargs)

    attention.forward = transforming_forward
    try:
        prefix = random_tokens(9, 1)
        ids, mask = prefix_batch(prefix, [random_tokens(3, 2), random_tokens(2, 3)])
        with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM: layer 1's attention \(LlamaAttention\) was "
                                                      r"given other keys than the CascadeCache's update\(\) returned"):
            cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT)
    finally:
        del attention.forward
    got = cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT)  # nothing left behind
    assert got.shape == (2, ids.shape[1] + 4)


def test_a_value_not_the_cached_one_is_refused():
    """DiffLlama's pattern (same keys, other values) caught at the first forward by the safety net too."""
    from hf_cascade.attention import bind_layer, bound_provider

    _, cas = model_pair("llama")
    cache = CascadeCache.from_prefix(cas, random_tokens(5, 4))
    module = cache.attention_module(0)
    key, value = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16)
    bind_layer(cache, 0, key, value)
    assert bound_provider(module, key, value) is cache
    bind_layer(cache, 0, key, value)
    with pytest.raises(NotImplementedError, match=r"was given other values than the CascadeCache's update\(\)"):
        bound_provider(module, key, value.repeat(1, 1, 1, 1))
    assert bound_provider(module, key, value) is None  # the binding was consumed


# ------------------------------------------------------------------ Llama 4 chunked attention
@pytest.mark.parametrize("chunk", [64, 8, 5])  # 8192 in Llama 4 Scout; within one chunk, and across several
def test_llama4_chunked_attention_exact_at_any_length(chunk):
    """Chunked attention was refused past the first chunk (issue 33: each query's keys start at its chunk's first
    position, a lower bound per level and suffix); now exact at any length, one argument or a hand-built cache."""
    rows = make_prompts(seed=2)  # 20 to 23 tokens
    ids, mask = pad_batch(rows)
    ref, cas = _pair(_config("llama4", attention_chunk_size=chunk))
    assert "chunked_attention" in cas.config.layer_types
    assert torch.equal(cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT),
                       ref.generate(ids, attention_mask=mask, **GEN))

    prefix = random_tokens(9, 5)
    ids, mask = prefix_batch(prefix, [random_tokens(3, 6), random_tokens(5, 7)])
    cache = CascadeCache.from_prefix(cas, prefix)
    assert torch.equal(cas.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, **GEN),
                       ref.generate(ids, attention_mask=mask, **GEN))


# ------------------------------------------------------------------ user position_ids, hidden states, attentions
@pytest.fixture(scope="module")
def llama():
    return model_pair("llama")


def test_user_position_ids_are_honoured(llama):
    """They were replaced by the mask's count (the tokens of a call without them); now generate()'s own loop runs
    them, with a warning: sdpa's exact tokens. Positions equal to the mask's count still share prefixes."""
    ref, cas = llama
    ids, mask = pad_batch(make_prompts(seed=3))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    positions[:, -3:] += 7  # a gap before each row's last 3 tokens
    want = ref.generate(ids, attention_mask=mask, position_ids=positions, **GEN)
    assert not torch.equal(want, ref.generate(ids, attention_mask=mask, **GEN))  # the positions matter
    with pytest.warns(UserWarning, match=r"`position_ids` other than the attention mask's running count.*own "
                                         r"decoding"):
        got = cas.generate(ids, attention_mask=mask, position_ids=positions, **GEN, **ONE_ARGUMENT)
    assert torch.equal(got, want)

    caches = []
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    got = cas.generate(ids, attention_mask=mask, position_ids=counted, cascade_caches=caches, **GEN, **ONE_ARGUMENT)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, **GEN)) and caches  # shared, exact

    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2)
    with pytest.raises(ValueError, match=r"`position_ids` other than.*with the CascadeCache passed to it"):
        cas.generate(**inputs, position_ids=positions, custom_generate=hf_cascade.generate, **GEN)


@pytest.mark.parametrize("beams", [1, 2])
def test_hidden_states_as_wide_as_sdpa(llama, beams):
    """They covered the last few prompt columns only ([4, 5, 64] where sdpa gives [4, 23, 64])."""
    ref, cas = llama
    ids, mask = pad_batch(make_prompts(seed=1))
    gen = dict(GEN, num_beams=beams, return_dict_in_generate=True, output_hidden_states=True)
    want = ref.generate(ids, attention_mask=mask, **gen)
    with pytest.warns(UserWarning, match=r"`output_hidden_states=True`"):
        got = cas.generate(ids, attention_mask=mask, **gen, **ONE_ARGUMENT)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.hidden_states) == len(want.hidden_states)
    for got_step, want_step in zip(got.hidden_states, want.hidden_states):
        assert [h.shape for h in got_step] == [h.shape for h in want_step]
        for g, w in zip(got_step, want_step):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert want.hidden_states[0][0].shape[1] == ids.shape[1]
    # Without a dict output nothing is returned: the call shares prefixes as usual.
    caches = []
    out = cas.generate(ids, attention_mask=mask, output_hidden_states=True, cascade_caches=caches, num_beams=beams,
                       **GEN, **ONE_ARGUMENT)
    assert caches and torch.equal(out, want.sequences)


def test_output_attentions_refused(llama):
    _, cas = llama
    ids, mask = pad_batch(make_prompts(seed=1))
    with pytest.raises(NotImplementedError, match=r"`output_attentions=True`.*attn_implementation='eager'"):
        cas.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_attentions=True, **GEN,
                     **ONE_ARGUMENT)


# ------------------------------------------------------------------ cascade_options checked by type
@pytest.mark.parametrize("kwargs, match", [
    (dict(cascade_options={"fixed_buffers": "no"}), r"`cascade_options\['fixed_buffers'\]` must be None, True or "
                                                    r"False; got str 'no'"),
    (dict(cascade_options={"defer_stop_check": "false"}), r"`cascade_options\['defer_stop_check'\]` must be None"),
    (dict(cascade_options={"batch_buckets": 0}), r"`cascade_options\['batch_buckets'\]` must be None, True or False"),
    (dict(cascade_options={"compile_prefill": "yes"}), r"`cascade_options\['compile_prefill'\]`"),
    (dict(cascade_options={"min_shared_tokens": "2"}), r"`cascade_options\['min_shared_tokens'\]` must be an int; "
                                                       r"got str '2'"),
    (dict(cascade_options={"max_levels": 2.0}), r"`cascade_options\['max_levels'\]` must be an int"),
    (dict(cascade_options={"cost_model": "on"}), r"`cascade_options\['cost_model'\]` must be 'auto', None"),
    (dict(cascade_options={"decode_step": ["eager"]}), r"`cascade_options\['decode_step'\]` must be one of"),
    (dict(cascade_options=["min_shared_tokens", 2]), r"`cascade_options` must be a dict.*got list"),
    (dict(cascade_options="fixed_buffers=False"), r"`cascade_options` must be a dict.*got str"),
    (dict(cascade_caches=()), r"`cascade_caches` must be None or a list.*got tuple"),
])
def test_cascade_options_checked_by_type_before_any_work(llama, kwargs, match):
    """They were taken as truthy ("no" as True), or failed late (cascade_caches=() after the whole prefill)."""
    _, cas = llama
    ids, mask = pad_batch(make_prompts(seed=1))
    forwards, handle = _count_forwards(cas)
    try:
        with pytest.raises(ValueError, match=match):
            cas.generate(ids, attention_mask=mask, **GEN, custom_generate=hf_cascade.generate, **kwargs)
    finally:
        handle.remove()
    assert forwards == []


# ------------------------------------------------------------------ streamer, stop_strings, checkpoints
class _Recorder:
    """A streamer that records what it gets (BaseStreamer's interface)."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def _chat(seed=4):
    from hf_cascade.tiny import tiny_model as byte_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    prompts = ["You are terse. Answer in a word.\nQ: " + q + "\nA:" for q in ("red?", "a cat?", "tea?")]
    return tokenizer, byte_model("llama", seed=seed), byte_model("llama", seed=seed, attn_implementation="sdpa"), \
        prompts


def test_streamer_with_the_hook_streams_every_token_and_ends():
    """The hook never received the streamer: generate() put the prompt, nothing more, and never called end() (a
    TextIteratorStreamer consumer waited forever). Now it streams every token and ends, with sharing kept."""
    import threading

    from transformers import TextIteratorStreamer

    tokenizer, cas, ref, prompts = _chat()
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = tokenizer(prompts[:1], return_tensors="pt")
    want = ref.generate(**batch, **gen)
    recorder, caches = _Recorder(), []
    got = cas.generate(**batch, **gen, streamer=recorder, custom_generate=hf_cascade.generate,
                       cascade_caches=caches)
    assert torch.equal(got, want)
    assert recorder.ended and recorder.chunks == [want[0, :batch["input_ids"].shape[1]].tolist()] + \
        [[t] for t in want[0, batch["input_ids"].shape[1]:].tolist()]

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    thread = threading.Thread(target=cas.generate, kwargs=dict(**batch, **gen, streamer=streamer,
                                                               custom_generate=hf_cascade.generate))
    thread.start()
    text = "".join(streamer)  # raises queue.Empty after 60 s instead of waiting forever
    thread.join(timeout=60)
    assert text == tokenizer.decode(want[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="`streamer` cannot be used with beam search"):
        cas.generate(**batch, **dict(gen, num_beams=2), streamer=_Recorder(), custom_generate=hf_cascade.generate)


def test_assistant_model_with_the_hook_is_refused():
    tokenizer, cas, ref, prompts = _chat()
    batch = tokenizer(prompts[:1], return_tensors="pt")
    with pytest.raises(NotImplementedError, match="assisted generation"):
        cas.generate(**batch, max_new_tokens=3, do_sample=False, assistant_model=ref,
                     custom_generate=hf_cascade.generate)


def test_stop_strings_with_the_hook_raise_and_the_criteria_form_shares():
    """transformers' hook drops the tokenizer, and generate() then raises before hf_cascade runs (never silently
    ignored); a StopStringCriteria passed as a stopping criterion reaches hf_cascade and is exact."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    tokenizer, cas, ref, prompts = _chat()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    stop = [tokenizer.decode(ref.generate(**batch, **gen)[0, batch["input_ids"].shape[1] + 2:][:1])]
    want = ref.generate(**batch, **gen, stop_strings=stop, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        cas.generate(**batch, **gen, stop_strings=stop, tokenizer=tokenizer, custom_generate=hf_cascade.generate)
    caches = []
    got = cas.generate(**batch, **gen, stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stop)]),
                       custom_generate=hf_cascade.generate, cascade_caches=caches)
    assert torch.equal(got, want) and caches


def test_checkpoint_streams_falls_back_for_stop_strings_and_never_overwrites(tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer, _, ref, prompts = _chat()
    ref.save_pretrained(tmp_path)
    folder = tmp_path / "custom_generate"
    folder.mkdir()
    (folder / "generate.py").write_text("def generate(*args, model, **kwargs):\n    return 'mine'\n")
    with pytest.raises(ValueError, match=rf"{folder / 'generate.py'} exists and was not written by hf_cascade"):
        hf_cascade.write_custom_generate(str(tmp_path))
    assert (folder / "generate.py").read_text().endswith("return 'mine'\n")
    assert not (folder / "requirements.txt").exists()  # nothing written
    (folder / "generate.py").unlink()
    (folder / "requirements.txt").write_text("numpy\n")
    with pytest.raises(ValueError, match=r"requirements.txt exists and was not written by hf_cascade"):
        hf_cascade.write_custom_generate(str(tmp_path))
    assert (folder / "requirements.txt").read_text() == "numpy\n" and not (folder / "generate.py").exists()
    (folder / "requirements.txt").write_text("hf-cascade\n")  # what earlier versions wrote: rewritten
    path = hf_cascade.write_custom_generate(str(tmp_path))
    assert hf_cascade.write_custom_generate(str(tmp_path)) == path  # its own files: rewritten

    model = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = tokenizer(prompts[:1], return_tensors="pt")
    recorder = _Recorder()
    got = model.generate(**batch, **gen, streamer=recorder)
    assert recorder.ended and len(recorder.chunks) == 1 + 5
    assert torch.equal(got, ref.generate(**batch, **gen))

    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    stop = [tokenizer.decode(ref.generate(**batch, **gen)[0, -2:-1])]
    want = ref.generate(**batch, **gen, stop_strings=stop, tokenizer=tokenizer)
    with pytest.warns(UserWarning, match=r"cannot receive stop_strings, tokenizer; .*own generate\(\)"):
        got = model.generate(**batch, **gen, stop_strings=stop, tokenizer=tokenizer)
    assert torch.equal(got, want)


# ------------------------------------------------------------------ models refused with a clear error
@pytest.mark.parametrize("name, config", [
    ("Falcon", lambda: transformers.FalconConfig(**{k: BASE[k] for k in ("vocab_size", "hidden_size",
                                                                        "num_hidden_layers", "num_attention_heads")})),
    ("GPT-Neo", lambda: transformers.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                                  attention_types=[[["global", "local"], 1]])),
])
def test_models_with_their_own_attention_table_refuse_cascade_at_load(name, config):
    """Loading one with "cascade" failed with a bare KeyError: 'cascade'."""
    with pytest.raises(NotImplementedError, match=rf"{name} does not route attention through transformers' "
                                                  r"AttentionInterface.*attn_implementation='sdpa'"):
        tiny_model(config=config(), attn_implementation="cascade")
    tiny_model(config=config(), attn_implementation="eager")  # other implementations untouched


def test_hybrid_lfm2_refused_before_any_work():
    """LFM2 failed inside its conv layer ("Cannot get conv state ... _SuffixLayer")."""
    config = transformers.Lfm2Config(**{k: v for k, v in BASE.items() if k != "max_position_embeddings"},
                                     layer_types=["conv", "full_attention"])
    ref, cas = _pair(config)
    ids, mask = pad_batch(make_prompts(seed=1))
    forwards, handle = _count_forwards(cas)
    try:
        with pytest.raises(NotImplementedError, match=r"\(Lfm2ForCausalLM\) is a hybrid model: its 'conv' layers"):
            cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT)
        with pytest.raises(NotImplementedError, match="hybrid model"):
            CascadeCache.from_prefix(cas, random_tokens(9, 0))
    finally:
        handle.remove()
    assert forwards == []
    assert torch.equal(cas.generate(ids, attention_mask=mask, **GEN), ref.generate(ids, attention_mask=mask, **GEN))


def test_checkpoint_loads_where_hf_cascade_is_importable_but_not_pip_installed(tmp_path, monkeypatch):
    """requirements.txt named hf-cascade, which transformers checks against installed distributions: "Missing
    requirements hf-cascade" although generate.py could import it. It names no requirement now."""
    import importlib.metadata

    from transformers import AutoModelForCausalLM

    tokenizer, _, ref, prompts = _chat()
    ref.save_pretrained(tmp_path)
    hf_cascade.write_custom_generate(str(tmp_path))
    version = importlib.metadata.version

    def not_installed(name):
        if name.replace("_", "-").lower() == "hf-cascade":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    got = model.generate(**batch, **gen)
    assert isinstance(getattr(got, CACHE_KWARG), CascadeCache)
    assert torch.equal(got.sequences, ref.generate(**batch, **gen).sequences)
