"""The fifth sweep's silent wrong results, each now the reference's answer or a clear error (fp32, CPU):

* context parallelism (gloo, 2 ranks): GPT-OSS's attention sinks merged into the combined state; Llama 4's chunked
  layers refused where the prompt crosses a chunk (the ring prefill and fixed buffers ignored them), kept where a
  growing decode reads transformers' chunked mask; RoPE that depends on each forward's longest position (dynamic
  NTK, longrope) refused past its limit; a sliding window the new tokens would cross refused before any step;
* generate(): the same RoPE past its limit shares nothing (a shared node's own forward would rotate its keys
  otherwise than generate()'s forward over the whole prompt);
* score: lm-eval's text split (the context's own tokens), an empty continuation refused, each pair alone past the
  RoPE limit, autocast refused; generate_dataset: stop_strings as plain generate() applies them;
* a from_prefix cache: a manual multi-row forward into fixed buffers, rows not longer than the prefix (the error names
  that cause), deep copies (a TypeError saying to reuse the cache).
"""

from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade.model_scan import rope_limit
from hf_cascade.model_zoo import available_families, reference_attention, tiny_model
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.transformers_compat import compileable_cache_masks_fail

GEN = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
LONGROPE = dict(max_position_embeddings=512, original_max_position_embeddings=32,
                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                     long_factor=[4.0] * 8, original_max_position_embeddings=32))
DYNAMIC = dict(max_position_embeddings=32, rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0))
# name -> (family, config overrides, prompt tokens, generate kwargs)
CP_CASES = {
    "gpt_oss sinks": ("gpt_oss", dict(sliding_window=4096), 21, {}),
    "llama4 chunk crossed by the prompt": ("llama4", {}, 21, {}),
    "llama4 chunk crossed in a growing decode": ("llama4", {}, 6, dict(max_new_tokens=6)),
    "llama4 chunk crossed in fixed buffers": ("llama4", {}, 6, dict(max_new_tokens=6)),
    "phi3 longrope past its limit": ("phi3", LONGROPE, 40, {}),
    "llama dynamic NTK within its limit": ("llama", DYNAMIC, 20, {}),
    "gemma3 window reached by the new tokens": ("gemma3", {}, 5, dict(max_new_tokens=4)),  # window 8: 8 columns
    "gemma3 window crossed by the new tokens": ("gemma3", {}, 5, dict(max_new_tokens=5)),  # refused before a step
}


def _prompt(tokens: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))


def _cp_worker(rank, world):
    results = {}
    for name, (family, overrides, tokens, gen) in CP_CASES.items():
        model = tiny_model(family, "cascade", seed=0, **overrides)
        ids = _prompt(tokens)
        options = dict(max_new_tokens=6) if "fixed buffers" in name else {}
        try:
            inputs = hf_cascade.context_parallel_inputs(model, ids, torch.ones_like(ids), **options)
            out = model.generate(**inputs, **{**GEN, **gen})
            results[name] = (out.sequences[:, ids.shape[1]:], torch.stack(out.logits))
        except (NotImplementedError, ValueError) as err:
            results[name] = str(err)
    return results


@pytest.fixture(scope="module")
def cp_results():
    return run_on_gloo(_cp_worker, 2, timeout_s=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_edges(cp_results, name):
    family, overrides, tokens, gen = CP_CASES[name]
    if family not in available_families():
        pytest.skip(f"no {family} config in this transformers")
    ranks = [results[name] for results in cp_results]
    if "fixed buffers" in name and compileable_cache_masks_fail(tiny_model(family, "cascade")):
        # transformers 5.17 fails on Llama 4 with any cache of fixed buffers: refused when they are asked for
        assert all(isinstance(r, str) and "create_chunked_causal_mask" in r for r in ranks), ranks
        return
    if "chunk crossed by the prompt" in name or "fixed buffers" in name:
        assert all(isinstance(r, str) and "attention chunks of 8 tokens" in r for r in ranks), ranks
        return
    if "past its limit" in name:
        assert all(isinstance(r, str) and "past 32 tokens" in r for r in ranks), ranks
        return
    if "window crossed" in name:
        assert all(isinstance(r, str) and "sliding window of 8 tokens and this call reaches 9" in r for r in ranks)
        return
    assert not isinstance(ranks[0], str), ranks[0]
    ref = tiny_model(family, reference_attention(family), seed=0, **overrides)
    ids = _prompt(tokens)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **{**GEN, **gen})
    for new, logits in ranks:
        assert torch.equal(new, want.sequences[:, ids.shape[1]:])
        torch.testing.assert_close(logits, torch.stack(want.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, overrides", [("phi3", LONGROPE), ("llama", DYNAMIC)])
def test_dynamic_rope_past_its_limit_shares_nothing_and_matches(family, overrides):
    ref = tiny_model(family, reference_attention(family), seed=0, **overrides)
    cas = tiny_model(family, "cascade", seed=0, **overrides)
    assert rope_limit(cas) == 32 and rope_limit(tiny_model(family, "cascade", seed=0)) is None
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 100, (20,), generator=g)
    for own in (4, 20):  # rows of 24 tokens (shared) and of 40 (past the limit: not shared)
        ids = torch.cat([shared.expand(3, -1), torch.randint(3, 100, (3, own), generator=g)], 1)
        mask = torch.ones_like(ids)
        want = ref.generate(ids, attention_mask=mask, **GEN)
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2), **GEN)
        assert torch.equal(got.sequences, want.sequences), own
        torch.testing.assert_close(got.logits[0], want.logits[0], atol=1e-4, rtol=0)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None)
    assert not inputs[next(k for k in inputs if k not in ("input_ids", "attention_mask"))].levels


class _MergingTokenizer:
    """Greedy longest-match over a tiny vocabulary whose tokens merge across a context / continuation boundary."""

    vocab = {"It": 10, " is": 11, " isn": 12, "'t": 13, "n": 14, "Hello": 15, " wor": 16, " world": 17, "ld": 18}

    def __call__(self, text, add_special_tokens=True):
        ids = []
        while text:
            piece = max((p for p in self.vocab if text.startswith(p)), key=len)
            ids.append(self.vocab[piece])
            text = text[len(piece):]
        return {"input_ids": ids}


def test_score_splits_text_pairs_as_lm_eval_and_refuses_an_empty_continuation():
    """lm-eval's HFLM._encode_pair: the context's own tokens, then the joined text's tokens after as many ("It is" +
    "n't": context [It, is], continuation ['t], not [It, isn] + ['t]); a continuation merged wholly into the
    context's last token ("Hello wor" + "ld" = [Hello, world]) would score 0: a ValueError."""
    model = tiny_model("llama", "cascade", seed=0)
    tok = _MergingTokenizer()
    got = hf_cascade.score(model, ["It is"], ["n't"], tokenizer=tok)
    want = hf_cascade.score(model, [[10, 11]], [[13]])
    assert got.logprobs.tolist() == want.logprobs.tolist()
    with pytest.raises(ValueError, match="no token of its own"):
        hf_cascade.score(model, ["Hello wor"], ["ld"], tokenizer=tok)


def test_score_with_dynamic_rope_scores_each_pair_as_alone():
    """A pair past the RoPE limit in the call: every pair runs alone (a batched forward's longest position would
    pick the frequencies of the shorter pairs too)."""
    ref = tiny_model("phi3", "sdpa", seed=0, **LONGROPE)
    cas = tiny_model("phi3", "cascade", seed=0, **LONGROPE)
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(3, 100, (n,), generator=g).tolist(), torch.randint(3, 100, (4,), generator=g).tolist())
             for n in (10, 60)]
    got = hf_cascade.score(cas, [c for c, _ in pairs], [x for _, x in pairs])
    for (ctx, cont), lp in zip(pairs, got.logprobs.tolist()):
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = ref(ids[:, :-1]).logits[0, -len(cont):].float()
        want = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont)[:, None]).sum())
        assert abs(lp - want) < 1e-4, (lp, want)


def test_score_under_autocast_is_a_clear_error():
    model = tiny_model("llama", "cascade", seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.autocast"):
        hf_cascade.score(model, [[1, 2, 3]] * 2, [[4], [5]])


def test_generate_dataset_stop_strings_as_plain_generate():
    """generate() hands a custom_generate neither stop_strings nor a tokenizer; generate_dataset builds transformers'
    StopStringCriteria itself (with the tokenizer passed in generation_kwargs, else its own), so each row stops
    where plain generate(stop_strings=..., tokenizer=...) stops it."""
    pytest.importorskip("datasets")
    import datasets

    from hf_cascade.dataset_generation import generate_dataset
    from hf_cascade import tiny

    tok = tiny.tiny_tokenizer()
    cas, ref = tiny.tiny_model("llama"), tiny.tiny_model("llama", attn_implementation="sdpa")
    preamble = "You are a careful calculator. Reply with the number only.\n"
    prompts = [preamble + f"Q: {i}+{i}=\nA:" for i in range(4)] + ["short"]
    for kwargs in (dict(stop_strings=["a", "e", "o"], tokenizer=tok), dict(stop_strings=["a", "e", "o"])):
        got = generate_dataset(cas, tok, datasets.Dataset.from_dict({"prompt": prompts}), progress=False,
                               generation_kwargs=dict(max_new_tokens=8, **kwargs))["completion"]
        for prompt, completion in zip(prompts, got):
            ids = tok(prompt, return_tensors="pt")
            out = ref.generate(**ids, pad_token_id=0, max_new_tokens=8, stop_strings=["a", "e", "o"], tokenizer=tok)
            assert completion == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_from_prefix_cache_edges():
    """A from_prefix cache: a manual forward of several rows into fixed buffers without position_ids (transformers
    builds them with one row) is the no-cache forward; rows not longer than the prefix get an error naming that
    cause; a deep copy is a TypeError saying to reuse the cache as it is (it is never written)."""
    import copy

    from hf_cascade import CascadeCache
    from hf_cascade.transformers_compat import CACHE_KWARG

    ref, cas = (tiny_model("llama", impl, seed=0) for impl in ("sdpa", "cascade"))
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 100, (13,), generator=g)
    suffix = torch.randint(3, 100, (3, 5), generator=g)
    cache = CascadeCache.from_prefix(cas, prefix, max_suffix_length=16)
    with torch.no_grad():
        got = cas(suffix, **{CACHE_KWARG: cache}).logits
        want = ref(torch.cat([prefix.expand(3, -1), suffix], 1)).logits[:, 13:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="not longer than the prefix"):
        cas.generate(prefix[None, :10], max_new_tokens=2, do_sample=False, pad_token_id=0,
                     **{CACHE_KWARG: CascadeCache.from_prefix(cas, prefix)})
    with pytest.raises(TypeError, match="reuse it as it is"):
        copy.deepcopy(cache)


def test_llama4_fixed_buffers_exact_or_refused_where_transformers_fails_on_them():
    """transformers 5.17 fails on Llama 4 with any cache of fixed buffers (its StaticCache too): there, asking for
    them is a ValueError naming it and the default grows the cache (the reference's tokens); elsewhere both are
    exact."""
    if "llama4" not in available_families():
        pytest.skip("no llama4 config in this transformers")
    ref, cas = (tiny_model("llama4", impl, seed=0) for impl in (reference_attention("llama4"), "cascade"))
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.randint(3, 128, (1, 4), generator=g).expand(3, -1),
                     torch.randint(3, 128, (3, 2), generator=g)], 1)
    mask = torch.ones_like(ids)
    gen = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, attention_mask=mask, **gen)
    options = dict(cost_model=None, min_shared_tokens=2)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_options=options, **gen)
    assert torch.equal(got, want)
    fixed = dict(cascade_options=dict(options, fixed_buffers=True), custom_generate=hf_cascade.generate)
    if compileable_cache_masks_fail(cas):
        with pytest.raises(ValueError, match="create_chunked_causal_mask"):
            cas.generate(ids, attention_mask=mask, **fixed, **gen)
        with pytest.raises(ValueError, match="fixed buffers"):
            hf_cascade.shared_prefix_inputs(cas, ids, mask, max_new_tokens=2, **options)
        return
    assert torch.equal(cas.generate(ids, attention_mask=mask, **fixed, **gen), want)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, max_new_tokens=2, **options)
    got = cas.generate(**inputs, **gen)
    assert torch.equal(got[:, inputs["input_ids"].shape[1]:], want[:, ids.shape[1]:])
