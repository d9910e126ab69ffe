"""Compiled context-parallel decode on CPU/gloo (2 and 4 ranks): fixed decode buffers == sdpa, fp32.

``context_parallel_inputs(..., max_new_tokens=N)`` makes the cache compileable; generate() then compiles the decode
step (here forced on CPU: ``aot_eager``, ``fullgraph=True``, so any graph break fails), and the per-layer combine
runs functional collectives inside the graph. Every scenario runs twice on every rank, eagerly
(``disable_compile=True``) and compiled; both must give sdpa's tokens (one process, whole KV). Tiny random Llama /
Qwen3 models (GQA: 4 query heads, 2 KV heads, 2 layers; Llama-3-8B: 32/8, 32 layers). Logit tolerance 1e-4 (fp32;
the combine and merges reorder a few roundings).
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.transformers_compat import CACHE_KWARG
from test_parallel_generate import MAX_NEW, _generate_kwargs, _left_pad, _rows

LOGIT_TOL = 1e-4
WORLD = 2

# name -> (family, row lengths, shared leading tokens, context_parallel_inputs options, generate kwargs)
SCENARIOS = {
    # 22 prefilled tokens (divisible by neither 2N = 4 nor 8); default combine ("all_gather").
    "llama_all_gather_odd_length": ("llama", [23], 0, {}, {}),
    "qwen3_tree_left_padded_batch": ("qwen3", [17, 9, 12], 0, dict(combine="tree"), {}),
    "qwen3_all_to_all_left_padded_batch": ("qwen3", [17, 9, 12], 0, dict(combine="all_to_all"), {}),
    # 13 shared tokens prefilled once and sharded; the rows' suffixes on one rank; decode buffers on all.
    "llama_shared_prefix": ("llama", [16, 18, 15], 13, dict(shared_prefix=True), {}),
    # Fewer prompt tokens than 2N: rank 1 holds no prompt KV at all.
    "llama_two_token_prompt": ("llama", [2], 0, {}, {}),
    # Beams reorder the decode buffers in place every step. transformers' beam search never compiles (its loop
    # calls the model eagerly): this checks the eager fixed-buffer path with batch expansion and reordering.
    "qwen3_beam_search": ("qwen3", [19, 14], 0, {}, dict(num_beams=2)),
}


def cpu_compile_config():
    config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def _compiled_worker(rank, world):
    from torch._dynamo.utils import counters

    results, models = {}, {}
    for name, (family, lengths, shared, options, extra) in SCENARIOS.items():
        model = models.setdefault(family, tiny_model(family, "cascade", seed=0))
        ids, mask = _left_pad(_rows(lengths, seed=sum(lengths), shared=shared))
        inputs = hf_cascade.context_parallel_inputs(model, ids, mask, max_new_tokens=MAX_NEW, **options)
        cache = inputs[CACHE_KWARG]
        start = inputs["input_ids"].shape[1]
        eager = model.generate(**inputs, disable_compile=True, **_generate_kwargs(extra))
        torch._dynamo.reset()  # each scenario traces its own graph (else an earlier dynamic one may serve it)
        graphs_before = counters["stats"]["unique_graphs"]
        compiled = model.generate(**inputs, compile_config=cpu_compile_config(), **_generate_kwargs(extra))
        graphs_after = counters["stats"]["unique_graphs"]
        buffer = cache.layers[0].decode.keys.data_ptr()
        again = model.generate(**inputs, compile_config=cpu_compile_config(), **_generate_kwargs(extra))
        results[name] = dict(
            eager=eager.sequences[:, start:],
            compiled=compiled.sequences[:, start:],
            again=again.sequences[:, start:],
            logits=None if extra else torch.stack(compiled.logits),
            compileable=cache.is_compileable,
            compiled_call=hasattr(model, "_compiled_call"),
            new_graphs=graphs_after - graphs_before,
            graphs_again=counters["stats"]["unique_graphs"] - graphs_after,
            same_buffers=cache.layers[0].decode.keys.data_ptr() == buffer,
            counts=cache.rank_token_counts(),
            prompt_columns=cache._prompt_length,
        )
    # Buffers smaller than generate()'s max_new_tokens: resized before the first step (the same tokens as a growing
    # cache's), not an error at the step that would overrun them.
    ids, mask = _left_pad(_rows([11], seed=11))
    model = models["llama"]
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, disable_compile=True)
    inputs = hf_cascade.context_parallel_inputs(model, ids, mask, max_new_tokens=2)
    results["too_small"] = model.generate(**inputs, **gen)[:, inputs["input_ids"].shape[1]:]
    results["too_small_buffers"] = inputs[CACHE_KWARG].max_new_tokens
    growing = hf_cascade.context_parallel_inputs(model, ids, mask)
    results["growing_compileable"] = growing[CACHE_KWARG].is_compileable
    results["growing"] = model.generate(**growing, **gen)[:, growing["input_ids"].shape[1]:]
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def cp_results(request):
    return run_on_gloo(_compiled_worker, request.param, timeout_s=300, start_method="spawn")


@pytest.fixture(scope="module")
def references():
    refs, models = {}, {}
    for name, (family, lengths, shared, _, extra) in SCENARIOS.items():
        model = models.setdefault(family, tiny_model(family, "sdpa", seed=0))
        ids, mask = _left_pad(_rows(lengths, seed=sum(lengths), shared=shared))
        out = model.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs(extra))
        refs[name] = dict(new_tokens=out.sequences[:, ids.shape[1]:], logits=torch.stack(out.logits))
    return refs


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compiled_context_parallel_decode_matches_sdpa(cp_results, references, name):
    ref = references[name]
    for rank in range(len(cp_results)):
        got = cp_results[rank][name]
        assert got["compileable"] and got["compiled_call"], f"rank {rank}: generate() did not compile the step"
        if "num_beams" not in SCENARIOS[name][4]:
            # One graph: traced once, then every decode step replays it (nothing in it changes per step).
            assert got["new_graphs"] == 1, f"rank {rank}: {got['new_graphs']} graphs traced"
        assert torch.equal(got["eager"], ref["new_tokens"]), f"rank {rank}: eager fixed buffers differ from sdpa"
        assert torch.equal(got["compiled"], ref["new_tokens"]), f"rank {rank}: compiled decode differs from sdpa"
        assert torch.equal(got["again"], ref["new_tokens"]), f"rank {rank}: second compiled call differs"
        if got["logits"] is not None:
            err = (got["logits"] - ref["logits"]).abs().max().item()
            assert err < LOGIT_TOL, f"rank {rank}: compiled logits differ by {err}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_second_generate_reuses_graph_and_buffers(cp_results, name):
    for rank in range(len(cp_results)):
        got = cp_results[rank][name]
        assert got["graphs_again"] == 0, f"rank {rank}: the second generate() recompiled"
        assert got["same_buffers"], f"rank {rank}: the decode buffers moved"


def test_decode_tokens_are_spread_round_robin(cp_results):
    for rank in range(len(cp_results)):
        got = cp_results[rank]["llama_all_gather_odd_length"]
        assert got["counts"] == cp_results[0]["llama_all_gather_odd_length"]["counts"]
        # 22 prompt columns + the 6 tokens generate() fed (the last prompt token and 5 generated ones).
        assert sum(got["counts"]) == got["prompt_columns"] + MAX_NEW
        # Balanced: zigzag end padding (< 2N) + one round-robin token.
        assert max(got["counts"]) - min(got["counts"]) <= 2 * len(cp_results) + 1


def test_too_small_buffers_and_growing_cache(cp_results):
    for rank in range(len(cp_results)):
        assert cp_results[rank]["too_small_buffers"] >= 4  # (resized from 2)
        assert torch.equal(cp_results[rank]["too_small"], cp_results[rank]["growing"])
        assert cp_results[rank]["growing_compileable"] is False


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "6"])
def test_bad_max_new_tokens(bad):
    # Checked before any collective (no process group needed to see it).
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_cascade.context_parallel_inputs(tiny_model("llama", "cascade"), torch.tensor([[1, 2]]), max_new_tokens=bad)


def test_all_gather_kv_has_no_fixed_buffers():
    with pytest.raises(ValueError, match="all_gather_kv"):
        hf_cascade.context_parallel_inputs(tiny_model("llama", "cascade"), torch.tensor([[1, 2]]),
                                           combine="all_gather_kv", max_new_tokens=4)


# ----------------------------------------------------------------------------- the combines, traced alone
def _combine_worker(rank, world):
    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel.combine import STATE_COMBINES, combine_states

    torch._dynamo.reset()
    info = resolve_group()
    g = torch.Generator().manual_seed(rank)
    out = torch.randn(2, 3, 1, 8, generator=g)  # [B, H (not a multiple of 2), Lq, D]
    lse = torch.randn(2, 3, 1, generator=g)
    lse[0, 0] = float("-inf")  # an empty state on this rank for one (row, head)
    errors = {}
    for method in STATE_COMBINES:
        want = combine_states(out, lse, info, method)
        fn = torch.compile(lambda o, s, m=method: combine_states(o, s, info, m), backend="aot_eager", fullgraph=True)
        got = fn(out, lse)
        errors[method] = max((got[0] - want[0]).abs().max().item(), (got[1] - want[1]).abs().max().item())
    return errors


def test_combines_trace_with_functional_collectives():
    """Each combine under torch.compile(fullgraph=True) (functional collectives) == its eager torch.distributed form."""
    for errors in run_on_gloo(_combine_worker, WORLD, timeout_s=300, start_method="spawn"):
        assert all(err <= 1e-6 for err in errors.values()), errors
