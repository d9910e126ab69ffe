"""On the GPU (Triton kernels in the decode path): cascade generate() == sdpa generate(), fp32 tiny models.

Run on the device machine: ``python -m pytest -m gpu tests``.
"""

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import reference_attention, tiny_model
from hf_cascade.transformers_compat import CACHE_KWARG, output_cache

from test_generate import make_prompts, pad_batch, tree_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "beam", "sample"])
def test_gpu_generate_matches_reference(family, mode):
    ref = tiny_model(family, reference_attention(family), device="cuda")
    cas = tiny_model(family, "cascade", device="cuda")
    rows = make_prompts(seed=11, system=37, block=19, groups=3, per_group=3)
    ids, mask = (t.cuda() for t in pad_batch(rows))
    gen = dict(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    gen.update(
        {"greedy": dict(do_sample=False), "beam": dict(num_beams=3, do_sample=False), "sample": dict(do_sample=True, top_k=20)}[mode]
    )
    torch.manual_seed(0)
    want = ref.generate(ids, attention_mask=mask, **gen)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None)
    assert inputs[CACHE_KWARG].num_levels == 2
    torch.manual_seed(0)
    got = cas.generate(**inputs, **gen)
    assert torch.equal(got.sequences[:, inputs["input_ids"].shape[1] :], want.sequences[:, ids.shape[1] :])
    if mode == "greedy":
        for w, g in zip(want.logits, got.logits):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_gpu_bf16_generate_close_to_sdpa():
    """bf16: logits of the first step within bf16 noise of sdpa's (tokens can legitimately differ at near-ties)."""
    ref = tiny_model("llama", "sdpa", device="cuda", dtype=torch.bfloat16)
    cas = tiny_model("llama", "cascade", device="cuda", dtype=torch.bfloat16)
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=12, system=64, block=32)))
    gen = dict(max_new_tokens=1, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = ref.generate(ids, attention_mask=mask, **gen).logits[0].float()
    got = cas.generate(**hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None), **gen).logits[0].float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_gpu_compiled_generate_matches_reference(family, mode):
    """Fixed suffix buffers -> generate() auto-compiles the decode step (inductor + CUDA graphs, transformers'
    default). Two batches with one layout: the second replays graphs re-recorded on the new cache's buffers."""
    ref = tiny_model(family, reference_attention(family), device="cuda")
    cas = tiny_model(family, "cascade", device="cuda")
    gen = dict(max_new_tokens=8, pad_token_id=0, do_sample=False)
    if mode == "beam":
        gen["num_beams"] = 2
    for seed in (21, 22):
        rows = make_prompts(seed=seed, system=37, block=19, groups=3, per_group=3)
        ids, mask = (t.cuda() for t in pad_batch(rows))
        want = ref.generate(ids, attention_mask=mask, **gen)
        inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None, max_new_tokens=8)
        assert inputs[CACHE_KWARG].is_compileable
        got = cas.generate(**inputs, **gen)
        if mode == "greedy":  # transformers compiles greedy/sampling decoding, not beam search (eager, fixed buffers)
            assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
        assert torch.equal(got[:, inputs["input_ids"].shape[1] :], want[:, ids.shape[1] :]), seed


def test_gpu_compiled_once_for_a_stream_of_layouts():
    """The one-argument path with decode_step="compile" compiles the decode step (CUDA graphs) once per batch size:
    batches with other sharing trees (1-3 levels, other lengths, another buffer bucket) re-plan on the host and reuse
    it. Tokens stay exact (fp32)."""
    from torch._dynamo.utils import counters

    from test_compiled_generate import LAYOUT_STREAM, MAX_NEW_STREAM

    ref = tiny_model("llama", "sdpa", device="cuda")
    cas = tiny_model("llama", "cascade", device="cuda")
    gen = dict(max_new_tokens=MAX_NEW_STREAM, pad_token_id=0, do_sample=False)
    graphs, shapes = [], set()
    for seed, (levels, own) in enumerate(LAYOUT_STREAM):
        ids, mask = (t.cuda() for t in pad_batch(tree_prompts(levels, own, rows=8, seed=60 + seed)))
        want = ref.generate(ids, attention_mask=mask, **gen)
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2, decode_step="compile"), **gen)
        assert caches[0].is_compileable
        shapes.add((caches[0].num_levels, caches[0].max_suffix_length))
        assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
        assert torch.equal(got, want), seed
        graphs.append(counters["stats"]["unique_graphs"])
    assert {levels for levels, _ in shapes} == {1, 2, 3} and len({cap for _, cap in shapes}) == 2, shapes
    assert graphs[-1] == graphs[0], f"recompiled for a new layout: unique graphs {graphs}"


def test_gpu_batch_sizes_share_one_compiled_step():
    """Greedy batches of 5, 6 and 7 rows run at the bucket of 8 by default on CUDA (rows added and cut from the
    output): one compiled step for the three sizes (decode_step="compile"), the real rows' tokens exact (fp32)."""
    from torch._dynamo.utils import counters

    ref = tiny_model("llama", "sdpa", device="cuda")
    cas = tiny_model("llama", "cascade", device="cuda")
    gen = dict(max_new_tokens=8, pad_token_id=0, do_sample=False)
    graphs = []
    for rows in (5, 6, 7):
        ids, mask = (t.cuda() for t in pad_batch(tree_prompts([(1, 37), (2, 11)], 5, rows=rows, seed=90 + rows)))
        caches = []
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2, decode_step="compile"), **gen)
        assert caches[0].is_compileable and caches[0].layers[0].keys.shape[0] == 8
        assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), rows
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0], f"a new batch size compiled again: unique graphs {graphs}"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "samples", "beam"])
def test_gpu_custom_generate_matches_reference(family, mode):
    """The one-argument path on the GPU: the user's own batch, samples/beams share their prompt."""
    ref = tiny_model(family, reference_attention(family), device="cuda")
    cas = tiny_model(family, "cascade", device="cuda")
    rows = make_prompts(seed=31, system=37, block=19, groups=2, per_group=2)
    ids, mask = (t.cuda() for t in pad_batch(rows))
    gen = dict(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True)
    gen.update({
        "greedy": dict(do_sample=False),
        "samples": dict(do_sample=True, top_k=20, num_return_sequences=4),
        "beam": dict(num_beams=3, do_sample=False),
    }[mode])
    torch.manual_seed(0)
    want = ref.generate(ids, attention_mask=mask, **gen)
    caches = []
    torch.manual_seed(0)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                       cascade_options=dict(cost_model=None), **gen)
    assert torch.equal(got.sequences, want.sequences)
    assert caches and caches[0].num_levels >= 2


@pytest.mark.parametrize("decode_step", ["compile", "graphs"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_gpu_stop_flag_read_a_step_late(do_sample, decode_step):
    """The one-argument path on CUDA reads "every row finished" one step late (pinned flag, event; no wait per
    step): an EOS ending row 0 early and a criterion ending every row before max_new_tokens give transformers'
    sequences, scores and cache length (the extra step undone), in the compiled step and in the recorded one (whose
    replayed extra step ran no Python: the cache's host length was stale)."""
    from test_custom_generate import _AllDoneAt
    from transformers import StoppingCriteriaList

    ref = tiny_model("llama", "sdpa", device="cuda")
    cas = tiny_model("llama", "cascade", device="cuda")
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=1)))
    plain = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    stop = StoppingCriteriaList([_AllDoneAt(ids.shape[1] + 6)])
    gen = dict(max_new_tokens=9, pad_token_id=0, eos_token_id=int(plain[0, ids.shape[1] + 2]), do_sample=do_sample,
               top_k=20, return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(7)
    want = ref.generate(ids, attention_mask=mask, stopping_criteria=stop, **gen)
    caches = []
    torch.manual_seed(7)
    got = cas.generate(ids, attention_mask=mask, stopping_criteria=stop, custom_generate=hf_cascade.generate,
                       cascade_caches=caches,
                       cascade_options=dict(cost_model=None, min_shared_tokens=2, decode_step=decode_step), **gen)
    assert caches[0].is_compileable
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    assert output_cache(got).get_seq_length() == output_cache(want).get_seq_length()


@pytest.mark.parametrize("decode_step", ["eager", "compile", "graphs"])
def test_gpu_decode_steps_never_wait_for_the_gpu(decode_step):
    """No host-device synchronisation per decode step, eager (``disable_compile=True``), compiled or recorded
    (replayed from a CUDA graph): a call of 12 new tokens synchronises as often as a call of 3 (planning and
    prefill synchronise; the steps do not). Seen on
    an H100 before the discarded first count: 49 vs 48, the extra one at the first count whichever call it was.
    Counted with torch's CUDA sync debug mode, which warns at every synchronising call."""
    import warnings

    cas = tiny_model("llama", "cascade", device="cuda")
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=41, system=37, block=19, groups=2, per_group=3)))
    gen = dict(pad_token_id=0, do_sample=False, custom_generate=hf_cascade.generate,
               cascade_options=dict(cost_model=None, decode_step=decode_step), disable_compile=decode_step == "eager")

    def syncs(new_tokens):
        cas.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)  # warm
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                cas.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    syncs(3)  # the first counted call also counts a one-off synchronisation in torch.cuda (not a decode step)
    assert syncs(12) == syncs(3)


def _graphs_options(**extra):
    return dict(cost_model=None, min_shared_tokens=2, decode_step="graphs", **extra)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "samples"])
def test_gpu_recorded_decode_step_matches_reference(family, mode):
    """decode_step="graphs": the eager step recorded into a CUDA graph (no torch.compile), fp32 tokens equal to the
    reference. A second call with the same shapes replays the first call's graph (its buffers come back at the
    same addresses); nothing is compiled."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import recorded_steps

    ref = tiny_model(family, reference_attention(family), device="cuda")
    cas = tiny_model(family, "cascade", device="cuda")
    gen = dict(max_new_tokens=9, pad_token_id=0, return_dict_in_generate=True)
    gen.update({"greedy": dict(do_sample=False),
                "samples": dict(do_sample=True, top_k=20, num_return_sequences=3)}[mode])
    compiled_before = counters["stats"]["unique_graphs"]
    for call, seed in enumerate((51, 52)):  # two batches of one layout (other tokens)
        ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=seed, system=37, block=19, groups=2,
                                                              per_group=3)))
        torch.manual_seed(seed)
        want = ref.generate(ids, attention_mask=mask, **gen)
        caches, before = [], recorded_steps(cas)
        torch.manual_seed(seed)
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           cascade_options=_graphs_options(), **gen)
        after = recorded_steps(cas)
        assert caches[0].is_compileable and caches[0].num_levels >= 1
        # The host's count of written columns follows replayed steps (which run no Python).
        assert caches[0].suffix_length == int(caches[0].layers[0].cumulative_length) > 0
        assert torch.equal(got.sequences, want.sequences), (family, mode, call)
        replayed = after["replayed"] - before["replayed"]
        if call == 0:  # step 1 runs once eagerly (warm-up), then recorded and replayed
            assert after["recorded"] - before["recorded"] == 1 and replayed == gen["max_new_tokens"] - 2
        else:  # replayed from the first decode step
            assert after["recorded"] == before["recorded"] and replayed == gen["max_new_tokens"] - 1
    assert counters["stats"]["unique_graphs"] == compiled_before, "decode_step='graphs' compiled something"
    assert not hasattr(cas, "_compiled_call")


def test_gpu_recorded_decode_step_for_a_stream_of_layouts():
    """decode_step="graphs" over batches with other sharing trees (1-3 levels, another buffer bucket): exact tokens,
    one graph recorded per new layout, no compilation."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import recorded_steps
    from test_compiled_generate import LAYOUT_STREAM, MAX_NEW_STREAM

    ref = tiny_model("llama", "sdpa", device="cuda")
    cas = tiny_model("llama", "cascade", device="cuda")
    gen = dict(max_new_tokens=MAX_NEW_STREAM, pad_token_id=0, do_sample=False)
    compiled_before = counters["stats"]["unique_graphs"]
    for seed, (levels, own) in enumerate(LAYOUT_STREAM):
        ids, mask = (t.cuda() for t in pad_batch(tree_prompts(levels, own, rows=8, seed=60 + seed)))
        before = recorded_steps(cas)["recorded"]
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=_graphs_options(), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), seed
        assert recorded_steps(cas)["recorded"] - before <= 1
    assert counters["stats"]["unique_graphs"] == compiled_before


def _layers_options(**extra):
    return dict(cost_model=None, min_shared_tokens=2, decode_step="layers", **extra)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "samples"])
def test_gpu_compiled_layers_decode_step_matches_reference(family, mode):
    """decode_step="layers": the recorded step with the decoder layers compiled (hf_cascade.compiled_layers), fp32
    tokens equal to the reference; the layers compile at the first call only (a second call with other tokens
    replays the recorded step, compiling nothing)."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import recorded_steps
    from hf_cascade.compiled_layers import layer_compilations

    ref = tiny_model(family, reference_attention(family), device="cuda", num_hidden_layers=3)
    cas = tiny_model(family, "cascade", device="cuda", num_hidden_layers=3)
    gen = dict(max_new_tokens=9, pad_token_id=0, return_dict_in_generate=True)
    gen.update({"greedy": dict(do_sample=False),
                "samples": dict(do_sample=True, top_k=20, num_return_sequences=3)}[mode])
    graphs = []
    for call, seed in enumerate((53, 54)):
        ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=seed, system=37, block=19, groups=2,
                                                              per_group=3)))
        torch.manual_seed(seed)
        want = ref.generate(ids, attention_mask=mask, **gen)
        before = recorded_steps(cas)
        torch.manual_seed(seed)
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=_layers_options(), **gen)
        assert torch.equal(got.sequences, want.sequences), (family, mode, call)
        if call == 0:  # step 1 runs once (the layers compile), then recorded and replayed
            assert recorded_steps(cas)["recorded"] - before["recorded"] == 1
        graphs.append(counters["stats"]["unique_graphs"])
    assert layer_compilations(cas) == 2  # one run + one recording, in the first call only
    assert graphs[1] == graphs[0], "the second call compiled again"
    assert not hasattr(cas, "_compiled_call")  # transformers' whole-model compiled step never ran


def test_gpu_compiled_layers_compile_once_for_a_stream_of_layouts():
    """decode_step="layers" over batches with other sharing trees (1-3 levels, another buffer bucket): exact tokens;
    the decode step's layers compile for the first batch only (one layer's code serves every layer and every
    layout), the prefill's once per kind of forward (one row or several, with or without a padding mask: the first
    two layouts show them all); later layouts compile nothing."""
    from torch._dynamo.utils import counters

    from test_compiled_generate import LAYOUT_STREAM, MAX_NEW_STREAM

    ref = tiny_model("llama", "sdpa", device="cuda", num_hidden_layers=4)
    cas = tiny_model("llama", "cascade", device="cuda", num_hidden_layers=4)
    gen = dict(max_new_tokens=MAX_NEW_STREAM, pad_token_id=0, do_sample=False)
    graphs = []
    for seed, (levels, own) in enumerate(LAYOUT_STREAM):
        ids, mask = (t.cuda() for t in pad_batch(tree_prompts(levels, own, rows=8, seed=70 + seed)))
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=_layers_options(), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), seed
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(set(graphs[1:])) == 1, f"graphs compiled after the second batch: {graphs}"


def test_gpu_compiled_layers_serve_new_batch_sizes_without_compiling():
    """decode_step="layers" (the compiled tier's step): the batch is symbolic from the first compilation, so sampled
    batches of 3 x 4, 5 x 4 and 9 x 4 rows (no bucket: sampling) compile the decode step once; fp32 tokens equal to
    the reference."""
    from torch._dynamo.utils import counters

    ref = tiny_model("llama", "sdpa", device="cuda", num_hidden_layers=3)
    cas = tiny_model("llama", "cascade", device="cuda", num_hidden_layers=3)
    gen = dict(max_new_tokens=7, pad_token_id=0, do_sample=True, top_k=20, num_return_sequences=4)
    graphs = []
    for prompts in (3, 5, 9):
        ids, mask = (t.cuda() for t in pad_batch(tree_prompts([(1, 29), (prompts, 9)], 3, rows=prompts,
                                                              seed=140 + prompts)))
        torch.manual_seed(prompts)
        want = ref.generate(ids, attention_mask=mask, **gen)
        torch.manual_seed(prompts)
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=_layers_options(), **gen)
        assert torch.equal(got, want), prompts
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0], f"a new batch size compiled the layers again: unique graphs {graphs}"


def test_gpu_disable_compile_records_the_steps_and_compiles_nothing():
    """``disable_compile=True`` (TRL passes it to every rollout), default options: the decode steps recorded into
    CUDA graphs on fixed buffers, nothing compiled, fp32 tokens of a sampled n-samples batch equal to the
    reference's."""
    from torch._dynamo.utils import counters

    from hf_cascade.decode.captured_step import recorded_steps

    ref = tiny_model("qwen2", "sdpa", device="cuda")
    cas = tiny_model("qwen2", "cascade", device="cuda")
    gen = dict(max_new_tokens=9, pad_token_id=0, do_sample=True, top_k=0, num_return_sequences=4,
               disable_compile=True)
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=77, system=41, block=13, groups=2, per_group=2)))
    graphs, before, caches = counters["stats"]["unique_graphs"], recorded_steps(cas), []
    torch.manual_seed(3)
    want = ref.generate(ids, attention_mask=mask, **gen)
    torch.manual_seed(3)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                       cascade_options=dict(cost_model=None, min_shared_tokens=2), **gen)
    assert torch.equal(got, want)
    assert caches[0].max_suffix_length is not None, "disable_compile=True: no fixed buffers"
    assert recorded_steps(cas)["recorded"] > before["recorded"], "disable_compile=True: no step recorded"
    assert counters["stats"]["unique_graphs"] == graphs, "disable_compile=True compiled something"


def test_gpu_compiled_layers_failure_loses_nothing(monkeypatch):
    """A compiler error in the middle of the first compiled step (after some layers wrote their KV): the cache's
    written lengths are restored, the step runs with the eager layers, and the tokens are exact; later steps record
    the eager layers."""
    import contextlib

    import hf_cascade.decode.captured_step as captured_step

    ref = tiny_model("llama", "sdpa", device="cuda", num_hidden_layers=3)
    cas = tiny_model("llama", "cascade", device="cuda", num_hidden_layers=3)
    real = captured_step.compiled_layers

    @contextlib.contextmanager
    def failing_at_the_last_layer(model, cache, dynamic=False):
        last = model.model.layers[-1]

        def fail(*args, **kwargs):
            raise RuntimeError("injected compiler error")

        with real(model, cache, dynamic) as entered:
            last._compiled_call_impl = fail
            yield entered

    monkeypatch.setattr(captured_step, "compiled_layers", failing_at_the_last_layer)
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=55, system=37, block=19, groups=2, per_group=3)))
    gen = dict(max_new_tokens=8, pad_token_id=0, do_sample=False)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                       cascade_options=_layers_options(), **gen)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen))
    assert captured_step._model_graphs(cas).layers_failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_greedy_tokens_equal_argmax(dtype):
    """On CUDA the greedy loop's two-reduction argmax (hf_cascade.decode.sampling.greedy_tokens) picks the index argmax of
    the fp32 copy picks: Llama-3's vocabulary (128256 = 16 chunks), ties and NaN included."""
    from hf_cascade.decode.sampling import greedy_tokens

    g = torch.Generator(device="cuda").manual_seed(6)
    for trial in range(20):
        logits = (torch.randn(32, 128256, device="cuda", generator=g) * 3).round().to(dtype)
        if trial % 4 == 0:
            logits[trial % 32, 100_000] = float("nan")
            logits[trial % 32, 5] = float("nan")
        want = torch.argmax(logits.float(), dim=-1)
        assert torch.equal(greedy_tokens(logits), want), trial


def _hf_cascade_triton_variants() -> int:
    """hf_cascade's Triton kernels compiled (or loaded) in this process so far."""
    from triton.runtime.jit import JITFunction

    from hf_cascade.ops import _cascade_kernel, _merge_kernel, _prefix_kernel, _suffix_kernel

    total = 0
    for module in (_cascade_kernel, _merge_kernel, _prefix_kernel, _suffix_kernel):
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                total += sum(len(cache[0]) for cache in value.device_caches.values())
    return total


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gpu_first_calls_compile_nothing_and_move_up_exactly(family, monkeypatch):
    """The default path's tiers (hf_cascade.tiers) on a fresh model with no compile record: the first calls run the
    built-in kernels with the recorded (not compiled) step, compile nothing (no dynamo graph, no new hf_cascade
    Triton kernel), and give the reference's fp32 tokens, also for a second layout of the same shapes (the recorded
    graph is keyed on the layout the built-in kernels read on the host); once the regret is forced up, the Triton
    tier and then the compiled tier give the same tokens."""
    from torch._dynamo.utils import counters

    from hf_cascade import tier_build, tiers

    assert not tier_build.background_builds_on()  # the ski rental alone (conftest; the background build: below)
    ref = tiny_model(family, reference_attention(family), device="cuda", num_hidden_layers=3)
    cas = tiny_model(family, "cascade", device="cuda", num_hidden_layers=3)
    gen = dict(max_new_tokens=7, min_new_tokens=7, pad_token_id=0, do_sample=False)
    first = tree_prompts([(1, 24), (2, 12)], 5, rows=6, seed=90)
    second = [list(row) for row in first]  # the same node sizes, row 2 moved to the second node of level 2
    second[2][25:37] = first[3][25:37]
    layouts = [first, second]
    graphs, variants = counters["stats"]["unique_graphs"], _hf_cascade_triton_variants()
    for call, rows in enumerate(layouts + layouts[:1]):
        ids, mask = (t.cuda() for t in pad_batch(rows))
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), call
    assert [name for name, _ in tiers.tier_report(cas)["calls"]] == ["builtin"] * 3
    assert counters["stats"]["unique_graphs"] == graphs, "a first call compiled with torch.compile"
    assert _hf_cascade_triton_variants() == variants, "a first call built hf_cascade Triton kernels"
    state = tiers.tier_state(cas)
    for tier in ("triton", "compiled"):
        state.regret[tier] = 1e6  # as after many long calls
        ids, mask = (t.cuda() for t in pad_batch(layouts[1]))
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2), **gen)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), tier
        assert tiers.tier_report(cas)["calls"][-1][0] == tier


@pytest.mark.background_build
@pytest.mark.parametrize("family, do_sample", [("llama", False), ("llama", True), ("gemma2", False),
                                               ("gemma2", True)])
def test_gpu_compiled_tier_built_in_the_background(family, do_sample, monkeypatch):
    """The default policy: after the first call (built-in tier), a child process runs that call's rows on the model
    cut to two layers, filling the compile caches (hf_cascade.tier_build); the calls meanwhile stay below the
    compiled tier with the reference's fp32 tokens (seeded samples too), and once the regret pays for compiling from
    the warm caches the call that moves up compiles in the foreground; the calls after it run the compiled tier, for
    this layout and another one."""
    from hf_cascade import tiers
    from hf_cascade.tier_build import wait_for_build

    ref = tiny_model(family, reference_attention(family), device="cuda", num_hidden_layers=3)
    cas = tiny_model(family, "cascade", device="cuda", num_hidden_layers=3)
    gen = dict(max_new_tokens=7, min_new_tokens=7, pad_token_id=0, do_sample=do_sample)
    if do_sample:
        gen["top_k"] = 20
    first = tree_prompts([(1, 24), (2, 12)], 5, rows=6, seed=91)
    second = tree_prompts([(1, 30)], 9, rows=5, seed=92)
    options = dict(cost_model=None, min_shared_tokens=2)

    def check(rows, what):
        ids, mask = (t.cuda() for t in pad_batch(rows))
        torch.manual_seed(7)
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_options=options,
                           **gen)
        torch.manual_seed(7)
        assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen)), what
        return tiers.tier_report(cas)

    report = check(first, "first call")
    assert report["calls"][0][0] == "builtin" and report["background_build"]["running"], report
    during = 0
    while tiers.tier_report(cas)["background_build"]["running"] and during < 20:
        report = check(second if during % 2 else first, f"call {during} during the build")
        during += 1
    assert wait_for_build(cas, timeout=600), tiers.tier_report(cas)
    report = tiers.tier_report(cas)
    assert report["background_build"]["caches_filled"] and report["background_build"]["error"] is None, report
    assert report["background_build"]["prewarm"]["returncode"] == 0, report
    for name in ("WARM_COMPILE_COST_S", "WARM_TRITON_COST_S"):  # tiny calls: any regret pays for warm caches
        monkeypatch.setattr(tiers, name, 0.0)
    for rows, what in ((first, "first layout, compiled"), (second, "second layout, compiled")):
        report = check(rows, what)
        assert report["calls"][-1][0] == "compiled", report
    names = [name for name, _ in report["calls"]]
    assert set(names[1:-2]) <= {"builtin", "triton"}, names


@pytest.mark.background_build
def test_gpu_triton_tier_built_in_the_background_where_the_step_may_not_compile(monkeypatch):
    """TRL's rollouts pass ``disable_compile=True``: the steps are recorded, never compiled. After the first call
    (built-in tier) a child fills the Triton tier's kernels (hf_cascade.tier_build, ``compiled=False``: nothing
    compiled); once it is done the ski rental moves the calls to the Triton tier with the recorded (small) cost,
    tokens equal to the reference's in fp32 throughout; the compiled tier is never taken. Its start is one warning
    (visible at transformers' default verbosity), naming the switch."""
    from transformers.testing_utils import CaptureLogger

    from hf_cascade import tier_build, tiers
    from hf_cascade.tier_build import wait_for_build

    ref = tiny_model("llama", reference_attention("llama"), device="cuda", num_hidden_layers=3)
    cas = tiny_model("llama", "cascade", device="cuda", num_hidden_layers=3)
    gen = dict(max_new_tokens=7, min_new_tokens=7, pad_token_id=0, do_sample=False, disable_compile=True)
    rows = tree_prompts([(1, 24), (2, 12)], 5, rows=6, seed=93)
    ids, mask = (t.cuda() for t in pad_batch(rows))
    want = ref.generate(ids, attention_mask=mask, **gen)

    def call():
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                           cascade_options=dict(cost_model=None, min_shared_tokens=2), **gen)
        assert torch.equal(got, want)
        return tiers.tier_report(cas)

    with CaptureLogger(tier_build.logger) as log:
        report = call()
    assert report["calls"][0][0] == "builtin" and report["background_build"]["running"], report
    assert "child process(es) now build the triton tier" in log.out and "HF_CASCADE_BACKGROUND=off" in log.out, log.out
    assert wait_for_build(cas, timeout=600), tiers.tier_report(cas)
    report = tiers.tier_report(cas)
    assert report["background_build"]["caches_filled"] and report["background_build"]["error"] is None, report
    monkeypatch.setattr(tiers, "WARM_TRITON_COST_S", 0.0)  # tiny calls: any regret pays for warm caches
    monkeypatch.setattr(tiers, "TRITON_KEY_COST_S", 0.0)
    for _ in range(2):
        report = call()
    assert [name for name, _ in report["calls"]][-1] == "triton", report
    assert "compiled" not in {name for name, _ in report["calls"]}, report


def test_gpu_builtin_kernels_bf16_close_to_sdpa():
    """bf16 on the built-in kernels (FlashAttention-2 for the shared prefix): the first step's logits within bf16
    noise of sdpa's, as the Triton path's are (test_gpu_bf16_generate_close_to_sdpa)."""
    ref = tiny_model("llama", "sdpa", device="cuda", dtype=torch.bfloat16)
    cas = tiny_model("llama", "cascade", device="cuda", dtype=torch.bfloat16)
    ids, mask = (t.cuda() for t in pad_batch(make_prompts(seed=12, system=64, block=32)))
    gen = dict(max_new_tokens=1, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = ref.generate(ids, attention_mask=mask, **gen).logits[0].float()
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None)
    inputs[CACHE_KWARG].builtin_kernels = True
    got = cas.generate(**inputs, **gen).logits[0].float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("Lq", [1, 5])
def test_gpu_builtin_level_in_one_varlen_call(monkeypatch, Lq):
    """The first tier's prefix level in one variable-length FlashAttention-2 call equals the node-by-node path within
    bf16 rounding (rows interleaved across nodes, a row without a node, GQA 12/2, D 128), eagerly and replayed from a
    CUDA graph (generate() on the first tier in bf16: test_gpu_builtin_kernels_bf16_close_to_sdpa)."""
    from hf_cascade.ops import builtin_cascade, plan_shared_prefix

    g = torch.Generator().manual_seed(11)
    row_node = torch.tensor([2, 0, 1, -1, 0, 2, 2, 1, 0, 1, 2])
    plan = plan_shared_prefix(row_node, torch.tensor([0, 70, 190, 333]), device="cuda")
    query = torch.randn(row_node.numel(), 12, Lq, 128, generator=g).cuda().bfloat16()
    k_pre, v_pre = (torch.randn(2, 340, 128, generator=g).cuda().bfloat16() for _ in range(2))
    assert builtin_cascade._varlen_applies(query, k_pre, v_pre, plan, None)
    got = builtin_cascade._prefix_level(query, k_pre, v_pre, plan, 0.09, None)
    with monkeypatch.context() as m:
        m.setattr(builtin_cascade, "_varlen_applies", lambda *a: False)
        want = builtin_cascade._prefix_level(query, k_pre, v_pre, plan, 0.09, None)
    keyed = (row_node >= 0).cuda()  # (row 3 has no node: out 0, LSE -inf on both paths)
    assert (got[0] - want[0])[keyed].abs().max() <= 0.01 and (got[1] - want[1])[keyed].abs().max() <= 1e-3
    assert torch.all(got[1][3] == float("-inf")) and torch.all(got[0][3] == 0) and torch.equal(want[1][3], got[1][3])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        builtin_cascade._prefix_level(query, k_pre, v_pre, plan, 0.09, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = builtin_cascade._prefix_level(query, k_pre, v_pre, plan, 0.09, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(recorded[0], got[0]) and torch.equal(recorded[1], got[1])
    in_order = plan_shared_prefix(row_node.sort().values.clamp(min=0), torch.tensor([0, 70, 190, 333]), device="cuda")
    assert in_order.varlen_layout[0] is None  # (nothing gathered or scattered)
    got = builtin_cascade._prefix_level(query, k_pre, v_pre, in_order, 0.09, None)
    with monkeypatch.context() as m:
        m.setattr(builtin_cascade, "_varlen_applies", lambda *a: False)
        want = builtin_cascade._prefix_level(query, k_pre, v_pre, in_order, 0.09, None)
    assert (got[0] - want[0]).abs().max() <= 0.01 and (got[1] - want[1]).abs().max() <= 1e-3


def test_gpu_warmup_fills_the_caches_and_writes_the_markers(tmp_path, monkeypatch):
    """`hf_cascade warmup` (warm_up): per batch size one compiled call, then the background build's children run
    in the foreground to their end (the rows, and the grid of layouts with the batches added); the markers say both
    tiers were built, so a new process expects the warm (small) costs, not the cold ones, and starts no build."""
    from hf_cascade import tiers
    from hf_cascade.engine import engine_of
    from hf_cascade.warmup import warm_up

    monkeypatch.setenv("HF_CASCADE_RECORDS", str(tmp_path))
    model = tiny_model("llama", "cascade", device="cuda", num_hidden_layers=2)
    lines = []
    results = warm_up(model, rows=(3,), prompt_tokens=40, new_tokens=4, report=lines.append, grid_budget_s=20.0)
    assert [r.get("tier") or r["batch"] for r in results] == ["compiled", "background build"], (results, lines)
    assert results[1]["error"] is None and results[1]["grid"]["done"] >= 2, results  # the batch, on both paths
    assert len(lines) == 2, lines
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".compiled", ".triton"], (results, list(tmp_path.iterdir()))
    engine_of(model).forget("tiers")  # what a later process expects
    state = tiers.tier_state(model)
    assert tiers.caches_warm(model, state) and tiers.caches_warm(model, state, "triton")
    assert tiers._cost("compiled", True) == tiers.WARM_COMPILE_COST_S