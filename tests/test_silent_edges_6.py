"""The sixth sweep's silent wrong results and unclear errors, each now the reference's answer or a clear error (fp32,
CPU, tiny random models from real configs):

* a CascadeCache of the user's on plain generate() (no ``custom_generate``) with ``position_ids`` other than the
  mask's running count: other tokens (the stored prefix KV were computed at positions 0..P-1); now the ValueError
  the ``custom_generate`` path gives, naming ``position_ids`` (a from_prefix cache's error blamed "-5 zeros" of the
  attention mask);
* ``use_cache=False`` with a CascadeCache on the ``custom_generate`` path: other tokens; now a ValueError;
* ``inputs_embeds`` alone with a from_prefix cache: errors about an ``input_ids`` of width 0 the user never passed;
  now a ValueError naming ``inputs_embeds`` (a planned cache's second turn given as embeddings stays exact);
* context parallelism (gloo, 2 ranks) with a shared prefix: logits processors that read the prompt (n-gram bans, bad
  words) saw the rows relaid ``[prefix | pads | suffix]``: other tokens; now they see the rows as given. Fixed
  buffers smaller than generate()'s ``max_new_tokens`` failed at the step that overran them: now sized before any.
"""

from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.model_zoo import tiny_model
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.transformers_compat import CACHE_KWARG

GEN = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
CUSTOM = dict(custom_generate=hf_cascade.generate, cascade_options=dict(cost_model=None, min_shared_tokens=2))


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama", "sdpa", seed=0), tiny_model("llama", "cascade", seed=0)


def _rows(shared_tokens=13, own=(4, 2, 5)):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 128, (shared_tokens,), generator=g)
    width = shared_tokens + max(own)
    ids, mask = torch.zeros(len(own), width, dtype=torch.long), torch.zeros(len(own), width, dtype=torch.long)
    for row, n in enumerate(own):
        ids[row, width - shared_tokens - n:] = torch.cat([shared, torch.randint(3, 128, (n,), generator=g)])
        mask[row, width - shared_tokens - n:] = 1
    return shared, ids, mask


@pytest.mark.parametrize("offset", [0, 5])
def test_user_cache_on_plain_generate_with_position_ids(models, offset):
    ref, cas = models
    shared, ids, mask = _rows(own=(4, 4, 4))  # (a from_prefix cache takes unpadded rows on the plain path)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) + offset
    want = ref.generate(ids, attention_mask=mask, position_ids=positions, **GEN)
    for cache_inputs in (hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None),
                         {"input_ids": ids, "attention_mask": mask,
                          CACHE_KWARG: CascadeCache.from_prefix(cas, shared)}):
        width = cache_inputs["input_ids"].shape[1]
        if offset == 0:
            got = cas.generate(**cache_inputs, position_ids=positions[:, -width:], **GEN)
            assert torch.equal(got[:, width:], want[:, ids.shape[1]:])
        else:
            with pytest.raises(ValueError, match="position_ids"):
                cas.generate(**cache_inputs, position_ids=positions[:, -width:], **GEN)


def test_use_cache_false_with_a_cascade_cache_is_refused(models):
    _, cas = models
    shared, ids, mask = _rows()
    with pytest.raises(ValueError, match="use_cache=False"):
        cas.generate(ids, attention_mask=mask, use_cache=False, **{CACHE_KWARG: CascadeCache.from_prefix(cas, shared)},
                     **GEN, **CUSTOM)


def test_embeddings_alone_with_a_from_prefix_cache_name_inputs_embeds(models):
    ref, cas = models
    shared, ids, mask = _rows()
    embeds = cas.get_input_embeddings()(ids).detach()
    with pytest.raises(ValueError, match="inputs_embeds"):
        cas.generate(inputs_embeds=embeds, attention_mask=mask, **{CACHE_KWARG: CascadeCache.from_prefix(cas, shared)},
                     **GEN, **CUSTOM)
    # A second turn given as embeddings on the cache a first cascade call returned: the reference's tokens.
    out = dict(return_dict_in_generate=True)
    firsts = [model.generate(ids, attention_mask=mask, **GEN, **out, **extra) for model, extra in
              ((ref, {}), (cas, CUSTOM))]
    more = torch.randint(3, 128, (ids.shape[0], 3), generator=torch.Generator().manual_seed(9))
    ids2 = torch.cat([firsts[0].sequences, more], 1)
    mask2 = torch.cat([mask, torch.ones_like(ids2[:, ids.shape[1]:])], 1)
    seconds = [model.generate(inputs_embeds=model.get_input_embeddings()(ids2).detach(), attention_mask=mask2,
                              **{CACHE_KWARG: getattr(first, CACHE_KWARG)}, **GEN, **extra)
               for model, first, extra in ((ref, firsts[0], {}), (cas, firsts[1], CUSTOM))]
    assert torch.equal(firsts[0].sequences, firsts[1].sequences)
    assert torch.equal(seconds[0], seconds[1])


def _cp_rows():
    g = torch.Generator().manual_seed(209)
    shared = torch.randint(3, 128, (16,), generator=g).tolist() + [5]
    short, long = shared + [5], shared + torch.randint(3, 128, (7,), generator=g).tolist()
    ids, mask = torch.zeros(2, len(long), dtype=torch.long), torch.zeros(2, len(long), dtype=torch.long)
    ids[0, -len(short):], mask[0, -len(short):] = torch.tensor(short), 1
    ids[1], mask[1] = torch.tensor(long), 1
    return ids, mask


def _cp_cases(free: int) -> dict:
    """name -> (context_parallel_inputs options, generate kwargs); ``free``: the short row's first greedy token
    without constraints (banned after the row's last two tokens, which only the rows as given end with)."""
    return {
        "no_repeat_ngram_size, shared prefix": (dict(shared_prefix=True), dict(no_repeat_ngram_size=2)),
        "bad_words_ids, shared prefix": (dict(shared_prefix=True), dict(bad_words_ids=[[5, 5, free]])),
        "fixed buffers smaller than max_new_tokens": (dict(max_new_tokens=3), {}),
    }


def _cp_worker(rank, world, free):
    model = tiny_model("llama", "cascade", seed=0)
    ids, mask = _cp_rows()
    results = {}
    for name, (options, gen) in _cp_cases(free).items():
        inputs = hf_cascade.context_parallel_inputs(model, ids, mask, **options)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0, **gen)
        results[name] = out[:, inputs["input_ids"].shape[1]:]
    return results


@pytest.mark.timeout(300)
def test_context_parallel_processors_see_the_rows_as_given():
    ref = tiny_model("llama", "sdpa", seed=0)
    ids, mask = _cp_rows()
    free = int(ref.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    ranks = run_on_gloo(_cp_worker, 2, args=(free,), timeout_s=280)
    for name, (_, gen) in _cp_cases(free).items():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **gen)
        if "bad_words" in name:
            assert want[0, ids.shape[1]] != free  # (the ban applies)
        for results in ranks:
            assert torch.equal(results[name], want[:, ids.shape[1]:]), name
