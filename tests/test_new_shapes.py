"""Shapes new to a ready compiled tier (issue 48, item 2): the call runs them uncompiled instead of waiting for the
compiler, until the time lost pays for compiling them in a call (a ski rental per shape).

CPU: the mechanism of ``hf_cascade.compiled_layers.NewShapes`` with real compiled layers (inductor, as
test_captured_step.py runs them), and the decisions of ``hf_cascade.tiers`` on a model's tier state (as
test_builtin_kernels.py tests the ski rental). The CUDA path end to end: tests/test_gpu_generate.py and
benchmarks/bench_stall.py.
"""

import contextlib
import math

import pytest
import torch

import hf_cascade
from hf_cascade.compiled_layers import NewShapes, compiled_layers, new_shapes
from hf_cascade.transformers_compat import CACHE_KWARG

from test_captured_step import _in_decode_steps
from test_generate import model_pair, pad_batch, tree_prompts


# ------------------------------------------------------------------------------------------------- the mechanism
def _layers_compiled(model):
    def enter(inputs):
        return compiled_layers(model, inputs[CACHE_KWARG])

    enter.takes_inputs = True
    return enter


@contextlib.contextmanager
def _fresh_dynamo():
    try:
        yield
    finally:
        torch._dynamo.reset()


def test_new_batch_sizes_run_the_first_graph_and_other_shapes_run_uncompiled_exactly():
    """decode_step="layers" as it runs each step (hooks, as test_captured_step does): the layers compiled for a
    6-row batch have the batch symbolic from that first compilation, so 12- and 20-row batches under
    NewShapes(compile=False) run them (no miss, nothing compiled) and give the reference's fp32 tokens; layers of
    shapes that graph was not made for (a second model, another MLP width) compile nothing under the same policy,
    count their uncompiled layer calls and are exact too; once a call may compile, it compiles them."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import static_step_mode

    # dynamo's code cache and its automatic-dynamic state are per code object (every layer's is Module._call_impl),
    # shared with the models of other tests: start (and leave) as a new process would, on sizes of this test only
    torch._dynamo.reset()
    ref, cas = model_pair("llama", num_hidden_layers=3, intermediate_size=96)
    ref2, cas2 = model_pair("llama", num_hidden_layers=3, intermediate_size=112)
    gen = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False)
    options = dict(min_shared_tokens=2, cost_model=None, fixed_buffers=True, cpu_decode_threads=None)

    def call(pair, rows, seed, policy):
        reference, model = pair
        ids, mask = pad_batch(tree_prompts([(1, 12), (2, 6)], 4, rows=rows, seed=seed))
        frames = counters["frames"]["ok"]
        with new_shapes(policy):
            got = model.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                                 disable_compile=True, cascade_options=options, **gen)
        assert torch.equal(got, reference.generate(ids, attention_mask=mask, **gen)), (rows, seed, policy)
        return counters["frames"]["ok"] - frames

    with _in_decode_steps(cas, static_step_mode, _layers_compiled(cas)), \
            _in_decode_steps(cas2, static_step_mode, _layers_compiled(cas2)), _fresh_dynamo():
        assert call((ref, cas), 6, 1, None) >= 1  # the first compile (no policy: torch's default)
        fits = NewShapes(compile=False)
        assert call((ref, cas), 12, 2, fits) == 0 and call((ref, cas), 20, 3, fits) == 0, fits  # batch symbolic
        assert call((ref, cas), 6, 4, fits) == 0 and fits.misses == 0, fits
        skip = NewShapes(compile=False)
        assert call((ref2, cas2), 6, 5, skip) == 0 and skip.misses == 3 * (gen["max_new_tokens"] - 1), skip
        assert call((ref2, cas2), 6, 6, NewShapes(compile=True)) >= 1  # the call may compile: it compiles them


# --------------------------------------------------------------------------------------------------- the policy
@pytest.fixture
def tiny():
    from hf_cascade.engine import engine_of
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", "cascade", seed=0)
    engine_of(model).forget("tiers")
    return model


def _compiled_ready(model):
    from hf_cascade import tiers

    tiers.record_call(model, tiers._TIERS["compiled"], 5.0)  # a compiled call: the tier is ready
    return tiers.tier_state(model)


def test_shape_policy_before_and_after_the_compiled_tier_is_ready(tiny):
    """No policy (compile in the call, as before) off the compiled tier, for compile="now" and for the call that
    moves up to it; once the tier is ready, compile=False."""
    from hf_cascade import tiers

    compiled, triton = tiers._TIERS["compiled"], tiers._TIERS["triton"]
    assert tiers.shape_policy(tiny, compiled) is None  # the call that moves up compiles
    state = _compiled_ready(tiny)
    assert tiers.shape_policy(tiny, triton) is None
    assert tiers.shape_policy(tiny, compiled, "now") is None
    policy = tiers.shape_policy(tiny, compiled)
    assert isinstance(policy, NewShapes) and policy.compile is False and policy.misses == 0
    assert state.shapes_regret == 0.0 and tiers.tier_report(tiny)["new_shapes"] == {"missed_calls": 0, "regret_s": 0.0}


def test_new_shapes_compile_when_the_time_lost_pays(tiny, monkeypatch):
    """Background builds on or off alike: the calls that missed add what compiling would have saved them, and once
    that reaches NEW_SHAPES_COST_S the next call may compile (a ski rental per shape), if the last call that missed
    lasted at least as long as the compilation (no call more than doubled), or once the regret is NEW_SHAPES_PATIENCE
    times the cost (shorter calls); that call clears the regret.
    A ready compiled tier is taken even while a build runs (none compiles shapes)."""
    from _build_children import sleeping, stop

    from hf_cascade import tier_build, tiers

    state = _compiled_ready(tiny)
    compiled = tiers._TIERS["compiled"]
    monkeypatch.delenv("HF_CASCADE_BACKGROUND", raising=False)
    assert tier_build.background_builds_on() and "no thread" in tier_build.describe()
    monkeypatch.setenv("HF_CASCADE_BACKGROUND", "0")
    assert not tier_build.background_builds_on() and "off" in tier_build.describe()
    rows = sleeping()
    state.build = tier_build.BackgroundBuild([rows])
    try:
        assert tiers.choose_tier(tiny).name == "compiled"
    finally:
        stop(rows)
        state.build = None
    calls = 0
    while True:
        policy = tiers.shape_policy(tiny, compiled)
        if policy.compile:
            break
        policy.misses = 3
        tiers.record_call(tiny, compiled, 5.0, policy)  # each missed call: 0.2 x 5 s
        calls += 1
    assert calls == tiers.NEW_SHAPES_COST_S / (tiers.SAVED_FRACTION["compiled"] * 5.0) == 4
    tiers.record_call(tiny, compiled, 9.0, policy)  # the call that compiled them
    assert state.shapes_regret == 0.0 and tiers.shape_policy(tiny, compiled).compile is False
    no_miss = tiers.shape_policy(tiny, compiled)
    tiers.record_call(tiny, compiled, 2.0, no_miss)  # a call whose shapes fit adds nothing
    assert state.shapes_regret == 0.0 and state.missed_calls == calls
    for _ in range(40):  # calls shorter than the compilation never compile it (it would more than double one)
        policy = tiers.shape_policy(tiny, compiled)
        assert not policy.compile
        policy.misses = 1
        tiers.record_call(tiny, compiled, 0.6, policy)
    assert state.shapes_regret >= tiers.NEW_SHAPES_COST_S
    policy = tiers.shape_policy(tiny, compiled)
    policy.misses = 1
    tiers.record_call(tiny, compiled, tiers.NEW_SHAPES_COST_S, policy)  # one as long as the compilation: the next may
    policy = tiers.shape_policy(tiny, compiled)
    assert policy.compile
    tiers.record_call(tiny, compiled, 5.0, policy)  # it compiled them
    short = 0
    while not (policy := tiers.shape_policy(tiny, compiled)).compile:  # only short calls: they wait 5x longer
        policy.misses = 1
        tiers.record_call(tiny, compiled, 0.6, policy)
        short += 1
    assert short == math.ceil(tiers.NEW_SHAPES_PATIENCE * tiers.NEW_SHAPES_COST_S / (0.2 * 0.6) - 1e-9) == 167


def test_info_names_the_background_builds_and_their_switch(capsys, monkeypatch):
    from hf_cascade.cli import main

    assert main(["info"]) == 0
    assert "HF_CASCADE_BACKGROUND=off" in capsys.readouterr().out
    monkeypatch.setenv("HF_CASCADE_BACKGROUND", "off")
    assert main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("background"))
    assert "off (HF_CASCADE_BACKGROUND=off" in line


def test_recorded_step_that_missed_records_the_eager_layers_under_their_own_key():
    """CapturedDecodeStep's first step of a call (run once before it is recorded) under NewShapes(compile=False),
    shapes no compiled code fits: the layers run uncompiled (not a compile failure: the model keeps its compiled
    layers for later calls), and the call's steps record the eager layers under a key that says so, so that a later
    call of these shapes, once compiled, does not replay this graph."""
    from hf_cascade.decode.captured_step import CapturedDecodeStep, _model_graphs, static_step_mode
    from test_captured_step import _call

    _, cas = model_pair("llama", num_hidden_layers=3, intermediate_size=80)  # sizes no other test compiles
    ids, mask = pad_batch(tree_prompts([(1, 20), (2, 6)], 5, rows=7, seed=85))
    cache = _call(cas, ids, mask)
    step = CapturedDecodeStep(cas, cache, compile_layers=True)
    rows, width = ids.shape[0], ids.shape[1] + 4  # the next step of the call: 4 tokens generated
    inputs = dict(input_ids=torch.full((rows, 1), 3), position_ids=mask.sum(1, keepdim=True) + 3,
                  attention_mask=torch.cat([mask, torch.ones(rows, 4, dtype=mask.dtype)], 1)[:, :width],
                  use_cache=True, return_dict=True, **{CACHE_KWARG: cache})
    key = step._key(inputs)[0]
    policy = NewShapes(compile=False)
    cache.begin_static_step()
    with new_shapes(policy), static_step_mode():
        out = step._run_with_compiled_layers(inputs)
    assert policy.misses == 3 and torch.isfinite(out.logits).all()
    assert step.compile_layers is False and step._cache_key is None and step._key(inputs)[0] != key
    assert not _model_graphs(cas).layers_failed
