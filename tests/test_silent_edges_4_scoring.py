"""Fourth sweep, ``hf_cascade.score`` (issue 49): inputs and models that gave wrong log-probs without a word, or an
error that named nothing. Each is now exact against the pair scored alone with sdpa (fp32, same weights) or a
ValueError naming the argument.

Tiny random models are built from the real transformers configs (no downloads); the real sizes are in comments.
"""

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import tiny_model

from test_generate import pad_batch
from test_scoring import TOL, check_against_reference, reference


def _rand(generator):
    return lambda n: torch.randint(3, 128, (n,), generator=generator).tolist()


def _loners(seed=1):
    """Pairs sharing nothing, of different lengths (4 to 25 tokens): the rows' window pads them differently."""
    rand = _rand(torch.Generator().manual_seed(seed))
    return [rand(5), rand(13), rand(3), rand(20)], [rand(4), rand(2), rand(6), rand(3)]


def _two_blocks(seed=2):
    """Two few-shot blocks of 12 and 20 tokens (not a multiple of a chunk apart: two level-0 nodes of different
    lengths), 4 questions each of 3 to 15 tokens, 3 choices of 1 to 6 tokens each; then the loners."""
    rand = _rand(torch.Generator().manual_seed(seed))
    contexts, continuations = [], []
    for block in (rand(11), rand(19)):
        for q in range(4):
            context = [1] + block + rand(3 + 4 * q)
            for c in range(3):
                contexts.append(context)
                continuations.append(rand(1 + (3 * c + q) % 6))
    loners = _loners(seed)
    return contexts + loners[0], continuations + loners[1]


def _llama4(**overrides):
    """Llama 4 text model: 3 chunked-attention layers (chunks of 8; 8192 in Llama 4 Scout), then a full one."""
    cas = tiny_model("llama4", seed=0, **overrides)
    ref = tiny_model("llama4", "sdpa", seed=0, **overrides)
    assert "chunked_attention" in cas.config.layer_types and ref.config._attn_implementation == "sdpa"
    return cas, ref


# ------------------------------------------------------------------ 3. chunked attention (Llama 4)
def test_chunked_attention_pairs_of_different_lengths_sharing_nothing_exact():
    """Off by up to 2.2 nats: the padded window put the chunk bounds on columns, not on each row's positions (only
    the longest row was right)."""
    cas, ref = _llama4()
    contexts, continuations = _loners()
    out = hf_cascade.score(cas, contexts, continuations, return_token_logprobs=True)
    check_against_reference(out, ref, contexts, continuations)


@pytest.mark.parametrize("chunk, budget", [(8, 4096), (5, 4096), (8, 16), (3, 7)])
def test_chunked_attention_with_shared_segments_exact(chunk, budget):
    """Two few-shot blocks of different lengths (two level-0 nodes prefilled in one padded forward), the questions
    under them, loners; one forward per level and for the rows, or many (a budget of 16 or 7 tokens). Off by up to
    3 nats before."""
    cas, ref = _llama4(attention_chunk_size=chunk)
    contexts, continuations = _two_blocks(seed=chunk)
    out = hf_cascade.score(cas, contexts, continuations, max_batch_tokens=budget)
    check_against_reference(out, ref, contexts, continuations)
    assert out.stats["shared_tokens"] >= 12 + 20


def test_generate_with_level0_nodes_of_different_lengths_exact():
    """The same padded prefill served generate(): two prompt groups whose shared prefixes (14 and 21 tokens, chunk 8)
    are prefilled in one forward; the scores were 0.53 off sdpa's."""
    cas, ref = _llama4()
    rand = _rand(torch.Generator().manual_seed(3))
    a, b = rand(14), rand(21)
    ids, mask = pad_batch([a + rand(3), a + rand(5), b + rand(2), b + rand(4)])
    kwargs = dict(max_new_tokens=6, pad_token_id=0, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ours = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                        cascade_options=dict(min_shared_tokens=2), **kwargs)
    theirs = ref.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (x, y) in enumerate(zip(ours.scores, theirs.scores)):
        torch.testing.assert_close(x, y, atol=TOL, rtol=0, msg=f"step {step}")


def test_llama4_temperature_tuning_reads_columns_rows_laid_out_exactly():
    """Llama 4's layers without RoPE scale their queries by floor((column + 1) / floor_scale) (8192 in Llama 4
    Scout; 4 here, so that 25-token rows cross it), read from the cache's columns, not the positions: rows whose
    padded columns would cross another bucket than their positions run in forwards of their own."""
    cas, ref = _llama4(floor_scale=4)
    assert cas.config.attn_temperature_tuning and 0 in cas.config.no_rope_layers
    contexts, continuations = _two_blocks(seed=4)
    out = hf_cascade.score(cas, contexts, continuations)
    check_against_reference(out, ref, contexts, continuations)


def test_eval_harness_chunked_attention_same_as_lm_eval_hf():
    """Through the lm-eval model type: a request differed from lm-eval's ``hf`` by 1.03 nats."""
    lm_eval = pytest.importorskip("lm_eval")  # noqa: F841
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from hf_cascade.eval_harness import CascadeLM
    from hf_cascade.tiny import tiny_model as byte_model
    from hf_cascade.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    cas = byte_model("llama4")
    ref = byte_model("llama4", attn_implementation="sdpa")
    prompts = ["Q: 2 + 2 =", "Q: what is seven plus five, in digits? A:", "Say x:"]
    requests = [Instance("loglikelihood", {}, (p, c), i)
                for i, (p, c) in enumerate((p, c) for p in prompts for c in (" 4", " 12", " x y z"))]
    ours = CascadeLM(cas, tokenizer=tokenizer).loglikelihood(requests)
    theirs = HFLM(ref, tokenizer=tokenizer, batch_size=8).loglikelihood(requests)
    for a, b in zip(ours, theirs):
        assert abs(a[0] - b[0]) < TOL and a[1] == b[1], (a, b)


# ------------------------------------------------------------------ 6. token ids: bytes, bools; own tensors
@pytest.mark.parametrize("context, match", [
    (b"\x05\x06\x07", r"`contexts\[0\]` must be a sequence of int token ids.*got bytes.*\.decode\(\)"),
    (bytearray(b"\x05\x06"), r"`contexts\[0\]` must be a sequence of int token ids.*got bytearray"),
    ([True, False, True], r"`contexts\[0\]` must be a sequence of int token ids.*bools and floats are not token ids"),
    ([5, 6, True], r"`contexts\[0\]` must be a sequence of int token ids.*bools"),
])
def test_bytes_and_bools_are_not_token_ids(context, match):
    """``bytes`` (a sequence of ints to Python) and bools (ints to Python) were scored as token ids."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        hf_cascade.score(model, [context], [[3]])
    with pytest.raises(ValueError, match=match.replace("contexts", "continuations")):
        hf_cascade.score(model, [[5, 6]], [context])


def test_duplicate_pairs_get_their_own_token_logprobs_tensors():
    """Identical pairs are scored once; each returned entry was the same tensor object (changing one changed the
    other)."""
    model, ref = tiny_model("llama"), tiny_model("llama", "sdpa")
    contexts, continuations = [[1, 5, 6, 7]] * 3 + [[1, 9]] * 2, [[8, 9]] * 3 + [[]] * 2
    out = hf_cascade.score(model, contexts, continuations, return_token_logprobs=True)
    check_against_reference(out, ref, contexts, continuations)
    assert out.stats["unique_pairs"] == 2
    entries = out.token_logprobs
    assert len({id(t) for t in entries}) == len(entries)
    assert len({t.data_ptr() for t in entries[:3]}) == 3
    entries[0].zero_()
    assert entries[1].ne(0).all() and entries[2].ne(0).all()


# ------------------------------------------------------------------ 9a. options validated up front
@pytest.mark.parametrize("kwargs, match", [
    ({"min_shared_tokens": "4"}, r"`min_shared_tokens` must be a positive int; got '4' \(str\)"),
    ({"min_shared_tokens": True}, r"`min_shared_tokens` must be a positive int; got True \(bool\)"),
    ({"max_levels": 2.0}, r"`max_levels` must be an int >= 0; got 2.0 \(float\)"),
    ({"return_token_logprobs": "yes"}, r"`return_token_logprobs` must be True or False; got 'yes' \(str\)"),
    ({"add_special_tokens": None}, r"`add_special_tokens` must be True or False; got None \(NoneType\)"),
    ({"progress": "no"}, r"`progress` must be None, True or False; got 'no' \(str\)"),
])
def test_options_validated_before_any_work(kwargs, match):
    """``min_shared_tokens="4"`` raised "'<' not supported between instances of 'str' and 'int'", naming nothing;
    a bool or a float for a count, or a truthy string for a flag, was taken as its value. Now a ValueError naming the
    option and the type it takes, before any forward (``min_shared_tokens=0``, ``max_levels=-1`` and
    ``max_batch_tokens="64"`` were refused before and still are, in the same words as these)."""
    model = tiny_model("llama")
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            hf_cascade.score(model, [[1, 5, 6, 7, 8]] * 2, [[9], [10]], **kwargs)
    finally:
        handle.remove()
    assert forwards == []
