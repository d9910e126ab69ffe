"""Issue 33: window-bounded layers inside compiled and recorded decode steps.

In a decode step with fixed buffers a bounded layer runs ``torch.ops.hf_cascade.bounded_cascade_attention``: the
layout from the plan's index tensors, the bounds computed on the device from the written suffix length. On CPU its
body runs the fp32 PyTorch path (the reference) or, forced, the Triton kernels in the interpreter; either way the
greedy tokens equal the family's reference attention. GPU: ``tests/test_gpu_generate.py``-style checks in
``test_gpu_windows_steps`` below (recorded CUDA graphs, the default and compiled tiers).
"""

import pytest
import torch

import hf_cascade
import hf_cascade.ops.cascade_wrapper as cascade_wrapper
import hf_cascade.windows as windows
from hf_cascade.model_zoo import available_families
from hf_cascade.ops.bounded import BOUNDED_PATHS, bounded_cascade_attention
from hf_cascade.ops.cascade_wrapper import planned_attention, step_inputs
from hf_cascade.ops.plan import plan_cascade

from _ops_common import INTERPRET

# These tests put CPU tensors through the Triton kernels: the interpreter's (CI). On a GPU machine the same kernels
# run on CUDA tensors in test_gpu_windows_steps and test_gpu_bounded_op_at_gemma3_decode_shapes.
cpu_triton = pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton need TRITON_INTERPRET=1")
from test_generate import model_pair, pad_batch, tree_prompts

_AVAILABLE = set(available_families())
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def _force_triton(monkeypatch):
    """The Triton kernels (interpreter) wherever a bounded layer picks its backend, as on CUDA."""
    monkeypatch.setattr(cascade_wrapper, "resolve_backend", lambda *args: "triton")  # (the one door)


@pytest.mark.parametrize("body", ["torch", pytest.param("triton", marks=cpu_triton)])
@pytest.mark.parametrize("family, window", [("gemma3", 5), ("mistral", 6), ("gpt_oss", 5)])
def test_recorded_step_runs_the_bounded_op(family, window, body, monkeypatch):
    """The path a recorded step takes (static_step_mode around each decode step, fixed buffers), run eagerly: every
    bounded layer of every step goes through the op (Mistral: every layer bounded, so the bounded layers plan the
    op's index tensors themselves), and the tokens equal the reference's."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from hf_cascade.decode.captured_step import static_step_mode
    from test_captured_step import _in_decode_steps

    if body == "triton":
        _force_triton(monkeypatch)
    ref, cas = model_pair(family, sliding_window=window)
    ids, mask = pad_batch(tree_prompts([(1, 9), (2, 5)], 4, rows=4, seed=83))
    want = ref.generate(ids, attention_mask=mask, **GEN)
    caches = []
    BOUNDED_PATHS.clear()
    with _in_decode_steps(cas, static_step_mode) as entered:
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           disable_compile=True, cascade_options=dict(min_shared_tokens=2, cost_model=None,
                                                                      fixed_buffers=True), **GEN)
    assert len(entered) == GEN["max_new_tokens"] - 1
    assert torch.equal(got, want)
    bounded_layers = sum(windows.layer_window(caches[0].attention_module(i)) is not None
                         for i in range(cas.config.num_hidden_layers))
    assert BOUNDED_PATHS[f"step:op/{body}"] == bounded_layers * len(entered), dict(BOUNDED_PATHS)
    assert BOUNDED_PATHS["step:torch"] == 0
    assert BOUNDED_PATHS[f"eager:{'triton' if body == 'triton' else 'torch'}"] > 0  # the prefill


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_recorded_step_of_a_windowed_model_replays_in_the_next_call(family):
    """The bounded layers' row shifts come from the model's step buffers, after the op's index tensors: a second
    call with the same shapes (other tokens) has every tensor its decode step reads at the same address, so it
    replays the graph the first call recorded (the key is equal); the plan's own tensors are not read."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from hf_cascade.decode.captured_step import CapturedDecodeStep
    from test_captured_step import _call, _step_inputs

    _, cas = model_pair(family, sliding_window=6)
    layout = ([(1, 20), (2, 6)], 5)
    keys = []
    for seed in (86, 87):
        ids, mask = pad_batch(tree_prompts(*layout, rows=6, seed=seed))
        cache = _call(cas, ids, mask)
        assert cache._wrapper.shifts is not None and cache._wrapper.shifts.from_step_buffers and cache._wrapper.op_inputs is not None
        read = {t.data_ptr() for t in cache.static_step_tensors()}
        assert cache._wrapper.shifts.level_shift.data_ptr() in read and cache._wrapper.shifts.suffix_shift.data_ptr() in read
        assert not any(t.data_ptr() in read for t in cache._wrapper.layout.row_node)
        keys.append(CapturedDecodeStep(cas, cache)._key(_step_inputs(cache, cache.layers[0].keys.shape[0]))[0])
    assert keys[0] == keys[1]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_compiled_decode_runs_the_bounded_op(family):
    """generate()'s compiled decode step (CPU, aot_eager, fullgraph: a graph break fails) calls the op: its body runs
    at every step, the bounds traced as device arithmetic on the written length."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from test_compiled_generate import cpu_compile_config

    ref, cas = model_pair(family, sliding_window=6)
    torch._dynamo.reset()
    ids, mask = pad_batch(tree_prompts([(1, 9), (2, 5)], 4, rows=4, seed=84))
    want = ref.generate(ids, attention_mask=mask, **GEN)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=GEN["max_new_tokens"])
    BOUNDED_PATHS.clear()
    got = cas.generate(**inputs, compile_config=cpu_compile_config(), **GEN)
    assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
    assert torch.equal(got[:, inputs["input_ids"].shape[1]:], want[:, ids.shape[1]:])
    assert BOUNDED_PATHS["step:op/torch"] > 0 and BOUNDED_PATHS["step:torch"] == 0, dict(BOUNDED_PATHS)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_cache_serves_each_layer_with_its_attention_module(family):
    """Gemma 3 and GPT-OSS decoder layers keep a ``layer_idx`` of their own: the module a compiled layer step attends
    with (``cache.attention_module``) is the attention module, with its own window and sinks, not the decoder layer
    (whose config would give every layer the window)."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from hf_cascade.model_scan import attention_modules

    _, cas = model_pair(family, sliding_window=5)
    types = cas.config.layer_types
    for layer_idx, modules in attention_modules(cas).items():
        (module,) = list(modules)
        assert module is cas.model.layers[layer_idx].self_attn
        assert (windows.layer_window(module) is not None) == (types[layer_idx] == "sliding_attention")


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_compiled_layers_step_on_windowed_models(family):
    """decode_step="layers" as a step runs before it is recorded (CPU): the decoder layers compiled, attention one
    op per layer that finds the layer's attention module by index; full layers stay full, sinks stay merged."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from hf_cascade.decode.captured_step import static_step_mode
    from hf_cascade.compiled_layers import compiled_layers
    from hf_cascade.transformers_compat import CACHE_KWARG
    from test_captured_step import _in_decode_steps

    ref, cas = model_pair(family, sliding_window=5)

    def layers_compiled(inputs):
        return compiled_layers(cas, inputs[CACHE_KWARG])

    layers_compiled.takes_inputs = True
    ids, mask = pad_batch(tree_prompts([(1, 9), (2, 5)], 4, rows=4, seed=83))
    gen = dict(GEN, max_new_tokens=8, min_new_tokens=8)
    BOUNDED_PATHS.clear()
    with _in_decode_steps(cas, static_step_mode, layers_compiled) as entered:
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, disable_compile=True,
                           cascade_options=dict(min_shared_tokens=2, cost_model=None, fixed_buffers=True,
                                                cpu_decode_threads=None), **gen)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, **gen))
    sliding = cas.config.layer_types.count("sliding_attention")
    assert BOUNDED_PATHS["step:op/torch"] == sliding * len(entered), dict(BOUNDED_PATHS)


def _op_case(seed, B=5, Hkv=2, G=2, D=16, Dv=16, S=12, window=9, lq=1, pad_levels=2):
    """A planned two-level layout (padded with empty slots in front, as a compiled step takes it), its suffix KV, and
    sliding-window bounds whose tiles mix blocks below, across and above their rows' bounds."""
    torch.manual_seed(seed)
    starts = [[0, 40], [0, 23, 23, 53]]  # level 1: nodes of 23, 0 and 30 keys
    row_nodes = torch.tensor([[0, 0, 0, 0, -1], [0, 2, 2, 1, -1]])
    plan = plan_cascade(row_nodes, starts, B, torch.device("cpu"))
    q = torch.randn(B, Hkv * G, lq, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    pre_k = [torch.randn(Hkv, s[-1], D) for s in starts]
    pre_v = [torch.randn(Hkv, s[-1], Dv) for s in starts]
    written = torch.tensor(S - 3)
    shifts = windows.row_shifts([type("L", (), {"node_starts": s})() for s in starts], row_nodes, None, B,
                                torch.device("cpu"))
    key_lower, suffix_lower = windows.bound_columns(shifts, lq, written, 2, window=window, chunk=None)
    slots_k = [torch.randn(Hkv, 2, D) for _ in range(pad_levels)] + pre_k
    slots_v = [torch.randn(Hkv, 2, Dv) for _ in range(pad_levels)] + pre_v
    op_inputs = [t for level in step_inputs(plan, q, k, slots_k) for t in level]
    return q, k, v, pre_k, pre_v, plan, slots_k, slots_v, op_inputs, written, key_lower, suffix_lower


@pytest.mark.parametrize("body", ["torch", pytest.param("triton", marks=cpu_triton)])
@pytest.mark.parametrize("window", [3, 9, 30, 1000])
@pytest.mark.parametrize("dims", [(16, 16), (24, 12)])
def test_bounded_op_matches_the_reference(body, window, dims, monkeypatch):
    """The op's body on padded slots (index tensors only) against the reference on the plan's layout."""
    if body == "triton":
        monkeypatch.setattr(cascade_wrapper, "resolve_backend", lambda *args: "triton")
    D, Dv = dims
    q, k, v, pre_k, pre_v, plan, slots_k, slots_v, op_inputs, written, key_lower, suffix_lower = _op_case(
        1, D=D, Dv=Dv, window=window)
    mask = torch.ones(1, 1, k.shape[2], dtype=torch.bool)
    want, want_lse = bounded_cascade_attention(
        q, k, v, pre_k, pre_v, [p.node_starts_dev for p in plan.levels], list(plan.row_node), key_lower, suffix_lower,
        scale=0.3, mask=mask, key_length=written)
    got, lse = torch.ops.hf_cascade.bounded_cascade_attention(q, k, v, slots_k, slots_v, op_inputs, mask, 0.3, None,
                                                              None, written, key_lower, suffix_lower)
    assert got.shape == (q.shape[0], q.shape[2], q.shape[1], Dv) and got.is_contiguous()
    torch.testing.assert_close(got, want.transpose(1, 2), atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=2e-5, rtol=2e-5)
    # Every layer's slots stacked, this layer's read inside the op (as the compiled step passes them).
    stacked_k = [torch.stack([torch.zeros_like(s), s]) for s in slots_k]
    stacked_v = [torch.stack([torch.zeros_like(s), s]) for s in slots_v]
    again, _ = planned_attention(q, k, v, stacked_k, stacked_v, op_inputs, mask, 0.3, None, 1, written,
                                 key_lower, suffix_lower)
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_bounded_op_refuses_bounds_of_another_layout():
    q, k, v, _, _, _, slots_k, slots_v, op_inputs, written, key_lower, suffix_lower = _op_case(2)
    with pytest.raises(ValueError, match="3 level bounds for 4 levels"):
        planned_attention(q, k, v, slots_k, slots_v, op_inputs, None, 0.3, None, None, written,
                          key_lower + key_lower[:1], suffix_lower)


@cpu_triton
@pytest.mark.parametrize("splits, block_n", [(1, 16), (3, 16), (2, 32)])
def test_prefix_kernel_bounded_and_free_blocks(splits, block_n):
    """Bounds close together (sliding windows: a tile's rows a few positions apart) over a long node: the prefix
    kernel runs masked blocks up to the tile's largest bound, unmasked ones after it and a masked last block."""
    from hf_cascade.ops import cascade_attention, plan_shared_prefix
    from hf_cascade.ops._launch import launch_cascade, launch_configs

    torch.manual_seed(7)
    B, Hkv, G, S, Lq, D, T = 4, 2, 2, 5, 2, 16, 150
    plan = plan_shared_prefix(torch.tensor([0, 0, 0, 0]), torch.tensor([0, T]))
    q = torch.randn(B, Hkv * G, Lq, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    pre_k, pre_v = torch.randn(Hkv, T, D), torch.randn(Hkv, T, D)
    for base in (-20, 0, 37, 61, 149, 160):
        key_lower = [base + torch.randint(0, 4, (B, 1)) + torch.arange(Lq)[None, :]]
        suffix_lower = torch.zeros(B, Lq, dtype=torch.int64)
        prefixes = [(pre_k, pre_v, plan)]
        want = cascade_attention(q, k, v, prefixes, scale=0.25, backend="torch", key_lower=key_lower,
                                 suffix_lower=suffix_lower)
        for fuse in (True, False):
            _, configs = launch_configs(q, k, prefixes, fuse_suffix=fuse)
            configs = [(sched, splits, block_m, block_n, warps, stages)
                       for sched, _, block_m, _, warps, stages in configs]
            got = launch_cascade(q, k, v, [(pre_k, pre_v)], configs, fuse, scale=0.25, mask=None, causal=True,
                                 softcap=None, key_lower=key_lower, suffix_lower=suffix_lower)
            torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=2e-5)


@cpu_triton
def test_unshared_prefill_takes_the_bound_in_the_suffix_kernel():
    """A forward with no shared level (a segment's own prefill, longer than the window): the suffix kernel alone."""
    torch.manual_seed(3)
    B, Hkv, G, L, D = 2, 2, 2, 40, 16
    q, k, v = torch.randn(B, Hkv * G, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    shifts = windows.RowShifts(level_shift=torch.zeros(0, B, dtype=torch.int64),
                               suffix_shift=torch.zeros(B, dtype=torch.int64), first_position=[0] * B)
    args = (shifts, None, q, k, v, [], [], None)
    kw = dict(scale=0.25, softcap=None, window=7, chunk=None, key_length=None)
    want = windows.bounded_attend(*args, **kw, backend="torch")
    got = windows.bounded_attend(*args, **kw, backend="triton")
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("compile_choice", [None, "now"])
def test_gpu_windows_steps(compile_choice):
    """CUDA: a tiny Gemma 3 (fp32, window 5) through hf_cascade.generate with recorded decode steps (the default
    tier's built-in kernels, or the compiled tier: the bounded op's Triton kernels in the recorded graph) equals
    its reference's tokens, and the decode steps took the expected path."""
    if "gemma3" not in _AVAILABLE:
        pytest.skip("no gemma3 config in this transformers")
    ref, cas = model_pair("gemma3", sliding_window=5)
    ref, cas = ref.cuda(), cas.cuda()
    ids, mask = pad_batch(tree_prompts([(1, 19), (2, 9)], 4, rows=6, seed=85))
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(GEN, max_new_tokens=12, min_new_tokens=12)
    want = ref.generate(ids, attention_mask=mask, **gen)
    options = dict(min_shared_tokens=2, cost_model=None)
    if compile_choice:
        options["compile"] = compile_choice
    BOUNDED_PATHS.clear()
    for _ in range(2):  # a second call replays the recorded graphs
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_options=options,
                           **gen)
        assert torch.equal(got, want)
    if compile_choice == "now":  # the compiled tier: the bounded op's Triton kernels in the recorded steps
        assert BOUNDED_PATHS["step:op/triton"] > 0 and BOUNDED_PATHS["step:torch"] == 0, dict(BOUNDED_PATHS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("window", [100, 1 << 20])
def test_gpu_bounded_op_at_gemma3_decode_shapes(window):
    """CUDA, bf16, head_dim 256 (the prefix and suffix launches apart): the bounded op against the fp32 reference,
    and, with bounds that cut nothing, against the unbounded op."""
    from hf_cascade.windows import RowShifts, bound_columns

    torch.manual_seed(0)
    B, Hq, Hkv, D, T, S, dev = 8, 8, 4, 256, 600, 24, "cuda"
    rand = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, pre_k, pre_v = rand(B, Hq, 1, D), rand(B, Hkv, S, D), rand(B, Hkv, S, D), rand(Hkv, T, D), rand(Hkv, T, D)
    plan = plan_cascade(None, [[0, T]], B, torch.device(dev))
    op_inputs = [t for level in step_inputs(plan, q, k, [pre_k]) for t in level]
    written = torch.tensor(S - 5, device=dev)
    shifts = RowShifts(level_shift=torch.zeros(1, B, dtype=torch.int64, device=dev),
                       suffix_shift=torch.arange(T, T + B, device=dev), first_position=list(range(T, T + B)))
    key_lower, suffix_lower = bound_columns(shifts, 1, written, 1, window=window, chunk=None)
    got, lse = torch.ops.hf_cascade.bounded_cascade_attention(q, k, v, [pre_k], [pre_v], op_inputs, None, 0.0625,
                                                              None, None, written, key_lower, suffix_lower)
    want, want_lse = bounded_cascade_attention(q, k, v, [pre_k], [pre_v], [plan.levels[0].node_starts_dev],
                                               list(plan.row_node), key_lower, suffix_lower, scale=0.0625,
                                               key_length=written)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)
    if window > T + S:
        plain, _ = torch.ops.hf_cascade.cascade_attention(q, k, v, [pre_k], [pre_v], op_inputs, None, 0.0625, None,
                                                          None, written)
        torch.testing.assert_close(got, plain, atol=2e-3, rtol=1.6e-2)
