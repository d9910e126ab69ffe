"""The context-parallel default decode path, on CPU/gloo (2 ranks), fp32, against single-process sdpa.

On CUDA ``context_parallel_inputs`` hands generate() :func:`~hf_cascade.parallel.generation.context_parallel_generate`,
which records each decode step into a CUDA graph with the decoder layers compiled (the combine inside the recorded
op). CUDA graphs need a GPU, so here every one-token forward runs the path a recorded step takes, eagerly: inside
``static_step_mode()`` with the layers compiled (``compiled_layers``: inductor), as ``CapturedDecodeStep`` runs a step
before recording it (the GPU run of the same path: ``benchmarks/bench_context_parallel.py``'s ``check_fp32``). Plus
the blocks' other kernel (``kernels="fused"``: PyTorch's flash kernel, here its CPU build), the rank-0 score
broadcast, the per-call RNG sync, and the kernels' own checks (fused attention, N-way merge).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.ops.fused_attention import fused_attention, fused_attention_applies
from hf_cascade.ops.merge_states import merge_states
from hf_cascade.ops.reference import fused_attention_ref, merge_states_ref
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.parallel.generation import context_parallel_generate, decode_buffer_tokens
from hf_cascade.transformers_compat import CACHE_KWARG
from test_captured_step import _in_decode_steps

GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
           output_logits=True)


def _batch(vocab: int):
    """Two rows of 29 tokens, the second left-padded by 5 (the prompt's padding reaches the row shards' masks)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 29), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def _recorded_path_worker(rank, world):
    from hf_cascade.decode.captured_step import static_step_mode
    from hf_cascade.compiled_layers import compiled_layers, layer_compilations

    model = tiny_model("llama", "cascade", seed=0)
    ids, mask = _batch(model.config.vocab_size)
    results = {}
    for kernels in ("suffix", "fused"):
        inputs = hf_cascade.context_parallel_inputs(model, ids, mask, max_new_tokens=8, kernels=kernels)
        assert inputs["custom_generate"] is context_parallel_generate

        def layers_compiled(kwargs):
            return compiled_layers(model, kwargs[CACHE_KWARG])

        layers_compiled.takes_inputs = True
        before = layer_compilations(model)
        with _in_decode_steps(model, static_step_mode, layers_compiled) as entered:
            out = model.generate(**inputs, **GEN)
        results[kernels] = dict(sequences=out.sequences, logits=torch.stack(out.logits), steps=len(entered),
                                compiled_steps=layer_compilations(model) - before)
    return results


def test_recorded_step_path_with_compiled_layers_matches_sdpa():
    ref = tiny_model("llama", "sdpa", seed=0)
    ids, mask = _batch(ref.config.vocab_size)
    want = ref.generate(ids, attention_mask=mask, **GEN)
    for rank, results in enumerate(run_on_gloo(_recorded_path_worker, 2, timeout_s=300, start_method="spawn")):
        for kernels, got in results.items():
            # Every one-token forward (the last prompt token's and the decode steps) took the recorded path.
            assert got["steps"] == GEN["max_new_tokens"] and got["compiled_steps"] == got["steps"], (rank, kernels)
            assert torch.equal(got["sequences"], want.sequences), (rank, kernels)
            torch.testing.assert_close(got["logits"], torch.stack(want.logits), atol=1e-4, rtol=0)


class _RankNoise(LogitsProcessor):
    """A user's processor whose output differs by rank: what rounding differences between ranks look like."""

    def __call__(self, input_ids, scores):
        import torch.distributed as dist

        g = torch.Generator().manual_seed(1000 * dist.get_rank() + input_ids.shape[1])
        return scores + 5.0 * torch.randn(scores.shape, generator=g)


def _hidden_states_worker(rank, world):
    model = tiny_model("llama", "cascade", seed=0)
    ids, mask = _batch(model.config.vocab_size)
    inputs = hf_cascade.context_parallel_inputs(model, ids, mask)
    try:
        model.generate(**inputs, max_new_tokens=2, output_hidden_states=True, return_dict_in_generate=True)
    except ValueError as err:
        return str(err)
    return None


def test_hidden_states_are_refused_not_narrowed():
    for message in run_on_gloo(_hidden_states_worker, 2, timeout_s=300, start_method="spawn"):
        assert message is not None and "output_hidden_states" in message and "shard" in message


def _same_tokens_worker(rank, world):
    model = tiny_model("llama", "cascade", seed=0)
    ids, mask = _batch(model.config.vocab_size)
    inputs = hf_cascade.context_parallel_inputs(model, ids, mask)
    greedy = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0,
                            logits_processor=[_RankNoise()])
    torch.manual_seed(100 + rank)  # a per-rank seed after context_parallel_inputs (set_seed(..., device_specific))
    sampled = model.generate(**inputs, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    return greedy, sampled


def test_every_rank_gets_rank_zeros_tokens_whatever_its_scores_and_seed():
    (g0, s0), (g1, s1) = run_on_gloo(_same_tokens_worker, 2, timeout_s=300, start_method="spawn")
    assert torch.equal(g0, g1) and torch.equal(s0, s1)


@pytest.mark.parametrize("causal,lq,lk", [(True, 37, 37), (False, 5, 29), (False, 1, 100), (False, 3, 0)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (3, 3)])
def test_fused_attention_matches_its_reference(causal, lq, lk, heads, kv_heads):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(2, heads, lq, 24, generator=g)
    k, v = (torch.randn(2, kv_heads, lk, 24, generator=g) for _ in range(2))
    assert fused_attention_applies(q, k)
    out, lse = fused_attention(q, k, v, scale=0.3, causal=causal)
    ref_out, ref_lse = fused_attention_ref(q, k, v, scale=0.3, causal=causal)
    assert out.shape == (2, heads, lq, 24) and lse.shape == (2, heads, lq) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_fused_attention_refuses_what_it_cannot_compute():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 3, 3, 8)  # 4 query heads over 3 KV heads
    assert not fused_attention_applies(q, k)
    assert not fused_attention_applies(q, q, mask=torch.ones(1, 3, 3, dtype=torch.bool))
    assert not fused_attention_applies(q, q, softcap=30.0)
    with pytest.raises(ValueError, match="suffix_attention"):
        fused_attention(q, k, k, scale=1.0, causal=False)
    with pytest.raises(ValueError, match="Lq == Lk"):
        fused_attention(q, q[:, :, :2], q[:, :, :2], scale=1.0, causal=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n,rows,d", [(4, 32, 128), (3, 7, 24), (1, 5, 40)])
def test_merge_states_reads_an_all_gather_buffer_in_place(backend, n, rows, d):
    g = torch.Generator().manual_seed(n * rows + d)
    buffer = torch.randn(n, rows * d + rows, generator=g)  # rank rows [out | lse], as combine_all_gather gathers
    outs, lses = buffer[:, :rows * d].view(n, rows, d), buffer[:, rows * d:].view(n, rows)
    lses.mul_(3)
    lses[0, 0] = float("-inf")  # an empty state: its out is ignored, even NaN
    outs[0, 0] = float("nan")
    lses[:, -1] = float("-inf")  # a row no state has keys for: out 0, lse -inf
    out, lse = merge_states(outs, lses, backend=backend)
    ref_out, ref_lse = merge_states_ref(outs, lses)
    assert out.dtype == torch.float32 and out.shape == (rows, d)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)
    assert lse[-1] == float("-inf") and torch.all(out[-1] == 0)
    low, _ = merge_states(outs, lses, out_dtype=torch.bfloat16, backend=backend)  # (the interpreter may truncate)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref_out, atol=1e-2, rtol=1e-2)


def test_decode_buffers_come_in_power_of_two_buckets():
    assert [decode_buffer_tokens(n) for n in (1, 32, 33, 64, 100, 1000)] == [32, 32, 64, 64, 128, 1024]


def test_decode_step_option_is_checked_before_any_collective():
    model = tiny_model("llama", "cascade")
    with pytest.raises(ValueError, match="decode_step"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[1, 2]]), decode_step="recorded")
    with pytest.raises(ValueError, match="all_gather_kv"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[1, 2]]), combine="all_gather_kv",
                                           decode_step="layers")
