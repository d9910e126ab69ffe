"""The context-parallel prefill in rounds and the capacity check (CPU, gloo).

* :class:`~hf_cascade.parallel.prefill_plan.PrefillPlan`: every prompt column is stored by exactly one rank, in
  ascending order, the shares balanced; a rank never runs more than ``prefill_chunk_tokens`` columns at a time.
* :mod:`~hf_cascade.parallel.capacity`: a prompt that does not fit raises the same clear ValueError on EVERY rank
  before any work (also when only one rank is short), quickly; the longest prompt it names does fit.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.parallel._testing import run_on_gloo
from hf_cascade.parallel import capacity
from hf_cascade.parallel.capacity import ModelShape, memory_need, working_set_bytes
from hf_cascade.parallel.prefill_plan import PrefillPlan, default_rank_tokens


@pytest.mark.parametrize("length,world,tokens", [(0, 2, 4), (1, 4, 2), (22, 4, 2), (103, 3, 10), (97, 1, 8),
                                                 (4096, 4, 512), (65537, 2, 16384)])
def test_plan_stores_every_column_once_in_order(length, world, tokens):
    plan = PrefillPlan(length, world, tokens)
    stored = [plan.columns(rank) for rank in range(world)]
    for cols in stored:
        assert torch.all(cols[1:] > cols[:-1]), "a rank's columns must be ascending (its storage order)"
    everything = torch.cat(stored).sort().values
    assert torch.equal(everything, torch.arange(length)), "every prompt column is stored by exactly one rank"
    assert [plan.num_real(r) for r in range(world)] == [c.numel() for c in stored]
    assert max(c.numel() for c in stored) <= -(-length // world) + 2  # balanced (the bound capacity uses)
    assert plan.max_local_columns() <= tokens
    for rnd in plan.rounds(0):
        assert rnd.layout.local_length <= tokens


def test_default_round_bounds_rows_and_ranks():
    assert default_rank_tokens(1, 1) == 16384
    assert default_rank_tokens(8, 1) == 8192
    assert default_rank_tokens(4, 4) == 4096
    assert default_rank_tokens(2, 1000) == 64


def test_working_set_does_not_grow_with_the_prompt():
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, q_heads=32, hidden=4096, intermediate=14336,
                       dtype_bytes=2)
    needs = []
    for length in (131072, 524288, 1048576):
        plan = PrefillPlan(length, 4, default_rank_tokens(4, 1))
        needs.append(memory_need(shape, world_size=4, stored_columns=plan.num_real(0), rows=1,
                                 round_tokens=plan.max_local_columns(), suffix_columns=0, decode_columns=64))
    assert needs[0].working == needs[1].working == needs[2].working
    # What the round's tensors take (the bound on allocated memory), apart from the allocator's holes.
    assert needs[0].working - capacity._SLACK_BYTES < 4 << 30
    assert needs[2].kv == 32 << 30  # Llama-3-8B: 128 KiB per token; 1M tokens over 4 ranks
    assert working_set_bytes(shape, 4, 16384) < working_set_bytes(shape, 4, 32768)


def _capacity_worker(rank, world, length, budgets):
    model = tiny_model("llama", "cascade", seed=0)
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(0))
    start = time.monotonic()
    try:
        inputs = hf_cascade.context_parallel_inputs(model, ids, memory_per_rank=budgets[rank],
                                                    prefill_chunk_tokens=8)
    except ValueError as err:
        return "raised", str(err), time.monotonic() - start
    out = model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0)
    return "ran", out[0, length:].tolist(), time.monotonic() - start


def _budget(length, world, rank_tokens=8):
    """Bytes the tiny Llama's prompt of ``length`` tokens needs on the busiest rank (the check's own model)."""
    model = tiny_model("llama", "cascade", seed=0)
    shape = ModelShape.of(model)
    plan = PrefillPlan(length - 1, world, rank_tokens)
    from hf_cascade.parallel.generation import decode_buffer_tokens

    decode = -(-decode_buffer_tokens(model.generation_config.max_new_tokens or 256) // world) + 1
    return max(memory_need(shape, world_size=world, stored_columns=plan.num_real(r), rows=1,
                           round_tokens=plan.max_local_columns(), suffix_columns=0, decode_columns=decode).total
               for r in range(world))


def test_a_prompt_that_does_not_fit_raises_on_every_rank_at_once():
    world, length = 2, 301
    budget = _budget(length, world) - 64 * 1024  # a few hundred columns short
    results = run_on_gloo(_capacity_worker, world, args=(length, [budget] * world), timeout_s=120)
    messages = []
    for rank, (what, message, elapsed) in enumerate(results):
        assert what == "raised", f"rank {rank} did not raise"
        assert elapsed < 30
        messages.append(message)
    assert messages[0] == messages[1], "every rank raises the same error"
    assert "does not fit" in messages[0] and "301 tokens" in messages[0]
    assert "longest prompt that fits" in messages[0] and "GPUs" in messages[0]


def test_one_short_rank_stops_every_rank_and_the_named_longest_prompt_fits():
    world, length = 2, 301
    enough = _budget(length, world)
    results = run_on_gloo(_capacity_worker, world, args=(length, [enough * 4, enough - 64 * 1024]), timeout_s=120)
    assert [r[0] for r in results] == ["raised", "raised"], "rank 0 must not start the prefill while rank 1 fails"
    assert "on rank 1" in results[0][1]
    longest = int(re.search(r"longest prompt that fits is about ([\d,]+) tokens", results[0][1]).group(1)
                  .replace(",", ""))
    assert 0 < longest < length
    fits = run_on_gloo(_capacity_worker, world, args=(longest, [enough * 4, enough - 64 * 1024]), timeout_s=120)
    assert [r[0] for r in fits] == ["ran", "ran"]
    assert fits[0][1] == fits[1][1]


def test_bad_memory_and_chunk_options_are_clear():
    model = tiny_model("llama", "cascade")
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[1, 2]]), prefill_chunk_tokens=7)
    with pytest.raises(ValueError, match="memory_per_rank"):
        hf_cascade.context_parallel_inputs(model, torch.tensor([[1, 2]]), memory_per_rank="40GB")


def test_cached_segments_are_handed_back_only_past_one_rounds_temporaries(monkeypatch):
    """The prefill keeps what the next layer reuses and releases the pile-up (PrefillState.release_cached)."""
    from hf_cascade.parallel.prefill_plan import PrefillState

    shape = ModelShape(layers=32, kv_heads=8, head_dim=128, q_heads=32, hidden=4096, intermediate=14336, dtype_bytes=2)
    need = memory_need(shape, world_size=4, stored_columns=32768, rows=1, round_tokens=16384, suffix_columns=0,
                       decode_columns=64)
    assert 0 < need.temporaries < need.working  # the slack is not kept
    plan = PrefillPlan(1000, 4, 64)
    state = PrefillState(plan, plan.rounds(0), None, False, keep_cached=need.temporaries)
    reserved, allocated, released = [0], [10 << 30], []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    reserved[0] = allocated[0] + need.temporaries  # exactly one round's temporaries cached: kept
    assert not state.release_cached(torch.device("cuda", 0)) and not released
    reserved[0] += 1  # more than that: the pile-up goes back
    assert state.release_cached(torch.device("cuda", 0)) and released == [True] and state.releases == 1
    strict = PrefillState(plan, plan.rounds(0), None, False)  # the default keeps nothing
    reserved[0] = allocated[0] + 1
    assert strict.release_cached(torch.device("cuda", 0)) and strict.releases == 1
