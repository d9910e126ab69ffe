"""Context parallelism, the ninth sweep (gloo, 2 ranks, fp32): each silent wrong answer or misleading error now the
single-process reference's answer or a clear error on every rank:

* a shared prefix with ``repetition_penalty``: transformers >= 5.24 skips each row's left padding, counted from
  generate()'s mask, which the relaid ``[prefix | pads | suffix]`` rows made 0: the pad id was penalised (scores
  0.5 off, other tokens); now the rows' padding as given;
* prompt-lookup decoding (``prompt_lookup_num_tokens``) ran transformers' assisted decoding, which fed the whole
  prompt again on top of the prefilled one (logits 3.2 off); now a NotImplementedError, as documented;
* the inputs dict after a call that expanded the rows (``num_beams=2``, ``num_return_sequences=3``): the next call
  with other rows raised "holds 4 rows but the model got a batch of 2"; now every call starts from the prompt's rows;
* ``sequence_bias`` with tuple keys (transformers' documented form): a TypeError from the ranks' argument check;
* a model in training mode with attention dropout: the ring prefill and the decode ran without it; now refused.
"""

from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.parallel._testing import run_on_gloo

GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
CASES = {  # name -> (generate kwargs of the calls, in order, on the same inputs; context_parallel_inputs options)
    "short prompt (a rank without its KV), beams, samples, then greedy": (
        [dict(num_beams=2), dict(do_sample=True, num_return_sequences=3), {}], dict(short=True)),
    "repetition penalty, shared prefix": ([dict(repetition_penalty=1.5)], dict(shared_prefix=True)),
    "sequence bias with tuple keys": ([dict(sequence_bias={(30, 92): -5.0, (108,): 2.0})], {}),
    "beams, then greedy": ([dict(num_beams=2), {}], {}),
    "samples, then beams, then greedy": ([dict(do_sample=True, num_return_sequences=3), dict(num_beams=3), {}],
                                         dict(shared_prefix=True)),
}


def _batch():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 128, (16,), generator=g).tolist()
    rows = [prefix + torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 14, 6)]
    width = max(map(len, rows))
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    return ids, mask


def _worker(rank, world):
    ids, mask = _batch()
    model = tiny_model("llama", "cascade", seed=0)
    results = {}
    for name, (calls, options) in CASES.items():
        rows = (ids[:1, -3:], mask[:1, -3:]) if options.get("short") else (ids, mask)
        inputs = hf_cascade.context_parallel_inputs(model, *rows, **{k: v for k, v in options.items() if k != "short"})
        outs = []
        for extra in calls:
            torch.manual_seed(5)
            out = model.generate(**inputs, **{**GEN, **extra})
            outs.append((out.sequences[:, rows[0].shape[1]:], torch.stack(out.scores)))
        results[name] = outs
    try:
        inputs = hf_cascade.context_parallel_inputs(model, ids[:1], mask[:1])
        model.generate(**inputs, **GEN, prompt_lookup_num_tokens=3)
        results["prompt lookup"] = "ran"
    except NotImplementedError as err:
        results["prompt lookup"] = str(err)
    dropout = tiny_model("llama", "cascade", seed=0, attention_dropout=0.5)
    inputs = hf_cascade.context_parallel_inputs(dropout, ids[:1], mask[:1])  # (in eval mode)
    for name, call in (("dropout prefill", lambda: hf_cascade.context_parallel_inputs(dropout.train(), ids, mask)),
                       ("dropout decode", lambda: dropout.train().generate(**inputs, **GEN))):
        try:
            call()
            results[name] = "ran"
        except NotImplementedError as err:
            results[name] = str(err)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_gloo(_worker, 2, timeout_s=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_as_one_process(ranks, name):
    ids, mask = _batch()
    if CASES[name][1].get("short"):
        ids, mask = ids[:1, -3:], mask[:1, -3:]
    ref = tiny_model("llama", "sdpa", seed=0)
    for call, extra in enumerate(CASES[name][0]):
        torch.manual_seed(5)
        out = ref.generate(input_ids=ids, attention_mask=mask, **{**GEN, **extra})
        want = (out.sequences[:, ids.shape[1]:], torch.stack(out.scores))
        for results in ranks:
            got = results[name][call]
            assert torch.equal(got[0], want[0]), (name, call)
            finite = torch.isfinite(want[1])
            assert torch.equal(finite, torch.isfinite(got[1]))
            assert (got[1] - want[1])[finite].abs().max() <= 1e-4, (name, call)


@pytest.mark.timeout(300)
def test_prompt_lookup_refused_on_every_rank(ranks):
    assert all("greedy search, sampling and beam search" in results["prompt lookup"] for results in ranks), ranks


@pytest.mark.timeout(300)
def test_attention_dropout_in_training_refused_on_every_rank(ranks):
    """model.train() with attention dropout: the ring prefill and the decode have none: refused on every rank."""
    for name in ("dropout prefill", "dropout decode"):
        assert all("attention dropout in training mode" in results[name] for results in ranks), (name, ranks)
