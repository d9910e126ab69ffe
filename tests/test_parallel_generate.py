"""Context-parallel generate() on CPU/gloo (2 and 4 ranks) == single-process sdpa generate(), fp32.

Tiny random Llama / Qwen3 models (GQA: 4 query heads, 2 KV heads, 2 layers; Llama-3-8B: 32/8, 32 layers).
One spawn per world size runs every scenario; the workers return tokens, logits and cache sizes, and the tests
compare them with the reference computed here. Tolerance on logits: 1e-4 (fp32; observed ~2e-6).
"""

from __future__ import annotations

import time

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.transformers_compat import CACHE_KWARG

LOGIT_TOL = 1e-4
MAX_NEW = 6


def _rows(lengths, seed, shared=0):
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(3, 128, (shared,), generator=g).tolist()
    return [common + torch.randint(3, 128, (n - shared,), generator=g).tolist() for n in lengths]


def _left_pad(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


# name -> (family, row lengths, shared leading tokens, context_parallel_inputs options, generate kwargs)
SCENARIOS = {
    # Prompt of 23 tokens: 22 prefilled, divisible by neither 2N = 4 nor 8.
    "llama_tree_odd_length": ("llama", [23], 0, dict(combine="tree"), {}),
    "llama_all_to_all_odd_length": ("llama", [23], 0, dict(combine="all_to_all"), {}),
    "llama_all_gather_kv_baseline": ("llama", [23], 0, dict(combine="all_gather_kv"), {}),
    "llama_all_gather_odd_length": ("llama", [23], 0, dict(combine="all_gather"), {}),
    # No `combine`: the default ("all_gather").
    "qwen3_default_combine_left_padded_batch": ("qwen3", [17, 9, 12], 0, {}, {}),
    "qwen3_tree_left_padded_batch": ("qwen3", [17, 9, 12], 0, dict(combine="tree"), {}),
    "qwen3_all_to_all_left_padded_batch": ("qwen3", [17, 9, 12], 0,
                                           dict(combine="all_to_all", placement="round_robin"), {}),
    # Fewer prompt tokens than ranks: some ranks hold nothing; a 1-token prompt prefills nothing.
    "llama_two_token_prompt": ("llama", [2], 0, dict(combine="tree"), {}),
    "llama_one_token_prompt": ("llama", [1], 0, dict(combine="all_to_all"), {}),
    "llama_all_gather_two_token_prompt": ("llama", [2], 0, dict(combine="all_gather"), {}),
    # Cascade composition: 13 shared tokens prefilled once and sharded, per-row suffixes local.
    "llama_shared_prefix": ("llama", [16, 18, 15], 13, dict(combine="all_to_all", shared_prefix=True), {}),
    "llama_shared_prefix_all_gather": ("llama", [16, 18, 15], 13, dict(combine="all_gather", shared_prefix=True),
                                       {}),
    "qwen3_beam_search": ("qwen3", [19, 14], 0, dict(combine="tree"), dict(num_beams=2)),
    "qwen3_beam_search_all_gather": ("qwen3", [19, 14], 0, dict(combine="all_gather"), dict(num_beams=2)),
    # The prefill in rounds (prefill_chunk_tokens columns per rank at a time): every round after the first
    # attends to the keys all ranks stored in the earlier ones. 2 columns per rank: 2-3 rounds on 4 ranks.
    "llama_rounds_odd_length": ("llama", [23], 0, dict(prefill_chunk_tokens=2), {}),
    "qwen3_rounds_left_padded_batch": ("qwen3", [17, 9, 12], 0, dict(prefill_chunk_tokens=2, combine="tree"), {}),
    "llama_rounds_shared_prefix": ("llama", [16, 18, 15], 13, dict(shared_prefix=True, prefill_chunk_tokens=4), {}),
    "qwen3_rounds_beam_search": ("qwen3", [19, 14], 0, dict(prefill_chunk_tokens=2), dict(num_beams=2)),
}
SAMPLING = ("llama", [21, 15], 0, dict(combine="tree"), dict(do_sample=True, top_k=20, num_return_sequences=2))
SAMPLING_ALL_GATHER = ("llama", [21, 15], 0, dict(combine="all_gather"),
                       dict(do_sample=True, top_k=20, num_return_sequences=2))


def _generate_kwargs(extra):
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True)
    kwargs.update(extra)
    return kwargs


def _generate_worker(rank, world):
    results = {}
    models = {}
    scenarios = {**SCENARIOS, "sampling": SAMPLING, "sampling_all_gather": SAMPLING_ALL_GATHER,
                 "sampling_seed7": SAMPLING_ALL_GATHER}
    for name, (family, lengths, shared, options, extra) in scenarios.items():
        model = models.setdefault(family, tiny_model(family, "cascade", seed=0))
        ids, mask = _left_pad(_rows(lengths, seed=sum(lengths), shared=shared))
        if name == "sampling_seed7":  # rank 0 seeded as the sdpa reference is; the others' seeds must not matter
            torch.manual_seed(7 if rank == 0 else 1000 + rank)
        elif name.startswith("sampling"):
            torch.manual_seed(100 + rank)  # different seeds: context_parallel_inputs must sync them
        inputs = hf_cascade.context_parallel_inputs(model, ids, mask, **options)
        cache = inputs[CACHE_KWARG]
        prompt_nbytes = cache.nbytes
        out = model.generate(**inputs, **_generate_kwargs(extra))
        again = model.generate(**inputs, **_generate_kwargs(extra)) if name == "llama_tree_odd_length" else None
        results[name] = dict(
            sequences=out.sequences,
            new_tokens=out.sequences[:, inputs["input_ids"].shape[1]:],
            logits=torch.stack(out.logits) if not extra else None,
            prompt_nbytes=prompt_nbytes,
            counts=cache.rank_token_counts(),
            combine=cache.combine,
            again=None if again is None else again.sequences,
        )
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def cp_results(request):
    return request.param, run_on_gloo(_generate_worker, request.param, timeout_s=300)


@pytest.fixture(scope="module")
def references():
    refs, models = {}, {}
    for name, (family, lengths, shared, _, extra) in SCENARIOS.items():
        model = models.setdefault(family, tiny_model(family, "sdpa", seed=0))
        assert model.config._attn_implementation == "sdpa"
        ids, mask = _left_pad(_rows(lengths, seed=sum(lengths), shared=shared))
        out = model.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs(extra))
        refs[name] = dict(new_tokens=out.sequences[:, ids.shape[1]:], logits=torch.stack(out.logits),
                          prompt_tokens=(ids.shape[1] - 1) * len(lengths), config=model.config)
    return refs


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_context_parallel_generate_matches_sdpa(cp_results, references, name):
    world, results = cp_results
    ref = references[name]
    for rank in range(world):
        got = results[rank][name]
        assert torch.equal(got["new_tokens"], ref["new_tokens"]), f"rank {rank}: tokens differ from sdpa"
        assert torch.equal(got["sequences"], results[0][name]["sequences"]), f"rank {rank} differs from rank 0"
        if got["logits"] is not None:
            err = (got["logits"] - ref["logits"]).abs().max().item()
            assert err < LOGIT_TOL, f"rank {rank}: logits differ by {err}"


def test_all_gather_tree_and_all_to_all_agree(cp_results):
    world, results = cp_results
    for rank in range(world):
        for a, b in (("llama_tree_odd_length", "llama_all_to_all_odd_length"),
                     ("llama_tree_odd_length", "llama_all_gather_odd_length"),
                     ("qwen3_tree_left_padded_batch", "qwen3_all_to_all_left_padded_batch"),
                     ("qwen3_tree_left_padded_batch", "qwen3_default_combine_left_padded_batch"),
                     ("llama_shared_prefix", "llama_shared_prefix_all_gather")):
            assert torch.equal(results[rank][a]["sequences"], results[rank][b]["sequences"]), (a, b)
            assert (results[rank][a]["logits"] - results[rank][b]["logits"]).abs().max() < LOGIT_TOL, (a, b)


def test_default_combine_is_all_gather(cp_results):
    world, results = cp_results
    assert all(results[rank]["qwen3_default_combine_left_padded_batch"]["combine"] == "all_gather"
               for rank in range(world))


@pytest.mark.parametrize("name", ["llama_tree_odd_length", "qwen3_tree_left_padded_batch", "llama_shared_prefix",
                                  "llama_rounds_odd_length", "qwen3_rounds_left_padded_batch",
                                  "llama_rounds_shared_prefix"])
def test_each_rank_holds_about_one_nth_of_the_prompt_kv(cp_results, references, name):
    world, results = cp_results
    config = references[name]["config"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * 4 * config.num_hidden_layers  # K and V, fp32, all layers
    family, lengths, shared, _, _ = SCENARIOS[name]
    nbytes = [results[rank][name]["prompt_nbytes"] for rank in range(world)]
    if shared:
        # The shared prefix is stored once (no batch dim) and sharded; the suffixes (all but the last token) once.
        width = max(lengths) - shared
        assert sum(nbytes) == per_token * (shared + len(lengths) * (width - 1))
        prefix_share = per_token * -(-shared // (2 * world)) * 2
        assert sorted(nbytes)[-2] <= prefix_share  # only the suffix owner holds more than its prefix shard
        return
    total = per_token * references[name]["prompt_tokens"]
    assert sum(nbytes) == total, "every prompt key must be stored exactly once over the ranks"
    rows, prefilled = len(lengths), references[name]["prompt_tokens"] // len(lengths)
    bound = per_token * rows * 2 * -(-prefilled // (2 * world))  # 2 zigzag chunks
    assert max(nbytes) <= bound and max(nbytes) <= total / world + per_token * rows * 2 * world
    # Decode tokens keep the shards balanced.
    counts = results[0][name]["counts"]
    assert max(counts) - min(counts) <= 2 * world + 1


@pytest.mark.parametrize("name", ["sampling", "sampling_all_gather"])
def test_sampling_gives_the_same_tokens_on_every_rank(cp_results, name):
    world, results = cp_results
    seqs = [results[rank][name]["sequences"] for rank in range(world)]
    assert seqs[0].shape[0] == 4  # 2 prompts x num_return_sequences=2
    assert all(torch.equal(s, seqs[0]) for s in seqs)


def test_sampling_with_a_seed_gives_sdpa_s_tokens(cp_results):
    """The same seed gives the tokens plain sdpa generate() draws (rank 0's RNG state is shared, not re-seeded)."""
    world, results = cp_results
    family, lengths, shared, _, extra = SAMPLING_ALL_GATHER
    model = tiny_model(family, "sdpa", seed=0)
    ids, mask = _left_pad(_rows(lengths, seed=sum(lengths), shared=shared))
    torch.manual_seed(7)
    want = model.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs(extra)).sequences[:, ids.shape[1]:]
    for rank in range(world):
        assert torch.equal(results[rank]["sampling_seed7"]["new_tokens"], want), f"rank {rank}"


def _mismatched_args_worker(rank, world):
    model = tiny_model("llama", "cascade", seed=0)
    ids = torch.tensor([_rows([30], seed=3)[0]])
    inputs = hf_cascade.context_parallel_inputs(model, ids)
    start = time.monotonic()
    try:
        model.generate(**inputs, max_new_tokens=4 + rank, do_sample=False, pad_token_id=0)
    except ValueError as err:
        return str(err), time.monotonic() - start
    return None


def test_ranks_calling_generate_with_different_arguments_all_raise():
    results = run_on_gloo(_mismatched_args_worker, 2, pg_timeout_s=30, timeout_s=120)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not raise"
        message, elapsed = result
        assert "max_new_tokens" in message and "different arguments" in message
        assert elapsed < 20


def test_generate_twice_from_the_same_inputs(cp_results):
    world, results = cp_results
    for rank in range(world):
        got = results[rank]["llama_tree_odd_length"]
        assert torch.equal(got["again"], got["sequences"])


# ----------------------------------------------------------------------------- errors and failures
def test_without_process_group_explains_how_to_launch():
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = tiny_model("llama", "cascade", seed=0)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[1, 5, 7]]))


def _stalled_peer_worker(rank, world):
    """Rank 1 joins the input and capacity checks, then stops participating; rank 0 must fail in the ring, not
    hang."""
    from hf_cascade.parallel._group import resolve_group
    from hf_cascade.parallel._group import sync_rng
    from hf_cascade.parallel.capacity import MemoryNeed, check_capacity
    from hf_cascade.parallel.inputs import _check_same_on_all_ranks

    model = tiny_model("llama", "cascade", seed=0)
    ids = torch.tensor([_rows([40], seed=0)[0]])
    if rank == 1:
        info = resolve_group()
        _check_same_on_all_ranks(ids, torch.ones_like(ids), info)
        sync_rng(info, ids.device)
        check_capacity(MemoryNeed(0, 0, 0), 1 << 40, info, ids.device, prompt_tokens=40, rows=1, kv_per_token=1)
        time.sleep(4)  # alive but silent, past rank 0's timeout
        return None
    start = time.monotonic()
    try:
        hf_cascade.context_parallel_inputs(model, ids)
    except RuntimeError as err:  # gloo: "Timed out waiting ... for send operation to complete"
        return time.monotonic() - start, str(err)
    return None


def test_a_stalled_rank_makes_the_others_fail_within_the_timeout():
    results = run_on_gloo(_stalled_peer_worker, 2, pg_timeout_s=2, timeout_s=120)
    assert results[0] is not None, "rank 0 should have raised"
    elapsed, message = results[0]
    assert elapsed < 30, f"rank 0 failed only after {elapsed:.1f} s"
    assert "imed out" in message or "closed" in message.lower()


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown option"):
        hf_cascade.context_parallel_inputs(tiny_model("llama", "cascade"), torch.tensor([[1, 2]]), bogus=1)


def test_unknown_combine_lists_the_valid_ones():
    # Checked before any collective (no process group needed to see it).
    with pytest.raises(ValueError, match="'all_gather'.*'tree'.*'all_to_all'"):
        hf_cascade.context_parallel_inputs(tiny_model("llama", "cascade"), torch.tensor([[1, 2]]), combine="allgather")
