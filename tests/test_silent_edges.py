"""Inputs that used to give wrong tokens without a word: each is now exact or a clear ValueError.

Reference for a ``from_prefix`` cache: sdpa with the same rows, as a tokenizer would pad them.
"""

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import hf_cascade
from hf_cascade import CascadeCache

from test_cache import prefix_batch, random_tokens
from test_generate import make_prompts, model_pair, pad_batch

GEN = dict(max_new_tokens=4, pad_token_id=0, do_sample=False)
P = 9


@pytest.fixture(scope="module")
def pair():
    return model_pair("llama")


def test_masked_prefix_columns_are_refused_with_the_row(pair):
    """Case 1: zeros of attention_mask over the cached prefix's columns (all of them, or a span)."""
    ref, cas = pair
    prefix = random_tokens(P, 0)
    cache = CascadeCache.from_prefix(cas, prefix)
    ids, mask = prefix_batch(prefix, [random_tokens(3, 1), random_tokens(2, 2), random_tokens(4, 3)])
    for masked in (slice(0, P), slice(2, 5)):
        holed = mask.clone()
        holed[1, masked] = 0
        with pytest.raises(ValueError, match=r"Row 1 of this batch does not attend to all 9 prefix columns"):
            cas.generate(ids, attention_mask=holed, past_key_values=cache, **GEN)
        with pytest.raises(ValueError, match=r"Row 1's real tokens do not start with the 9-token prefix.*masked"):
            cas.generate(ids, attention_mask=holed, past_key_values=cache, custom_generate=hf_cascade.generate,
                         **GEN)
    # The same cache still serves a correct batch afterwards.
    got = cas.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
    ref_ids, ref_mask = pad_batch([prefix + s for s in ([*map(int, r[mask[i].bool()][P:])] for i, r in
                                                        enumerate(ids))])
    want = ref.generate(ref_ids, attention_mask=ref_mask, **GEN)
    assert torch.equal(got[:, -4:], want[:, -4:])


def test_cascade_cache_in_a_model_without_cascade_attention(pair):
    """Case 3: a cascade cache given to an sdpa model, or to the same model switched to sdpa."""
    ref, cas = pair
    prefix = random_tokens(P, 4)
    ids, mask = prefix_batch(prefix, [random_tokens(3, 5), random_tokens(2, 6)])
    cache = CascadeCache.from_prefix(cas, prefix)
    with pytest.raises(ValueError, match="did not go through hf_cascade's 'cascade' attention"):
        ref.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
    inputs = hf_cascade.shared_prefix_inputs(cas, *pad_batch(make_prompts(seed=1)), min_shared_tokens=2)
    with pytest.raises(ValueError, match="did not go through hf_cascade's 'cascade' attention"):
        ref.generate(**inputs, **GEN)
    cas.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            cas.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
    finally:
        cas.set_attn_implementation("cascade")
    assert cas.generate(ids, attention_mask=mask, past_key_values=cache, **GEN).shape == (2, ids.shape[1] + 4)


class _Rendezvous(LogitsProcessor):
    """At its first call, signal ``mine`` and wait for ``other`` (makes two generate() calls overlap for sure)."""

    def __init__(self, mine: threading.Event, other: threading.Event | None):
        self.mine, self.other, self.calls = mine, other, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 1:
            self.mine.set()
            if self.other is not None:
                self.other.wait(timeout=30)
        return scores


def test_one_cache_in_two_threads(pair):
    """Case 4: a second generate() on a cache in use makes the first fail clearly; the second is exact. With
    custom_generate=hf_cascade.generate each call gets its own view of the stored prefix: both are exact."""
    ref, cas = pair
    prefix = random_tokens(P, 7)
    ids_a, mask_a = prefix_batch(prefix, [random_tokens(3, 8), random_tokens(5, 9)])
    ids_b, mask_b = prefix_batch(prefix, [random_tokens(4, 10), random_tokens(2, 11)])
    gen = dict(GEN, max_new_tokens=6)
    want = {}
    for name, (ids, mask) in {"a": (ids_a, mask_a), "b": (ids_b, mask_b)}.items():
        rows = [prefix + [int(t) for t in r[m.bool()][P:]] for r, m in zip(ids, mask)]
        ref_ids, ref_mask = pad_batch(rows)
        want[name] = ref.generate(ref_ids, attention_mask=ref_mask, **gen)[:, -6:]

    for one_argument in (False, True):
        cache = CascadeCache.from_prefix(cas, prefix)
        a_mid, b_mid = threading.Event(), threading.Event()
        results, errors = {}, {}
        extra = dict(custom_generate=hf_cascade.generate) if one_argument else {}

        def run(name, ids, mask, processor):
            try:
                results[name] = cas.generate(ids, attention_mask=mask, past_key_values=cache,
                                             logits_processor=LogitsProcessorList([processor]), **gen, **extra)
            except ValueError as err:
                errors[name] = err

        thread_a = threading.Thread(target=run, args=("a", ids_a, mask_a, _Rendezvous(a_mid, b_mid)))
        thread_a.start()
        assert a_mid.wait(timeout=60)  # A has prefilled and decoded one step; B starts now
        run("b", ids_b, mask_b, _Rendezvous(b_mid, None))
        thread_a.join(timeout=60)
        assert torch.equal(results["b"][:, -6:], want["b"])
        if one_argument:
            assert not errors and torch.equal(results["a"][:, -6:], want["a"])
        else:
            assert "a" not in results
            assert "at the same time" in str(errors["a"])


def test_two_threads_never_share_kept_step_buffers(pair):
    """Fixed buffers come from the model's StepBuffers (kept between calls): two overlapping calls with the same
    shapes, after a call that left its buffers there, must not get the same ones. Both are exact."""
    ref, cas = pair
    prefix = random_tokens(P, 17)
    batches = {name: pad_batch([prefix + random_tokens(n, seed) for n, seed in rows])
               for name, rows in {"a": [(3, 18), (5, 19)], "b": [(4, 20), (2, 21)]}.items()}
    gen = dict(GEN, max_new_tokens=6)
    options = dict(custom_generate=hf_cascade.generate, cascade_options=dict(min_shared_tokens=2, fixed_buffers=True))
    want = {name: ref.generate(ids, attention_mask=mask, **gen) for name, (ids, mask) in batches.items()}
    cas.generate(*batches["a"][:1], attention_mask=batches["a"][1], **gen, **options)  # leaves its buffers
    a_mid, b_mid = threading.Event(), threading.Event()
    results, caches = {}, {"a": [], "b": []}

    def run(name, processor):
        ids, mask = batches[name]
        results[name] = cas.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([processor]),
                                     cascade_caches=caches[name], **gen, **options)

    thread_a = threading.Thread(target=run, args=("a", _Rendezvous(a_mid, b_mid)))
    thread_a.start()
    assert a_mid.wait(timeout=60)
    run("b", _Rendezvous(b_mid, None))
    thread_a.join(timeout=60)
    for name in ("a", "b"):
        assert torch.equal(results[name], want[name]), name
    held = [{t.data_ptr() for t in caches[name][0].step_buffer_tensors()} for name in ("a", "b")]
    assert not held[0] & held[1]


def test_tokenizer_left_padded_batch_on_a_from_prefix_cache(pair):
    """Case 5: rows as a tokenizer pads them, [pads | prefix | suffix]: refused by plain generate(), exact through
    custom_generate=hf_cascade.generate."""
    ref, cas = pair
    prefix = random_tokens(P, 12)
    rows = [prefix + random_tokens(n, 13 + n) for n in (1, 4, 2, 6)]
    ids, mask = pad_batch(rows)
    cache = CascadeCache.from_prefix(cas, prefix)
    with pytest.raises(ValueError, match="Row 0 of this batch does not attend .*custom_generate=hf_cascade.generate"):
        cas.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
    want = ref.generate(ids, attention_mask=mask, **GEN)
    got = cas.generate(ids, attention_mask=mask, past_key_values=cache, custom_generate=hf_cascade.generate, **GEN)
    assert torch.equal(got, want)


def test_rows_not_starting_with_the_cached_prefix(pair):
    """Case 6: a row whose first real tokens are another prefix is refused with its index."""
    _, cas = pair
    prefix = random_tokens(P, 14)
    other = random_tokens(P, 15)
    ids, mask = pad_batch([prefix + [5, 6], other + [7], prefix + [9]])
    cache = CascadeCache.from_prefix(cas, prefix)
    with pytest.raises(ValueError, match="Row 1's real tokens do not start with the 9-token prefix"):
        cas.generate(ids, attention_mask=mask, past_key_values=cache, custom_generate=hf_cascade.generate, **GEN)


def test_outputs_are_as_wide_as_the_input(pair):
    """Case 7: shared_prefix_inputs keeps the user's rows, so out[:, L:] are exactly the new tokens."""
    ref, cas = pair
    rows = make_prompts(seed=16, groups=3, per_group=2)
    ids, mask = pad_batch(rows)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2)
    assert inputs["input_ids"].shape == ids.shape
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["attention_mask"], mask)
    got = cas.generate(**inputs, **GEN)
    want = ref.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got[:, ids.shape[1]:], want[:, ids.shape[1]:])


def test_fixed_buffers_too_small_are_refused_before_any_work(pair):
    _, cas = pair
    ids, mask = pad_batch(make_prompts(seed=17))
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=2)
    forwards = []
    handle = cas.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="max_new_tokens=5"):
            cas.generate(**inputs, max_new_tokens=5, pad_token_id=0, custom_generate=hf_cascade.generate)
    finally:
        handle.remove()
    assert forwards == []
