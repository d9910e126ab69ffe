"""When a recorded decode step may be replayed: the key of hf_cascade.decode.captured_step (CPU; recording and replay
themselves need CUDA graphs: tests/test_gpu_generate.py).

A recorded CUDA graph reads every tensor at the address it had when it was recorded, so a replay is correct only
for a step whose cache tensors sit at the same addresses with the same shapes, and whose arguments have the same
shapes (their values are copied in). The key must tell those steps apart from all others.
"""

import contextlib

import pytest
import torch

import hf_cascade
from hf_cascade.decode.captured_step import CapturedDecodeStep
from hf_cascade.transformers_compat import CACHE_KWARG

from test_generate import make_prompts, model_pair, pad_batch, tree_prompts


def _call(cas, ids, mask):
    """A fixed-buffer one-argument call (the CUDA default, forced here; eager on CPU); returns its cache."""
    caches = []
    cas.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                 custom_generate=hf_cascade.generate, cascade_caches=caches, disable_compile=True,
                 cascade_options=dict(min_shared_tokens=2, cost_model=None, fixed_buffers=True))
    return caches[0]


def _step_inputs(cache, batch, token=3, width=None):
    width = cache.max_suffix_length if width is None else width
    return dict(
        input_ids=torch.full((batch, 1), token), position_ids=torch.full((batch, 1), 40 + token),
        attention_mask={"full_attention": torch.ones(batch, 1, 1, width, dtype=torch.bool), "sliding_attention": None},
        use_cache=True, return_dict=True, **{CACHE_KWARG: cache},
    )


def test_replay_key_follows_addresses_shapes_and_arguments():
    _, cas = model_pair("llama")
    layout = ([(1, 20), (2, 6)], 5)
    ids, mask = pad_batch(tree_prompts(*layout, rows=6, seed=80))
    first = _call(cas, ids, mask)
    rows = first.layers[0].keys.shape[0]
    step = CapturedDecodeStep(cas, first)
    key, tensors = step._key(_step_inputs(first, rows))
    assert key is not None and set(tensors) == {("input_ids",), ("position_ids",), ("attention_mask", "full_attention")}
    # Another step of the call: other token values, same shapes -> the same graph (values are copied in).
    assert step._key(_step_inputs(first, rows, token=9))[0] == key
    # An argument of another shape, or another non-tensor argument -> another graph.
    assert step._key(_step_inputs(first, rows, width=first.max_suffix_length + 1))[0] != key
    assert step._key({**_step_inputs(first, rows), "use_cache": False})[0] != key
    # An argument that cannot be compared between steps -> never recorded.
    assert step._key({**_step_inputs(first, rows), "extra": [1, 2]})[0] is None

    # The next call with the same shapes (other tokens) gets the kept buffers back: same addresses, same key.
    ids2, mask2 = pad_batch(tree_prompts(*layout, rows=6, seed=81))
    second = _call(cas, ids2, mask2)
    assert second is not first
    assert CapturedDecodeStep(cas, second)._key(_step_inputs(second, rows))[0] == key
    # A call with another tree: other shapes -> another key.
    ids3, mask3 = pad_batch(tree_prompts([(1, 33)], 3, rows=6, seed=82))
    third = _call(cas, ids3, mask3)
    assert CapturedDecodeStep(cas, third)._key(_step_inputs(third, rows))[0] != key
    # Rows whose own tokens start at different columns (left padding): their suffix starts are read through the
    # planned window mask, so two calls of one layout still get one key.
    keys = []
    for seed in (51, 52):
        ids4, mask4 = pad_batch(make_prompts(seed=seed, system=37, block=19, groups=2, per_group=3))
        cache = _call(cas, ids4, mask4)
        assert cache._suffix_start_dev is not None and cache._window_dev is not None
        keys.append(CapturedDecodeStep(cas, cache)._key(_step_inputs(cache, cache.layers[0].keys.shape[0]))[0])
    assert keys[0] == keys[1]
    # Every device tensor the step reads is in the key: the op's index tensors and the window mask included.
    read = {t.data_ptr() for t in third.static_step_tensors()}
    assert {t.data_ptr() for t in third._wrapper.op_inputs} <= read and third._window_dev.data_ptr() in read



@contextlib.contextmanager
def _in_decode_steps(model, *modes):
    """Forward hooks that enter ``mode()`` for each of ``modes`` around every one-token forward of ``model`` (a
    decode step; the prefill has every prompt column), as CapturedDecodeStep does for a step it runs or records.
    Yields the list of decode steps entered."""
    entered, stack = [], contextlib.ExitStack()

    def enter(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            for mode in modes:  # a mode takes the forward's keyword arguments (its cache among them) or nothing
                stack.enter_context(mode(kwargs) if getattr(mode, "takes_inputs", False) else mode())
            entered.append(True)

    def leave(module, args, kwargs, output):
        stack.close()

    hooks = [model.register_forward_pre_hook(enter, with_kwargs=True),
             model.register_forward_hook(leave, with_kwargs=True)]
    try:
        yield entered
    finally:
        stack.close()
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("levels", [[(1, 20), (2, 6)], [(1, 9), (2, 5), (3, 4)]])
def test_decode_steps_in_the_recorded_path_match_the_reference(family, levels):
    """The path a recorded (or compiled) step takes, run eagerly: every decode step of a fixed-buffer call inside
    static_step_mode() (entered by forward hooks for the one-token forwards, as CapturedDecodeStep enters it for
    each step it runs or records). fp32 tokens and logits equal to the reference's."""
    from hf_cascade.decode.captured_step import static_step_mode

    ref, cas = model_pair(family)
    ids, mask = pad_batch(tree_prompts(levels, 4, rows=6, seed=83))
    gen = dict(max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_logits=True)
    want = ref.generate(ids, attention_mask=mask, **gen)
    with _in_decode_steps(cas, static_step_mode) as entered:
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           disable_compile=True, cascade_options=dict(min_shared_tokens=2, cost_model=None,
                                                                      fixed_buffers=True), **gen)
    assert len(entered) == gen["max_new_tokens"] - 1 and caches[0].num_levels == len(levels)
    assert caches[0]._wrapper.prefix_slots is not None and caches[0]._wrapper.op_inputs is not None  # the op ran
    assert torch.equal(got.sequences, want.sequences)
    for w, g in zip(want.logits, got.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_layers_path_matches_reference_and_compiles_once(family):
    """decode_step="layers" as it runs a step once before recording it, on CPU: every decode step inside
    static_step_mode() with the decoder layers compiled (hf_cascade.compiled_layers; inductor). fp32 tokens equal to
    the reference for trees of 1-3 levels and two buffer buckets; the layers compile during the first call only,
    one code for all three layers (the layer index symbolic), and every later layout reuses it."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import static_step_mode
    from hf_cascade.compiled_layers import compiled_layers, layer_compilations
    from test_compiled_generate import LAYOUT_STREAM

    ref, cas = model_pair(family, num_hidden_layers=3)
    gen = dict(max_new_tokens=9, min_new_tokens=9, pad_token_id=0, do_sample=False)
    graphs, frames = [], []
    def layers_compiled(inputs):
        return compiled_layers(cas, inputs[CACHE_KWARG])

    layers_compiled.takes_inputs = True
    with _in_decode_steps(cas, static_step_mode, layers_compiled):
        for seed, (levels, own) in enumerate(LAYOUT_STREAM[:4]):
            ids, mask = pad_batch(tree_prompts(levels, own, rows=6, seed=90 + seed))
            frames_before = counters["frames"]["ok"]
            caches = []
            # cpu_decode_threads=None: the layers compiled by the hooks guard on torch's thread count, which the
            # default CPU policy may change with the machine's load (a recompile that is not the layout's).
            got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                               disable_compile=True, cascade_options=dict(min_shared_tokens=2, cost_model=None,
                                                                          fixed_buffers=True,
                                                                          cpu_decode_threads=None), **gen)
            assert caches[0].num_levels == len(levels)
            assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), seed
            graphs.append(counters["stats"]["unique_graphs"])
            frames.append(counters["frames"]["ok"] - frames_before)
    assert layer_compilations(cas) == 4 * (gen["max_new_tokens"] - 1)
    assert len(set(graphs)) == 1, f"compiled again for a later layout: {graphs}"
    # The first call: one frame (the layer, its cache write and attention one op, the index a symbol) for all three
    # layers; a torch that keeps layer 0's index a constant compiles a second.
    assert 0 < frames[0] <= 2 and frames[1:] == [0, 0, 0], frames


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_prefill_matches_reference_and_compiles_per_model(family):
    """cascade_options compile_prefill=True (the CUDA default with the compiled decode step; forced here on CPU):
    every shared segment's forward and the rows' first forward run with the decoder layers compiled for any batch
    and length (hf_cascade.compiled_layers.compiled_forward). fp32 tokens and logits equal the reference for trees of
    1-3 levels, padded rows included; the graphs compiled for the first layouts serve the last ones."""
    from torch._dynamo.utils import counters

    from hf_cascade.compiled_layers import compiled_prefills
    from test_compiled_generate import LAYOUT_STREAM

    ref, cas = model_pair(family, num_hidden_layers=3)
    gen = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False, return_dict_in_generate=True,
               output_logits=True)
    graphs, prefills = [], []
    for seed, (levels, own) in enumerate(LAYOUT_STREAM[:4] + LAYOUT_STREAM[:2]):
        ids, mask = pad_batch(tree_prompts(levels, own, rows=6, seed=110 + seed))
        before = compiled_prefills(cas)
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           disable_compile=True, cascade_options=dict(min_shared_tokens=2, cost_model=None,
                                                                      fixed_buffers=True, compile_prefill=True), **gen)
        want = ref.generate(ids, attention_mask=mask, **gen)
        assert torch.equal(got.sequences, want.sequences), seed
        for w, g in zip(want.logits, got.logits):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        prefills.append(compiled_prefills(cas) - before)
        assert prefills[-1] == caches[0].num_levels + 1, (seed, prefills)  # each level's forward + the first forward
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-2:] == [graphs[3]] * 2, f"layouts seen before compiled again: {graphs}"


def test_prefill_forwards_of_several_rows_always_get_a_mask():
    """In a prefill forward with compiled layers, a forward of several rows gets a mask tensor even for "causal, no
    padding" (a level of equal-length nodes), as the rows' first forward has one: both run one compiled graph (on a
    GPU a level of equal-length nodes traced a graph of its own, a second of a process's first calls). A forward
    of one row, and every forward outside the compiled prefill, keeps sdpa's None."""
    from hf_cascade.attention import cascade_mask
    from hf_cascade.step_context import step_context

    def mask(batch):
        return cascade_mask(batch_size=batch, q_length=5, kv_length=5, attention_mask=torch.ones(batch, 5,
                            dtype=torch.bool), allow_is_causal_skip=True, device="cpu")

    assert mask(4) is None and mask(1) is None
    with step_context(prefill_batch_masks=True):
        built, one_row = mask(4), mask(1)
    assert one_row is None
    assert built.shape == (4, 1, 5, 5) and torch.equal(built[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_compiled_prefill_failure_loses_nothing(monkeypatch):
    """A compiler error at the last layer of a compiled prefill forward (after the other layers wrote their KV): those
    writes are taken back, the forward runs eagerly, the tokens are exact, and this model's prefill stays eager."""
    import torch._dynamo.exc

    import hf_cascade.compiled_layers as compiled
    from hf_cascade.compiled_layers import layer_calls

    ref, cas = model_pair("llama", num_hidden_layers=3)
    real = compiled.compiled_layers
    calls = []

    @contextlib.contextmanager
    def failing_at_the_last_layer(model, cache, dynamic=False):
        with real(model, cache, dynamic) as entered:
            calls.append(dynamic)
            if len(calls) == 2:  # the second prefill forward (the first is the first level's)
                def fail(*args, **kwargs):
                    raise torch._dynamo.exc.InternalTorchDynamoError("injected compiler error")

                model.model.layers[-1]._compiled_call_impl = fail
            yield entered

    monkeypatch.setattr(compiled, "compiled_layers", failing_at_the_last_layer)
    ids, mask = pad_batch(make_prompts(seed=56, system=37, block=19, groups=2, per_group=3))
    gen = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0, do_sample=False)
    options = dict(min_shared_tokens=2, cost_model=None, fixed_buffers=True, compile_prefill=True)
    for _ in range(2):
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, disable_compile=True,
                           cascade_options=options, **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen))
    assert calls == [True, True], calls  # the second call's prefill ran eagerly (no compiled_layers entered)
    assert layer_calls(cas).prefill_failed


def test_host_length_follows_steps_that_ran_no_python():
    """A replayed step writes its column on the device only (each layer's device count goes up by one, and no
    Python runs): begin_static_step, called before every recorded or replayed step, makes the host count read the
    device count again, so suffix_length, crop and the eager capacity check see every replayed step."""
    _, cas = model_pair("llama")
    ids, mask = pad_batch(tree_prompts([(1, 20), (2, 6)], 5, rows=6, seed=84))
    cache = _call(cas, ids, mask)
    before = cache.suffix_length
    cache.begin_static_step()
    for layer in cache.layers:  # what one replay does to the cache's device state
        layer.cumulative_length.add_(1)
    assert cache.suffix_length == before + 1
    cache.crop(-1)
    assert cache.suffix_length == before and int(cache.layers[0].cumulative_length) == before


def test_compiled_layers_are_installed_for_their_own_thread_only():
    """A thread inside compiled_layers (another thread's generate(), or a compile beside a serving thread) leaves the
    model as it was for every other thread: a generate() on the main thread meanwhile runs the model's own layers
    (fp32 tokens equal to the reference, nothing compiled), and the layers' previous calls are back afterwards."""
    import threading

    from torch._dynamo.utils import counters

    from hf_cascade.compiled_layers import _ThreadCompiledCall, compiled_layers, decoder_layers

    ref, cas = model_pair("llama", num_hidden_layers=3)
    ids, mask = pad_batch(make_prompts(seed=5, system=23, block=9))
    gen = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0, do_sample=False)
    cache = _call(cas, ids, mask)
    entered, leave, failures = threading.Event(), threading.Event(), []

    def builder():
        try:
            with compiled_layers(cas, cache):
                entered.set()
                leave.wait(timeout=120)
        except Exception as err:  # noqa: BLE001 (reported by the assertion below)
            failures.append(err)
            entered.set()

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        assert entered.wait(timeout=60) and not failures, failures
        assert all(isinstance(layer._compiled_call_impl, _ThreadCompiledCall) for layer in decoder_layers(cas))
        graphs = counters["stats"]["unique_graphs"]
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, disable_compile=True,
                           cascade_options=dict(min_shared_tokens=2, cost_model=None), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen))
        assert counters["stats"]["unique_graphs"] == graphs, "the main thread ran the other thread's compiled layers"
    finally:
        leave.set()
        thread.join()
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(cas))
