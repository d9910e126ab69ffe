"""The seventh sweep (models outside the tested families): each silent wrong answer now the reference's or a clear
error (fp32, CPU, tiny random models built from transformers' config classes, no downloads):

* Gemma / Gemma 3 with ``use_bidirectional_attention=True`` and PaliGemma (bidirectional by default; positions
  counted from 1): ``custom_generate`` gave other tokens; now generate()'s own decoding with a warning, and a
  CascadeCache that shares a prefix is a NotImplementedError, as is context parallelism (its ring prefill attends
  causally: logits 4.1 off); score() scores each pair alone (a padded batch's mask made the attention causal);
* images (or other media) in a multimodal model's call: transformers' "Image features and image tokens do not match"
  (the shared part was prefilled from token ids alone); now generate()'s own decoding with a warning;
* MPT / Bloom / XGLM loaded with "cascade" (transformers refuses "sdpa" for them): their own attention added the
  boolean mask as a float one on the plain path; now a NotImplementedError at the first mask;
* Mllama's cross-attention layers: an AttributeError deep in the prefill; now a NotImplementedError naming them;
* a model the user compiled (``model.compile()``, a compiled layer or ``forward``): other tokens and log-probs (every
  forward took the cache's compiled-step branch); now a ValueError before any work. A float64 model: an error from
  inside an op; now a ValueError naming the dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

import hf_cascade

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
IMAGE = 120
GEN = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def _pair(config, model_class, reference="sdpa"):
    torch.manual_seed(0)
    ref = model_class._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
    cas = model_class._from_config(copy.deepcopy(config), attn_implementation="cascade").eval()
    cas.load_state_dict(ref.state_dict())
    return ref, cas


def _batch(lead=()):
    g = torch.Generator().manual_seed(1)
    shared = [1, *lead] + torch.randint(5, 118, (20,), generator=g).tolist()
    rows = [shared + torch.randint(5, 118, (n,), generator=g).tolist() for n in (3, 6, 9)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    return ids, (ids != 0).long() * (torch.arange(width) >= width - torch.tensor([len(r) for r in rows])[:, None])


def _same_as_reference(ref, cas, **inputs):
    want = ref.generate(**inputs, **GEN)
    with pytest.warns(UserWarning, match="cannot be served with shared prefixes"):
        got = cas.generate(**inputs, **GEN, custom_generate=hf_cascade.generate)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("config_class,model_class", [
    (T.GemmaConfig, T.GemmaForCausalLM), (T.Gemma3TextConfig, T.Gemma3ForCausalLM)])
def test_bidirectional_attention_runs_generate_own_decoding(config_class, model_class):
    ref, cas = _pair(config_class(**TINY, head_dim=16, use_bidirectional_attention=True), model_class)
    ids, mask = _batch()
    _same_as_reference(ref, cas, input_ids=ids, attention_mask=mask)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None)


def test_paligemma_runs_generate_own_decoding():
    text = T.GemmaConfig(**TINY, head_dim=16, use_bidirectional_attention=False)
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=16, patch_size=4, projection_dim=64)
    config = T.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, vocab_size=128,
                               projection_dim=64, hidden_size=64, tie_word_embeddings=False)
    ref, cas = _pair(config, T.PaliGemmaForConditionalGeneration)
    ids, mask = _batch()
    _same_as_reference(ref, cas, input_ids=ids, attention_mask=mask)


def test_an_image_in_the_shared_prompt_runs_generate_own_decoding():
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=16, patch_size=4)
    config = T.Gemma3Config(text_config=T.Gemma3TextConfig(**TINY, head_dim=16), mm_tokens_per_image=4,
                            boi_token_index=118, eoi_token_index=119, image_token_index=IMAGE, vision_config=vision)
    ref, cas = _pair(config, T.Gemma3ForConditionalGeneration)
    ids, mask = _batch(lead=[118] + [IMAGE] * 4 + [119])
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)).repeat(3, 1, 1, 1)
    _same_as_reference(ref, cas, input_ids=ids, attention_mask=mask, pixel_values=pixels,
                       token_type_ids=(ids == IMAGE).long())


@pytest.mark.parametrize("family,sizes", [
    ("mpt", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512)),
    ("bloom", dict(hidden_size=64, n_head=4, n_layer=2)),
    ("xglm", dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=2)),
])
def test_models_with_their_own_attention_refuse_the_cascade_mask(family, sizes):
    config = T.AutoConfig.for_model(family, vocab_size=128, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0, **sizes)
    _, cas = _pair(config, T.AutoModelForCausalLM._model_mapping[type(config)], reference="eager")
    ids, mask = _batch()
    with pytest.raises(NotImplementedError, match="AttentionInterface"):
        cas.generate(input_ids=ids, attention_mask=mask, **GEN)


def test_cross_attention_layers_are_refused():
    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=64,
                  vision_output_dim=64, image_size=16, patch_size=4, max_num_tiles=1,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1]])
    config = T.MllamaConfig(text_config=dict(TINY, num_hidden_layers=3, cross_attention_layers=[1]),
                            image_token_index=IMAGE, vision_config=vision)
    _, cas = _pair(config, T.MllamaForConditionalGeneration)
    ids, mask = _batch()
    with pytest.raises(NotImplementedError, match="cross-attention layers"):
        cas.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=hf_cascade.generate)


@pytest.mark.parametrize("compiled", ["model", "layer", "forward"])
def test_a_model_the_user_compiled_is_refused_before_any_work(compiled):
    """A user's ``model.compile()`` (or a compiled layer / forward) ran the cache's compiled-step branch in every
    forward: rows of different lengths saw other rows' columns (other tokens, log-probs 0.3 nats off)."""
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", "cascade", seed=0)
    if compiled == "model":
        model.compile(backend="eager")
    elif compiled == "layer":
        model.model.layers[0].compile(backend="eager")
    else:
        model.forward = torch.compile(model.forward, backend="eager")
    ids, mask = _batch()
    with pytest.raises(ValueError, match="compiled by torch.compile"):
        model.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=hf_cascade.generate)
    with pytest.raises(ValueError, match="compiled by torch.compile"):
        hf_cascade.score(model, [[5, 6, 7]], [[8, 9]])
    with pytest.raises(ValueError, match="compiled by torch.compile"):
        hf_cascade.shared_prefix_inputs(model, ids, mask)


def test_float64_is_a_clear_error():
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", "cascade", seed=0).to(torch.float64)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="float64"):
        model.generate(input_ids=ids, attention_mask=mask, **GEN, custom_generate=hf_cascade.generate)


def test_score_on_bidirectional_attention_scores_each_pair_alone():
    """Pairs scored in one padded forward got a materialised causal mask: Gemma's bidirectional attention became causal
    (0.43 nats off, depending on the other pairs in the call); a shared context raised an error about generate()."""
    from hf_cascade.model_zoo import reference_attention, tiny_model

    for family in ("gemma", "gemma3"):
        ref, cas = (tiny_model(family, impl, seed=0, use_bidirectional_attention=True)
                    for impl in (reference_attention(family), "cascade"))
        contexts, continuations = [[5, 6, 7, 8, 9], [30, 31], [5, 6, 7, 8, 9]], [[10, 11, 12], [40, 41, 42, 43], [13]]
        got = hf_cascade.score(cas, contexts, continuations, progress=False).logprobs
        with torch.no_grad():  # (lm-eval's forward: the pair but its last token)
            for row, (context, continuation) in enumerate(zip(contexts, continuations)):
                logits = ref(torch.tensor([context + continuation[:-1]])).logits[0].double().log_softmax(-1)
                want = sum(float(logits[len(context) - 1 + j, t]) for j, t in enumerate(continuation))
                assert abs(float(got[row]) - want) < 1e-4, (family, row)


def test_generate_dataset_on_bidirectional_attention_runs_each_batch_as_generate():
    """Several batches: the preamble carried between them was a CascadeCache, refused on such a model."""
    datasets = pytest.importorskip("datasets")
    from hf_cascade.model_zoo import tiny_model
    from hf_cascade.tiny import tiny_tokenizer

    model, tok = tiny_model("gemma", "cascade", seed=0, use_bidirectional_attention=True), tiny_tokenizer()
    ref = tiny_model("gemma", "sdpa", seed=0, use_bidirectional_attention=True)
    preamble = list(range(3, 23))
    prompts = [preamble + own for own in ([40], [41, 42], [43, 44, 45], [46])]
    data = datasets.Dataset.from_dict({"prompt": prompts})
    with pytest.warns(UserWarning, match="cannot be served with shared prefixes"):
        out = hf_cascade.generate_dataset(model, tok, data, max_batch_size=2, progress=False,
                                          generation_kwargs=dict(max_new_tokens=4, do_sample=False))
    for prompt, text in zip(prompts, out["completion"]):
        ids = torch.tensor([prompt])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                            pad_token_id=tok.pad_token_id)
        assert text == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_compile_wrapper_is_refused_with_the_model_to_pass():
    from hf_cascade.model_zoo import tiny_model

    wrapper = torch.compile(tiny_model("llama", "cascade", seed=0), backend="eager")
    with pytest.raises(ValueError, match="_orig_mod"):
        hf_cascade.score(wrapper, [[5, 6, 7]], [[8, 9]])


def test_the_demo_compares_gpt_oss_with_eager():
    from hf_cascade.model_zoo import tiny_model
    from hf_cascade.tiny import reference_attn_implementation

    if "gpt_oss" not in hf_cascade.model_zoo.available_families():
        pytest.skip("no gpt_oss config in this transformers")
    model = tiny_model("gpt_oss", "cascade", seed=0)
    assert reference_attn_implementation(model) == reference_attn_implementation(model.config) == "eager"
    assert reference_attn_implementation(tiny_model("llama", "cascade", seed=0)) == "sdpa"


def test_context_parallelism_refuses_bidirectional_attention():
    """The ring prefill attends causally: logits 4.1 off on a bidirectional Gemma (gloo, 2 ranks), silently."""
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("gemma", "cascade", seed=0, use_bidirectional_attention=True)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[5, 6, 7, 8, 9]]))
