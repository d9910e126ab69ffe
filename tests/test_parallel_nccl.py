"""Context parallelism on 2 GPUs joined by NCCL == one GPU's reference generate(), fp32 tiny models.

The gloo tests (test_parallel_generate.py, test_silent_edges_5.py) check the math on CPU; these run the same calls
where users run them: CUDA tensors, NCCL collectives, the Triton kernels, the default decode step. Cases: a plain
GQA prompt, a left-padded batch, the cascade composition (a shared prefix sharded), GPT-OSS's attention sinks merged
into the combined state, and the refusals that must come before any step (a Llama 4 chunk crossed by the prompt, a
sliding window crossed by the new tokens).

Run on a 2-GPU device machine: ``python -m pytest -m gpu tests/test_parallel_nccl.py``.
"""

from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import available_families, reference_attention, tiny_model
from hf_cascade.parallel._testing import run_on_gloo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
# name -> (family, config overrides, row lengths, shared leading tokens, context_parallel_inputs options, generate kw)
CASES = {
    "llama prompt of 29 tokens": ("llama", {}, [29], 0, {}, {}),
    "qwen3 left-padded batch": ("qwen3", {}, [21, 9, 14], 0, {}, {}),
    "llama shared prefix sharded": ("llama", {}, [24, 27, 22], 19, dict(shared_prefix=True), {}),
    "gpt_oss sinks": ("gpt_oss", dict(sliding_window=4096), [21], 0, {}, {}),
    "llama4 chunk crossed by the prompt": ("llama4", {}, [21], 0, {}, {}),
    "gemma3 window crossed by the new tokens": ("gemma3", {}, [5], 0, {}, dict(max_new_tokens=5)),
}


def _batch(lengths, shared, seed=7):
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, 128, (shared,), generator=g)
    rows = [torch.cat([common, torch.randint(3, 128, (n - shared,), generator=g)]) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def _cp_worker(rank, world, device_type="cuda"):
    results = {}
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    for name, (family, overrides, lengths, shared, options, gen) in CASES.items():
        if family not in available_families():
            continue
        model = tiny_model(family, "cascade", seed=0, device=device, **overrides)
        ids, mask = (t.to(device) for t in _batch(lengths, shared))
        try:
            inputs = hf_cascade.context_parallel_inputs(model, ids, mask, **options)
            out = model.generate(**inputs, **{**GEN, **gen})
            results[name] = (out.sequences[:, inputs["input_ids"].shape[1]:].cpu(), torch.stack(out.logits).cpu())
        except NotImplementedError as err:
            results[name] = str(err)
    return results


@pytest.fixture(scope="module")
def nccl_results():
    return run_on_gloo(_cp_worker, 2, timeout_s=280, backend="nccl")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_on_nccl_matches_one_gpu(nccl_results, name):
    family, overrides, lengths, shared, _, gen = CASES[name]
    if family not in available_families():
        pytest.skip(f"no {family} config in this transformers")
    ranks = [results[name] for results in nccl_results]
    if "chunk crossed" in name:
        assert all(isinstance(r, str) and "attention chunks of 8 tokens" in r for r in ranks), ranks
        return
    if "window crossed" in name:
        assert all(isinstance(r, str) and "sliding window of 8 tokens and this call reaches 9" in r for r in ranks)
        return
    assert not isinstance(ranks[0], str), ranks[0]
    ref = tiny_model(family, reference_attention(family), seed=0, device="cuda:0", **overrides)
    ids, mask = (t.to("cuda:0") for t in _batch(lengths, shared))
    want = ref.generate(ids, attention_mask=mask, **{**GEN, **gen})
    for new, logits in ranks:
        assert torch.equal(new, want.sequences[:, ids.shape[1]:].cpu())
        torch.testing.assert_close(logits, torch.stack(want.logits).cpu(), atol=1e-4, rtol=0)
