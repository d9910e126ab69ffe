"""``generate(custom_generate=hf_cascade.generate)``: the user's own generate()/pipeline() call gets the sharing.

Every test compares with the reference model (sdpa; eager for Gemma2) given the same left-padded batch a tokenizer
returns, fp32 on CPU: identical tokens, logits within 1e-4, and KV bytes equal to what the prefix tree predicts
(every shared node once + each row's suffix columns).
"""

import functools

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, pipeline

import hf_cascade
from hf_cascade.tiny import tiny_model, tiny_tokenizer
from hf_cascade.transformers_compat import output_cache

from test_generate import assert_logits_close, make_prompts, model_pair, pad_batch

NEW = 5
BASE = dict(max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def kv_bytes_per_token(model):
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K and V, fp32


def expected_nbytes(cache, rows_total, new_tokens, per_token):
    """Every node of the tree once + every row's suffix window (prompt columns after prefix_length + new - 1)."""
    suffix_columns = cache.layers[0].keys.shape[2]
    assert suffix_columns == cache.suffix_length
    shared = cache.prefilled_prefix_tokens
    return (shared + rows_total * suffix_columns) * per_token, shared


def run_both(ref, cas, rows, seed=None, side="left", **gen):
    ids, mask = pad_batch(rows, side="left")
    cas_ids, cas_mask = pad_batch(rows, side=side)
    kwargs = dict(BASE, **gen)
    if seed is not None:
        torch.manual_seed(seed)
    want = ref.generate(input_ids=ids, attention_mask=mask, **kwargs)
    caches = []
    if seed is not None:
        torch.manual_seed(seed)
    got = cas.generate(
        input_ids=cas_ids, attention_mask=cas_mask, custom_generate=hf_cascade.generate, cascade_caches=caches, **kwargs
    )
    # Outputs are exactly as wide as the input plus the new tokens: out[:, L:] are the completions.
    assert got.sequences.shape == want.sequences.shape
    return want, got, caches


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral", "phi3"])
def test_greedy_one_argument_matches_reference(family):
    ref, cas = model_pair(family)
    want, got, caches = run_both(ref, cas, make_prompts(seed=1), do_sample=False)
    assert torch.equal(got.sequences, want.sequences)
    assert_logits_close(want, got)
    (cache,) = caches
    assert [level.num_nodes for level in cache.levels] == [1, 2]  # system prompt -> few-shot blocks
    assert output_cache(got) is cache


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_samples_share_their_prompt(family):
    """One prompt x N seeded samples: the prompt is prefilled and stored once, each sample holds only its own."""
    ref, cas = model_pair(family)
    (prompt,) = make_prompts(seed=2, groups=1, per_group=1)
    n = 6
    want, got, caches = run_both(ref, cas, [prompt], seed=11, do_sample=True, top_k=20, num_return_sequences=n)
    assert torch.equal(got.sequences, want.sequences)
    (cache,) = caches
    assert cache.prefilled_prefix_tokens == len(prompt) - 1  # the last prompt token runs through generate()
    per_token = kv_bytes_per_token(cas)
    # n rows x (last prompt token + NEW - 1 new tokens whose KV is written) + the prompt once.
    assert cache.nbytes == (len(prompt) - 1 + n * NEW) * per_token
    flat = n * (len(prompt) + NEW - 1) * per_token  # what sdpa's DynamicCache holds
    assert cache.nbytes < flat / 2


def test_grpo_shaped_batch_nests_system_prompt_prompts_and_samples():
    """Prompts sharing a system prompt x N samples each: system prompt -> each prompt -> samples, all once."""
    ref, cas = model_pair("llama")
    rows = make_prompts(seed=3, system=12, block=9, groups=3, per_group=1)  # 3 prompts, distinct blocks
    n = 4
    want, got, caches = run_both(ref, cas, rows, seed=5, do_sample=True, temperature=0.9, num_return_sequences=n)
    assert torch.equal(got.sequences, want.sequences)
    (cache,) = caches
    assert [level.num_nodes for level in cache.levels] == [1, 3]
    unique_prompt_tokens = 12 + sum(len(r) - 12 - 1 for r in rows)  # system once + each prompt's own but its last
    assert cache.prefilled_prefix_tokens == unique_prompt_tokens
    want_bytes, _ = expected_nbytes(cache, len(rows) * n, NEW, kv_bytes_per_token(cas))
    assert cache.nbytes == want_bytes
    # Each row's suffix window is 1 prompt column (all rows' prompts end after their node) + NEW - 1 new tokens.
    assert cache.suffix_length == NEW


class _AllDoneAt(StoppingCriteria):
    """Every row finished once the rows are ``length`` tokens long (a device tensor, as EOS criteria return)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("do_sample", [False, True])
def test_stop_check_read_a_step_late_changes_nothing(defer, do_sample):
    """hf_cascade's decoding loop (transformers' _sample with the "all rows finished" flag read one step late, the
    default on CUDA): an EOS that ends one row early, and a criterion that ends every row before max_new_tokens.
    The step after the stop is undone: the same sequences, scores, logits and cache length as transformers'."""
    ref, cas = model_pair("llama")
    rows = make_prompts(seed=1)
    ids, mask = pad_batch(rows)
    plain = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    eos = int(plain[0, ids.shape[1] + 2])  # row 0's third new token ends row 0
    stop = StoppingCriteriaList([_AllDoneAt(ids.shape[1] + 6)])  # every row ends after 6 of max_new_tokens=9
    gen = dict(max_new_tokens=9, pad_token_id=0, eos_token_id=eos, do_sample=do_sample, top_k=20,
               return_dict_in_generate=True, output_scores=True, output_logits=True)
    torch.manual_seed(7)
    want = ref.generate(input_ids=ids, attention_mask=mask, stopping_criteria=stop, **gen)
    caches, forwards = [], []
    hook = cas.register_forward_pre_hook(lambda module, args: forwards.append(1))
    torch.manual_seed(7)
    try:
        got = cas.generate(input_ids=ids, attention_mask=mask, stopping_criteria=stop,
                           custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(defer_stop_check=defer), **gen)
    finally:
        hook.remove()
    assert len(forwards) == 6 + defer  # read a step late: one step more, undone
    assert want.sequences.shape[1] == ids.shape[1] + 6
    if not do_sample:
        assert (want.sequences[0, ids.shape[1] + 3:] == 0).all()  # row 0 padded after its EOS
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    assert_logits_close(want, got)
    for w, g in zip(want.scores, got.scores):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    assert output_cache(got) is caches[0]
    assert output_cache(got).get_seq_length() == output_cache(want).get_seq_length()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_beam_search_and_beam_sampling(family):
    ref, cas = model_pair(family)
    rows = make_prompts(seed=4)
    want, got, caches = run_both(ref, cas, rows, num_beams=3, num_return_sequences=2, do_sample=False,
                                 output_scores=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-4, rtol=0)
    assert caches[0].row_nodes.shape[1] == len(rows) * 3  # planned for the expanded beams
    want, got, _ = run_both(ref, cas, rows, seed=3, num_beams=2, do_sample=True, top_k=10)
    assert torch.equal(got.sequences, want.sequences)


def test_right_padded_batch_sharing_a_prefix_is_refused():
    """sdpa takes a right-padded row's first new token from its last column, a pad: refused, naming the fix
    (tests/test_silent_edges_4.py has the details)."""
    ref, cas = model_pair("qwen3")
    with pytest.raises(ValueError, match=r'right-padded.*padding_side = "left"'):
        run_both(ref, cas, make_prompts(seed=6, groups=3), side="right", do_sample=False)


def test_user_cache_and_no_sharing_are_plain_generate():
    ref, cas = model_pair("llama")
    # Rows that share nothing: no cascade cache is built, the result is generate()'s own.
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 2)]
    want, got, caches = run_both(ref, cas, rows, do_sample=False)
    assert caches == [] and isinstance(output_cache(got), DynamicCache)
    assert torch.equal(got.sequences, want.sequences)
    assert_logits_close(want, got)
    # A user's own pre-filled DynamicCache (transformers' prefix-reuse recipe) is used as given.
    rows = make_prompts(seed=9, groups=1, per_group=3)
    prefix = torch.tensor([rows[0][:10]] * 3)
    for model in (ref, cas):
        dynamic = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prefix, past_key_values=dynamic)
        model._test_cache = dynamic
    ids = torch.tensor([r[:10] + r[10:14] for r in rows])
    want = ref.generate(ids, past_key_values=ref._test_cache, **BASE)
    caches = []
    got = cas.generate(ids, past_key_values=cas._test_cache, custom_generate=hf_cascade.generate,
                       cascade_caches=caches, **BASE)
    assert caches == [] and output_cache(got) is cas._test_cache
    assert torch.equal(got.sequences, want.sequences)


def test_pipeline_gets_the_sharing():
    """pipeline("text-generation") with one extra call argument: same text as sdpa's pipeline, KV shared."""
    tokenizer = tiny_tokenizer()
    ref, cas = tiny_model("llama", attn_implementation="sdpa"), tiny_model("llama")
    system = "You are a terse assistant. Answer with one word.\n"
    prompts = [system + f"Q: what is {w}?\nA:" for w in ("red", "a cat", "rain", "the moon", "tea")]
    gen = dict(max_new_tokens=NEW, do_sample=False, return_full_text=False)
    want = pipeline("text-generation", model=ref, tokenizer=tokenizer, batch_size=5)(prompts, **gen)
    caches = []
    pipe = pipeline("text-generation", model=cas, tokenizer=tokenizer, batch_size=5)
    got = pipe(prompts, custom_generate=hf_cascade.generate, cascade_caches=caches, **gen)
    assert [g[0]["generated_text"] for g in got] == [w[0]["generated_text"] for w in want]
    (cache,) = caches
    system_tokens = len(tokenizer(system)["input_ids"])
    assert cache.prefix_tree.levels[0][0].rows == (0, 1, 2, 3, 4)
    assert len(cache.prefix_tree.levels[0][0].tokens) >= system_tokens
    want_bytes, shared = expected_nbytes(cache, len(prompts), NEW, kv_bytes_per_token(cas))
    assert cache.nbytes == want_bytes
    flat_tokens = sum(len(tokenizer(p)["input_ids"]) + NEW - 1 for p in prompts)
    assert cache.nbytes < flat_tokens * kv_bytes_per_token(cas)


def test_real_model_greedy_and_samples(smollm2):
    """SmolLM2-135M-Instruct (pretrained), chat template, left-padded batch: identical tokens to sdpa."""
    model, tokenizer = smollm2
    system = "You are a helpful assistant. Answer in one short sentence."
    questions = ["What is the capital of France?", "Name a primary color.", "Which planet is the largest?"]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}], tokenize=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    results = {}
    for impl in ("sdpa", "cascade"):
        model.set_attn_implementation(impl)
        extra = dict(custom_generate=hf_cascade.generate, cascade_caches=[]) if impl == "cascade" else {}
        greedy = model.generate(**batch, max_new_tokens=6, do_sample=False, **extra)
        torch.manual_seed(0)
        sampled = model.generate(**batch, max_new_tokens=4, do_sample=True, num_return_sequences=2, **extra)
        results[impl] = (greedy, sampled, extra.get("cascade_caches"))
    assert torch.equal(results["cascade"][0], results["sdpa"][0])
    assert torch.equal(results["cascade"][1], results["sdpa"][1])
    greedy_cache, sampled_cache = results["cascade"][2]
    assert greedy_cache.levels and sampled_cache.num_levels == 2  # system prompt -> each question's samples
    answers = tokenizer.batch_decode(results["cascade"][0][:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answers[0]


def test_zero_argument_checkpoint(tmp_path):
    """write_custom_generate: a checkpoint loaded with trust_remote_code=True shares prefixes in its plain
    generate() and pipeline() calls (transformers binds custom_generate/generate.py as model.generate)."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    ref = tiny_model("llama", attn_implementation="sdpa")
    ref.save_pretrained(tmp_path)
    hf_cascade.write_custom_generate(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    system = "You are a terse assistant. Answer with one word.\n"
    prompts = [system + f"Q: what is {w}?\nA:" for w in ("red", "a cat", "rain", "tea")]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    got = model.generate(**batch, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert isinstance(output_cache(got), hf_cascade.CascadeCache)  # the shared system prompt was stored once
    assert output_cache(got).num_levels >= 1
    assert torch.equal(got.sequences, ref.generate(**batch, max_new_tokens=NEW, do_sample=False))
    gen = dict(max_new_tokens=NEW, do_sample=False, return_full_text=False)
    texts = pipeline("text-generation", model=model, tokenizer=tokenizer, batch_size=4)(prompts, **gen)
    want = pipeline("text-generation", model=ref, tokenizer=tokenizer, batch_size=4)(prompts, **gen)
    assert texts == want
    # Without trust_remote_code, transformers ignores the file: plain generate(), no hf_cascade.
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not isinstance(plain.generate, functools.partial)
    with pytest.raises(ValueError, match="config.json"):
        hf_cascade.write_custom_generate(str(tmp_path / "nowhere"))


def test_inputs_embeds_run_as_plain_generate():
    """Prompts given as embeddings carry no token ids to find sharing in: the call is generate()'s own."""
    ref, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=12))
    embeds = cas.get_input_embeddings()(ids)
    caches = []
    got = cas.generate(inputs_embeds=embeds, attention_mask=mask, custom_generate=hf_cascade.generate,
                       cascade_caches=caches, max_new_tokens=NEW, pad_token_id=0, do_sample=False)
    want = ref.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, do_sample=False)
    assert caches == [] and torch.equal(got, want)


def test_right_padded_rows_sharing_nothing_and_no_cache():
    """Nothing worth sharing in a right-padded batch: the rows go to generate() as the user gave them (so the
    result is generate()'s own, right padding and all); use_cache=False: generate()'s own too."""
    ref, cas = model_pair("llama")
    g = torch.Generator().manual_seed(13)
    rows = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 2)]
    ids, mask = pad_batch(rows, side="right")
    gen = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=False)
    for extra in ({}, {"use_cache": False}):
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           **gen, **extra)
        assert caches == [] and torch.equal(got, ref.generate(ids, attention_mask=mask, **gen, **extra))


def test_decode_step_option_is_checked():
    """cascade_options["decode_step"]: a bad value is a ValueError naming the choices."""
    _, cas = model_pair("llama")
    ids, mask = pad_batch(make_prompts(seed=3))
    with pytest.raises(ValueError, match=r"decode_step.*'layers'.*'graphs'.*'fast'"):
        cas.generate(ids, attention_mask=mask, max_new_tokens=2, custom_generate=hf_cascade.generate,
                     cascade_options=dict(decode_step="fast"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunks", [4, 16])
def test_greedy_tokens_equal_argmax_of_the_fp32_copy(dtype, chunks):
    """hf_cascade's greedy loop reads the token from the logits as they are, in two reductions (chunk maxima, then
    the first chunk holding the row's maximum): the same index as ``argmax`` of the fp32 copy, ties (the first
    index) and NaN (the maximum) included."""
    from hf_cascade.decode.sampling import greedy_tokens

    g = torch.Generator().manual_seed(5)
    for trial in range(50):
        logits = (torch.randn(7, 1024, generator=g) * 2).round().to(dtype)  # few distinct values: many ties
        if trial % 5 == 0:
            logits[trial % 7, 700] = float("nan")
            logits[trial % 7, 900] = float("nan")
        if trial % 7 == 0:
            logits[3] = 1.0  # a row of equal values
        want = torch.argmax(logits.float(), dim=-1)
        assert torch.equal(greedy_tokens(logits, chunks), want), trial
    assert torch.equal(greedy_tokens(logits), want)  # the default on this device
