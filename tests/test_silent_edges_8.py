"""The ninth sweep (training and loss forwards, planned inputs, datasets), fp32, CPU:

* Gemma 2 (soft-capping) and GPT-OSS (attention sinks) could not run a forward that needs gradients
  (``div(): functions with out=... arguments don't support automatic differentiation``: the exact path is
  inference-only) nor attention dropout in training; they now run transformers' eager attention there: the same
  loss and gradients as ``eager``;
* Gemma 2's queries that see no key (a left-padded batch's pads) got 0 where eager gives the mean of the values: the
  logits at pads differed by up to 2.7, and a loss over a left-padded batch (its first real token is predicted from
  the last pad) by 1.5e-3.
"""

from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade.tiny import tiny_model, tiny_tokenizer

TEXTS = ["hello world, this is a longer prompt", "short", "a middle one here"]


def _batch(side: str):
    tok = tiny_tokenizer()
    tok.padding_side = side
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    return batch, batch.input_ids.masked_fill(batch.attention_mask == 0, -100)


def _pair(family: str, **config):
    torch.manual_seed(0)
    ref = tiny_model(family, attn_implementation="eager", **config)
    cas = tiny_model(family, **config)
    cas.load_state_dict(ref.state_dict())
    return ref, cas


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_training_forward_and_gradients_as_eager(family, side):
    batch, labels = _batch(side)
    ref, cas = _pair(family)
    losses, grads = [], []
    for model in (ref, cas):
        model.train()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.timeout(120)
def test_attention_dropout_in_training_as_eager():
    batch, labels = _batch("left")
    ref, cas = _pair("gemma2", attention_dropout=0.3)
    losses = []
    for model in (ref, cas):
        model.train()
        torch.manual_seed(7)
        losses.append(model(**batch, labels=labels).loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_left_padded_loss_and_pad_logits_as_eager(family):
    batch, labels = _batch("left")
    ref, cas = _pair(family)
    with torch.no_grad():
        expected, got = ref(**batch, labels=labels), cas(**batch, labels=labels)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-4)


SYSTEM = "You are a helpful assistant. Answer briefly and precisely. "


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
                                    dict(sequence_bias={(5, 6): -2.0})])
def test_suffix_rows_refuse_processors_that_read_the_prompt(option):
    """shared_prefix_inputs(layout="suffix") hands generate() only the suffix columns: a processor that reads the
    prompt gave other tokens (repetition_penalty: the third new token, scores 0.8 off), silently; now a ValueError
    on hf_cascade.generate's path. Without such processors the suffix rows still give sdpa's tokens."""
    tok = tiny_tokenizer()
    batch = tok([SYSTEM + q for q in ["q1", "a longer question two", "q3 mid?"]], return_tensors="pt", padding=True)
    model = tiny_model("llama")
    inputs = hf_cascade.shared_prefix_inputs(model, batch.input_ids, batch.attention_mask, layout="suffix")
    assert inputs["input_ids"].shape[1] < batch.input_ids.shape[1]
    with pytest.raises(ValueError, match="layout='full'"):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, custom_generate=hf_cascade.generate, **option)
    ref = tiny_model("llama", attn_implementation="sdpa")
    want = ref.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch.input_ids.shape[1]:]
    inputs = hf_cascade.shared_prefix_inputs(model, batch.input_ids, batch.attention_mask, layout="suffix")
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False, custom_generate=hf_cascade.generate)
    assert torch.equal(got[:, inputs["input_ids"].shape[1]:], want)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gemma2_training_and_left_padded_loss_as_eager(dtype):
    """On CUDA (the Triton suffix kernel for the no-gradient forward): Gemma 2's loss and gradients with gradients
    on, and its loss and logits at pads without, as eager's (fp32: 1e-5; bf16: within bf16 rounding)."""
    batch, labels = _batch("left")
    batch, labels = batch.to("cuda"), labels.cuda()
    ref = tiny_model("gemma2", attn_implementation="eager", device="cuda", dtype=dtype)
    cas = tiny_model("gemma2", device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        want, got = ref(**batch, labels=labels), cas(**batch, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=tol, atol=tol)
    torch.testing.assert_close(got.logits.float(), want.logits.float(), rtol=tol, atol=10 * tol)
    for model in (ref, cas):
        model.train()
        model(**batch, labels=labels).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), cas.parameters()):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), rtol=10 * tol, atol=tol, msg=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_generate_dataset_rows_ended_by_a_stop_string_carry_no_padding(pad_is_eos):
    """generate_dataset(..., stop_strings=..., skip_special_tokens=False): a row a stop string ended came back with
    the batch's padding after it (or, where pad is EOS, an EOS the model never generated); now each text is a
    per-row generate()'s."""
    datasets = pytest.importorskip("datasets")
    from transformers import StoppingCriteriaList, StopStringCriteria

    model, ref, tok = tiny_model("llama"), tiny_model("llama", attn_implementation="sdpa"), tiny_tokenizer()
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    prompts = ["PREAMBLE: you are a helpful calculator.\nQ: 1+2", "PREAMBLE: you are a helpful calculator.\nQ: 3+4",
               "hi"]
    gen = dict(max_new_tokens=10, do_sample=False, stop_strings=["%"], pad_token_id=tok.pad_token_id)
    out = hf_cascade.generate_dataset(model, tok, datasets.Dataset.from_dict({"prompt": prompts}),
                                      generation_kwargs=gen, progress=False, skip_special_tokens=False)
    stopped = 0
    for prompt, got in zip(prompts, out["completion"]):
        batch = tok([prompt], return_tensors="pt")
        row = ref.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                           stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, ["%"])]))
        want = tok.decode(row[0, batch.input_ids.shape[1]:], skip_special_tokens=False)
        stopped += want.endswith("%")
        assert got == want
    assert stopped >= 1  # (a row the stop string ended: the case)


@pytest.mark.timeout(120)
def test_suffix_rows_keep_single_token_bans():
    """Single-token bans and biases read no prompt token: suffix rows keep them (sdpa's tokens)."""
    tok = tiny_tokenizer()
    batch = tok([SYSTEM + q for q in ["q1", "a longer question two"]], return_tensors="pt", padding=True)
    model, ref = tiny_model("llama"), tiny_model("llama", attn_implementation="sdpa")
    option = dict(bad_words_ids=[[70], [11]], sequence_bias={(27,): -3.0})
    want = ref.generate(**batch, max_new_tokens=6, do_sample=False, **option)[:, batch.input_ids.shape[1]:]
    inputs = hf_cascade.shared_prefix_inputs(model, batch.input_ids, batch.attention_mask, layout="suffix")
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False, custom_generate=hf_cascade.generate, **option)
    assert torch.equal(got[:, inputs["input_ids"].shape[1]:], want)


@pytest.mark.timeout(120)
def test_planned_cache_refuses_rows_it_was_not_planned_for():
    """A cache shared_prefix_inputs planned, given to hf_cascade.generate with its rows reordered or tiled: every row
    other tokens than sdpa's, silently (plain generate() refused); now a ValueError naming the row. Its own rows
    still give sdpa's tokens."""
    tok = tiny_tokenizer()
    few = "Examples: 1+1=2; 2+2=4; 3+3=6.\n"
    batch = tok([SYSTEM + few + "Q: 4+4?", SYSTEM + few + "Q: 5+5?", SYSTEM + "Q: mouse?", "Unrelated row here"],
                return_tensors="pt", padding=True)
    model, ref = tiny_model("llama"), tiny_model("llama", attn_implementation="sdpa")
    gen = dict(max_new_tokens=5, do_sample=False, custom_generate=hf_cascade.generate)
    cache = hf_cascade.shared_prefix_inputs(model, batch.input_ids, batch.attention_mask)[hf_cascade.CACHE_KWARG]
    for rows in (torch.tensor([3, 2, 1, 0]), torch.arange(8) % 4):
        with pytest.raises(ValueError, match="does not start with the"):
            model.generate(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                           **{hf_cascade.CACHE_KWARG: cache}, **gen)
    want = ref.generate(**batch, max_new_tokens=5, do_sample=False)
    got = model.generate(**batch, **{hf_cascade.CACHE_KWARG: cache}, **gen)
    assert torch.equal(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_adamw_steps_as_eager(family):
    """Five AdamW steps on fixed data: the same losses and weights as eager (AdamW amplifies gradient rounding)."""
    torch.manual_seed(1)
    ids = torch.randint(4, 260, (3, 20))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    runs = []
    for model in _pair(family):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.detach() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for want, got in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_training_mode_with_attention_dropout_runs_generates_own_decoding():
    """model.train() with attention dropout: hf_cascade.generate runs generate()'s own decoding (dropout applied:
    the reference's tokens for the same seed), with a warning; a CascadeCache of the user's refuses it."""
    tok = tiny_tokenizer()
    batch = tok([SYSTEM + q for q in ["q1", "a longer question two", "q3 mid?"]], return_tensors="pt", padding=True)
    model = tiny_model("llama", attention_dropout=0.5).train()
    ref = tiny_model("llama", attn_implementation="sdpa", attention_dropout=0.5).train()
    torch.manual_seed(1)
    want = ref.generate(**batch, max_new_tokens=6, do_sample=False)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="attention dropout in training mode"):
        got = model.generate(**batch, max_new_tokens=6, do_sample=False, custom_generate=hf_cascade.generate)
    assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf_cascade.shared_prefix_inputs(model, batch.input_ids, batch.attention_mask)
    inputs = hf_cascade.shared_prefix_inputs(model.eval(), batch.input_ids, batch.attention_mask)
    with pytest.raises(NotImplementedError, match="dropout"):
        model.train().generate(**inputs, max_new_tokens=3, do_sample=False)


def _windowed_full_layers(name, attn):
    import transformers

    from hf_cascade.model_zoo import TINY_SIZES, tiny_model as zoo_model

    sizes = dict(TINY_SIZES)
    if name == "exaone4":
        config = transformers.Exaone4Config(**sizes, sliding_window=6,
                                            layer_types=["sliding_attention", "full_attention"])
    else:
        config = transformers.Qwen2MoeConfig(**sizes, use_sliding_window=True, sliding_window=6, max_window_layers=2,
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32)
    return zoo_model("llama", attn, seed=0, config=config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["exaone4", "qwen2_moe"])
def test_full_attention_layers_of_windowed_models_get_no_window(name):
    """A model whose layer_types mix sliding and full layers, with the window kept on every module (Exaone 4) or on
    the config (Qwen2-MoE): generate and score as sdpa (the full layers attend to every column)."""
    from hf_cascade.inputs import left_padded

    model, ref = _windowed_full_layers(name, "cascade"), _windowed_full_layers(name, "sdpa")
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 128, (20,), generator=g).tolist()
    rows = [prefix + torch.randint(3, 128, (n,), generator=g).tolist() for n in (2, 7)]
    ids, mask = left_padded(rows, 0)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = ref.generate(input_ids=ids, attention_mask=mask, **gen)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, custom_generate=hf_cascade.generate, **gen),
                       want)
    context, continuation = rows[1], list(range(10, 30))
    got = hf_cascade.score(model, [context], [continuation], return_token_logprobs=True).token_logprobs[0]
    with torch.no_grad():
        logprobs = ref(input_ids=torch.tensor([context + continuation])).logits[0].log_softmax(-1)
    expected = torch.stack([logprobs[len(context) - 1 + i, t] for i, t in enumerate(continuation)])
    torch.testing.assert_close(got.to(expected.dtype), expected, rtol=0, atol=1e-4)


@pytest.mark.timeout(120)
def test_moshi_config_window_is_not_applied_and_roberta_scores_count_its_positions():
    """Moshi's config has a sliding_window its attention never applies: score() windowed it (1.9 nats off);
    RoBERTa-style embeddings count positions from the pad id + 1: score() passed positions from 0 (1.3 off)."""
    import copy

    import transformers

    def pair(config):
        models = []
        for attn in ("sdpa", "cascade"):
            torch.manual_seed(0)
            models.append(transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32).eval())
        return models

    sizes = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    configs = [transformers.MoshiConfig(**sizes, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096,
                                        sliding_window=6, pad_token_id=0),
               transformers.RobertaConfig(**sizes, is_decoder=True, pad_token_id=1, max_position_embeddings=128)]
    g = torch.Generator().manual_seed(1)
    context = torch.randint(3, 200, (12,), generator=g).tolist()
    continuation = torch.randint(3, 200, (15,), generator=g).tolist()
    for config in configs:
        ref, model = pair(config)
        got = hf_cascade.score(model, [context], [continuation], return_token_logprobs=True).token_logprobs[0]
        with torch.no_grad():
            logprobs = ref(input_ids=torch.tensor([context + continuation])).logits[0].log_softmax(-1)
        expected = torch.stack([logprobs[len(context) - 1 + i, t] for i, t in enumerate(continuation)])
        torch.testing.assert_close(got.to(expected.dtype), expected, rtol=0, atol=1e-4, msg=type(config).__name__)


@pytest.mark.timeout(60)
def test_sparse_indexed_attention_is_refused_before_any_work():
    """DeepSeek-V3.2 / V4, GLM-MoE-DSA, HY-V4: an indexer keeps state in the cache (transformers' update_indexer,
    store_compression_weights): a ValueError / AttributeError deep in the model; now a NotImplementedError naming the
    layer types (here on a tiny Llama whose config says so)."""
    model = tiny_model("llama")
    model.config.layer_types = ["indexed_attention", "full_attention"]
    ids = torch.randint(3, 100, (2, 9))
    with pytest.raises(NotImplementedError, match="sparse attention layers"):
        model.generate(ids, max_new_tokens=2, custom_generate=hf_cascade.generate)


@pytest.mark.timeout(120)
def test_phimoe_window_applied_through_its_mask_and_dbrx_dropout_found():
    """Regressions of this sweep's own fixes, found by a review sweep: PhiMoE windows through its mask only (its
    attention names no window): the window must stay applied; DBRX keeps its attention dropout in attn_config: a
    train-mode call must fall back (not raise inside the cache)."""
    import transformers

    from hf_cascade.model_zoo import TINY_SIZES, tiny_model as zoo_model

    config = transformers.PhimoeConfig(**{**TINY_SIZES, "num_local_experts": 4, "num_experts_per_tok": 2,
                                          "sliding_window": 4})
    ref, model = (zoo_model(config=config, attn_implementation=attn, seed=0) for attn in ("sdpa", "cascade"))
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(4, 128, (12,), generator=g)
    rows = [torch.cat([torch.tensor([1]), shared, torch.randint(4, 128, (n,), generator=g)]) for n in (3, 5)]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = (ids != 0).long()
    gen = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, custom_generate=hf_cascade.generate, **gen), ref.generate(ids, **gen))

    dbrx = transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_config={"kv_n_heads": 2, "attn_pdrop": 0.3, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(dbrx, attn_implementation="cascade").train()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 20], [1, 5, 6, 7, 8, 9, 10, 11, 12, 30]])
    with pytest.warns(UserWarning, match="attn_pdrop"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0,
                       custom_generate=hf_cascade.generate, cascade_options=dict(min_shared_tokens=2))
