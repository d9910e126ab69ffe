"""Issue 33: sliding windows and chunked attention at any length, attention sinks, K/V of different head sizes.

Ops: :func:`bounded_cascade_attention` (through :func:`hf_cascade.windows.bounded_attend`, so the layout arithmetic of
``row_shifts`` is checked too) against float64 attention per row over the row's whole sequence (its chain of nodes,
then its suffix), each key masked by its *position*; :func:`merge_sink` against the N-way merge. Models: tiny real
configs (no downloads), fp32, greedy tokens identical to the family's reference attention, prompts longer and shorter
than the windows, through ``custom_generate``, ``shared_prefix_inputs`` and ``from_prefix``.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.model_zoo import available_families, reference_attention, tiny_config, tiny_model
from hf_cascade.ops.bounded import bounded_cascade_attention, lower_positions, merge_sink
from hf_cascade.ops.plan import plan_cascade
from hf_cascade.ops.reference import merge_states_ref
from hf_cascade.transformers_compat import CACHE_KWARG
from hf_cascade.windows import bounded_attend, droppable_prefix_tokens, row_shifts

from _ops_common import BACKENDS, needs_triton
from test_cache import prefix_batch
from test_generate import assert_logits_close, make_prompts, model_pair, pad_batch, run_pair

NEG_INF = float("-inf")
GEN = dict(max_new_tokens=5, pad_token_id=0, do_sample=False)


# ------------------------------------------------------------------ ops
def _layout(seed, B, node_lens, row_nodes):
    """Fake levels (node_starts only) and the rows' chains."""
    levels = []
    for lens in node_lens:
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        levels.append(SimpleNamespace(node_starts=starts))
    return levels, torch.tensor(row_nodes, dtype=torch.int64)


def _per_row_f64(q, k_suf, v_suf, pre_k, pre_v, levels, row_nodes, suffix_start, visible, lower_fn, scale):
    """float64 attention per row over [chain | own suffix columns], keys masked by position >= lower_fn(query pos)."""
    B, Hq, Lq, D = q.shape
    Hkv, S, Dv = k_suf.shape[1], k_suf.shape[2], v_suf.shape[-1]
    g = Hq // Hkv
    out = torch.zeros(B, Hq, Lq, Dv, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), NEG_INF, dtype=torch.float64)
    for b in range(B):
        ks, vs, pos, vis = [], [], [], []
        chain = 0
        for level, (k, v) in enumerate(zip(pre_k, pre_v)):
            n = int(row_nodes[level, b])
            if n < 0:
                continue
            a, e = levels[level].node_starts[n], levels[level].node_starts[n + 1]
            ks.append(k[:, a:e]), vs.append(v[:, a:e])
            pos.append(torch.arange(chain, chain + e - a))
            vis.append(torch.ones(Lq, e - a, dtype=torch.bool))
            chain += e - a
        ks.append(k_suf[b]), vs.append(v_suf[b])
        pos.append(torch.arange(S) + chain - int(suffix_start[b]))
        vis.append(visible[b])
        kk = torch.cat(ks, 1).double().repeat_interleave(g, 0)
        vv = torch.cat(vs, 1).double().repeat_interleave(g, 0)
        key_pos = torch.cat(pos)
        query_pos = torch.arange(S - Lq, S) + chain - int(suffix_start[b])
        seen = torch.cat(vis, 1) & (key_pos[None, :] >= lower_fn(query_pos)[:, None])
        s = (q[b].double() @ kk.transpose(1, 2) * scale).masked_fill(~seen[None], NEG_INF)
        row_lse = torch.logsumexp(s, -1)
        out[b] = torch.exp(s - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[..., None]) @ vv
        lse[b] = row_lse
    return out, lse


@pytest.mark.parametrize("bound", [("window", 1), ("window", 4), ("window", 9), ("window", 100), ("chunk", 4),
                                   ("chunk", 7)])
@pytest.mark.parametrize("dims", [(16, 16), (24, 12), (12, 20)])  # (D, Dv): equal, MLA-like wider q/k, odd
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_attend_matches_per_row_attention(bound, dims, lq, backend):
    torch.manual_seed(0)
    D, Dv = dims
    B, Hkv, G, S = 5, 2, 3, 6
    # Two levels: a shared node (two of them at level 1), rows without a level-1 node, a row with no node at all.
    levels, row_nodes = _layout(0, B, [[5, 0], [4, 3]], [[0, 0, 0, 0, -1], [0, 1, -1, 1, -1]])
    pre_k = [torch.randn(Hkv, lv.node_starts[-1], D) for lv in levels]
    pre_v = [torch.randn(Hkv, lv.node_starts[-1], Dv) for lv in levels]
    q = torch.randn(B, Hkv * G, lq, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    suffix_start = torch.tensor([0, 2, 1, 0, 0])
    columns = torch.arange(S)
    causal = columns[None, :] <= (S - lq + torch.arange(lq))[:, None]
    visible = causal[None] & (columns >= suffix_start[:, None])[:, None, :]
    kind, size = bound
    shifts = row_shifts(levels, row_nodes, suffix_start, B, torch.device("cpu"))
    plan = plan_cascade(row_nodes, [lv.node_starts for lv in levels], B, torch.device("cpu"))
    scale = D ** -0.5
    out, lse = bounded_attend(shifts, plan, q, k, v, pre_k, pre_v, visible, scale=scale, softcap=None,
                              window=size if kind == "window" else None, chunk=size if kind == "chunk" else None,
                              key_length=None, backend=backend)
    lower = lambda p: lower_positions(p, **{kind: size})  # noqa: E731
    want_out, want_lse = _per_row_f64(q, k, v, pre_k, pre_v, levels, row_nodes, suffix_start, visible, lower, scale)
    assert out.shape == (B, lq, Hkv * G, Dv)
    torch.testing.assert_close(out.transpose(1, 2).double(), want_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse[finite].double(), want_lse[finite], atol=2e-5, rtol=2e-5)


def test_bounded_attention_key_length_hides_unwritten_columns():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    lower = torch.zeros(2, 1, dtype=torch.int64)
    out, lse = bounded_cascade_attention(q, k, v, [], [], [], [], [], lower, scale=0.3, key_length=torch.tensor(4),
                                         mask=torch.ones(1, 1, 6, dtype=torch.bool))
    want, want_lse = bounded_cascade_attention(q, k[:, :, :4], v[:, :, :4], [], [], [], [], [], lower, scale=0.3,
                                               causal=False)
    torch.testing.assert_close(out, want), torch.testing.assert_close(lse, want_lse)


def test_bounded_attention_rejects_bad_bounds():
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"suffix_lower.*\[B, Lq\] = \[2, 3\]"):
        bounded_cascade_attention(q, k, k, [], [], [], [], [], torch.zeros(2, dtype=torch.int64), scale=1.0)
    with pytest.raises(ValueError, match="exactly one of `window`"):
        lower_positions(torch.arange(3), window=2, chunk=2)


def test_merge_sink_is_the_merge_with_a_zero_state():
    torch.manual_seed(2)
    out, lse, sinks = torch.randn(3, 4, 5, 6), torch.randn(3, 4, 5) * 3, torch.randn(4)
    lse[0, 1, 2] = NEG_INF  # a query that saw no key: only the sink remains (out 0, lse s)
    got, got_lse = merge_sink(out, lse, sinks)
    zero_state = torch.zeros_like(out)
    want, want_lse = merge_states_ref(torch.stack([out, zero_state]),
                                      torch.stack([lse, sinks.view(1, 4, 1).expand_as(lse)]))
    torch.testing.assert_close(got, want), torch.testing.assert_close(got_lse, want_lse)
    got_t, _ = merge_sink(out.transpose(1, 2), lse, sinks, heads_dim=2)  # transformers' [B, Lq, Hq, Dv]
    torch.testing.assert_close(got_t, want.transpose(1, 2))
    with pytest.raises(ValueError, match=r"`sinks` \[Hq\]"):
        merge_sink(out, lse, sinks[:3])


def test_plain_attention_with_sinks_matches_gpt_oss_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from hf_cascade.attention import plain_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    module = SimpleNamespace(num_key_value_groups=2, sinks=torch.randn(4), training=False)
    visible = torch.ones(7, 7, dtype=torch.bool).tril()[None, -5:].expand(2, 5, 7).clone()
    visible[1, :, :2] = False  # a padded row
    additive = torch.zeros(2, 1, 5, 7).masked_fill(~visible[:, None], torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.35)
    got = plain_attention(module, q, k, v, visible[:, None], scaling=0.35, sinks=module.sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ models
WINDOWED = [  # (family, overrides): windows shorter than the prompts (11 + 7 + 2..5 tokens) unless noted
    ("mistral", dict(sliding_window=8)),
    ("gemma2", dict(sliding_window=8)),  # soft-capping and a window on alternate layers
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),  # 2nd layer sliding
    ("gpt_oss", dict(sliding_window=8)),  # sinks on every layer, window on alternate layers (128 in gpt-oss)
    ("gpt_oss", dict(sliding_window=128)),  # sinks, prompts within the window
    ("gemma3", dict(sliding_window=5)),  # five sliding layers and a full one, per-layer rotary bases
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=7)),
    ("mistral", dict(sliding_window=2)),  # each query sees itself and the token before
]
_AVAILABLE = set(available_families())


def _params(cases):
    return [pytest.param(f, o, id=f"{f}-{'-'.join(f'{v}' for v in o.values())}",
                         marks=pytest.mark.skipif(f not in _AVAILABLE, reason=f"no {f} config in this transformers"))
            for f, o in cases]


@pytest.mark.parametrize("family, overrides", _params(WINDOWED))
def test_windowed_and_sink_models_match_reference(family, overrides):
    ref, cas = model_pair(family, **overrides)
    rows = make_prompts(seed=1)
    want, got, want_new, got_new, inputs = run_pair(ref, cas, rows, dict(do_sample=False))
    assert inputs[CACHE_KWARG].num_levels == 2
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)
    # One argument: hf_cascade.generate plans the same batch itself.
    ids, mask = pad_batch(rows)
    one = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                       cascade_options=dict(min_shared_tokens=2), **GEN)
    assert torch.equal(one, ref.generate(ids, attention_mask=mask, **GEN))


def test_window_of_one_token_matches_the_uncached_reference():
    """A window of 1 (each query sees only itself): transformers' own cached generate() disagrees with its uncached
    forward there (its sliding cache layer keeps window - 1 = 0 tokens); the cascade matches the uncached one."""
    ref, cas = model_pair("mistral", sliding_window=1)
    ids, mask = pad_batch(make_prompts(seed=1))
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                       cascade_options=dict(min_shared_tokens=2), **GEN)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, use_cache=False, **GEN))


@pytest.mark.parametrize("family, overrides", _params([("gpt_oss", dict(sliding_window=6)),
                                                       ("gemma3", dict(sliding_window=4))]))
def test_windowed_models_sampling_beams_and_from_prefix(family, overrides):
    ref, cas = model_pair(family, **overrides)
    rows = make_prompts(seed=5, groups=1, per_group=3)
    gen = dict(do_sample=True, num_return_sequences=2, top_k=10)
    _, _, want_new, got_new, _ = run_pair(ref, cas, rows, gen, seed=11)
    assert torch.equal(got_new, want_new)
    _, _, want_new, got_new, _ = run_pair(ref, cas, rows, dict(num_beams=2, do_sample=False))
    assert torch.equal(got_new, want_new)
    prefix = rows[0][:18]  # system prompt + few-shot block, longer than the window
    ids, mask = prefix_batch(prefix, [[5, 6, 7], [9]])  # [prefix | pads | suffix]
    cache = CascadeCache.from_prefix(cas, prefix)
    got = cas.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, **GEN)[:, ids.shape[1]:]
    # The reference gets the tokenizer's left-padded rows: windows count tokens (positions), not padding columns.
    ref_ids, ref_mask = pad_batch([prefix + [5, 6, 7], prefix + [9]])
    assert torch.equal(got, ref.generate(ref_ids, attention_mask=ref_mask, **GEN)[:, ref_ids.shape[1]:])


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_windowed_models_with_fixed_buffers(family):
    """Fixed suffix buffers (the compileable layout): the window bound reads the written length on the device."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    ref, cas = model_pair(family, sliding_window=7)
    rows = make_prompts(seed=6)
    ids, mask = pad_batch(rows)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                       cascade_options=dict(min_shared_tokens=2, fixed_buffers=True), **GEN)
    assert torch.equal(got, ref.generate(ids, attention_mask=mask, **GEN))


def test_droppable_prefix_tokens_of_a_sliding_layer():
    # Level 0: one node of 20 tokens read by every row; level 1: nodes of 6 and 10 tokens.
    levels, row_nodes = _layout(0, 3, [[20], [6, 10]], [[0, 0, 0], [0, 0, 1]])
    shifts = row_shifts(levels, row_nodes, None, 3, torch.device("cpu"))
    # Rows' first own positions: 26, 26, 30; a window of 8 keeps positions >= 19 (rows 0, 1) and >= 23 (row 2).
    assert shifts.first_position == [26, 26, 30]
    # Level 0: columns 0..18 dead for every row (19 tokens); level 1 node 0 (positions 20..25): none dead;
    # node 1 (positions 20..29): 20..22 dead (3 tokens).
    assert droppable_prefix_tokens(shifts, levels, row_nodes, window=8) == 19 + 0 + 3
    assert droppable_prefix_tokens(shifts, levels, row_nodes, window=100) == 0


def test_cache_reports_droppable_sliding_kv_bytes():
    from hf_cascade.windows import droppable_kv_bytes

    model = tiny_model("mistral", "cascade", sliding_window=8)
    prefix = list(range(3, 23))  # 20 tokens
    cache = CascadeCache.from_prefix(model, prefix)
    ids, mask = prefix_batch(prefix, [[30, 31], [32]])
    model.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, **GEN)
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K and V, fp32
    layers = model.config.num_hidden_layers
    # Every row's first own token is at position 20: positions 0..12 are out of every window of 8 from then on.
    assert droppable_kv_bytes(cache) == 13 * per_token * layers


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_windowed_models_compiled_decode(family):
    """generate() compiles the decode step (CPU, aot_eager, fullgraph: a graph break fails): the window bounds move
    with the written length on the device, the sinks merge in the graph."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from test_compiled_generate import cpu_compile_config

    ref, cas = model_pair(family, sliding_window=6)
    torch._dynamo.reset()
    ids, mask = pad_batch(make_prompts(seed=33))
    want = ref.generate(input_ids=ids, attention_mask=mask, **GEN)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, max_new_tokens=GEN["max_new_tokens"])
    got = cas.generate(**inputs, compile_config=cpu_compile_config(), **GEN)
    assert hasattr(cas, "_compiled_call"), "generate() did not compile the decode step"
    assert torch.equal(got[:, inputs["input_ids"].shape[1]:], want[:, ids.shape[1]:])


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_windowed_models_in_the_recorded_step_path(family):
    """The path a recorded step takes (static_step_mode around every decode step, fixed buffers), run eagerly; the
    bounded layers' layout tensors are part of what a recording is keyed on."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    from hf_cascade.decode.captured_step import static_step_mode
    from test_captured_step import _in_decode_steps
    from test_generate import tree_prompts

    ref, cas = model_pair(family, sliding_window=5)
    ids, mask = pad_batch(tree_prompts([(1, 9), (2, 5)], 4, rows=4, seed=83))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, attention_mask=mask, **gen)
    caches = []
    with _in_decode_steps(cas, static_step_mode) as entered:
        got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_caches=caches,
                           disable_compile=True, cascade_options=dict(min_shared_tokens=2, cost_model=None,
                                                                      fixed_buffers=True), **gen)
    assert len(entered) == gen["max_new_tokens"] - 1
    assert torch.equal(got, want)
    read = {t.data_ptr() for t in caches[0].static_step_tensors()}
    assert caches[0]._wrapper.shifts.level_shift.data_ptr() in read and caches[0]._wrapper.shifts.suffix_shift.data_ptr() in read


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_generate_dataset_on_windowed_models(family):
    """generate_dataset (rows sorted and batched by shared prefixes): per-row reference completions, prompts of
    ~100 tokens against windows of 16."""
    if family not in _AVAILABLE:
        pytest.skip(f"no {family} config in this transformers")
    pytest.importorskip("datasets")
    from hf_cascade.dataset_generation import generate_dataset
    from hf_cascade.tiny import tiny_model as tiny_byte_model
    from hf_cascade.tiny import tiny_tokenizer
    from test_dataset_generation import make_dataset, prompt_fn

    tokenizer = tiny_tokenizer()
    model = tiny_byte_model(family, sliding_window=16)
    ref = tiny_byte_model(family, attn_implementation=reference_attention(family), sliding_window=16)
    dataset = make_dataset(n=6, seed=3)
    expected = []
    for row in dataset:
        ids = tokenizer(prompt_fn(row), return_tensors="pt")
        seq = ref.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(seq[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    out = generate_dataset(model, tokenizer, dataset, prompt_fn=prompt_fn, progress=False, max_batch_size=3,
                           generation_kwargs=dict(max_new_tokens=4, do_sample=False))
    assert out["completion"] == expected


@needs_triton
@pytest.mark.parametrize("form", ["fused", "two-pass", "splits"])
@pytest.mark.parametrize("dims", [(16, 16), (20, 12)])
def test_triton_bounds_match_the_torch_bounds(form, dims):
    """The Triton kernels with per-query lower bounds (random ones: below, inside and past every node) in the fused
    launch, the two-pass form (suffix kernel merging the prefix states) and with several KV splits per level."""
    from hf_cascade.ops import cascade_attention, plan_shared_prefix
    from hf_cascade.ops._launch import cascade_triton, launch_cascade, launch_configs

    torch.manual_seed(5)
    D, Dv = dims
    B, Hkv, G, S, Lq = 4, 2, 2, 11, 3
    levels, row_nodes = _layout(0, B, [[90], [70, 0, 40]], [[0, 0, 0, -1], [2, 0, 1, 0]])
    pre_k = [torch.randn(Hkv, lv.node_starts[-1], D) for lv in levels]
    pre_v = [torch.randn(Hkv, lv.node_starts[-1], Dv) for lv in levels]
    plans = [plan_shared_prefix(row_nodes[i], torch.tensor(lv.node_starts)) for i, lv in enumerate(levels)]
    q = torch.randn(B, Hkv * G, Lq, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    key_lower = [torch.randint(-5, lv.node_starts[-1] + 5, (B, Lq)) for lv in levels]
    suffix_lower = torch.randint(-2, S + 2, (B, Lq))
    mask = torch.ones(1, Lq, S, dtype=torch.bool).tril(S - Lq)
    prefixes = [(kk, vv, p) for kk, vv, p in zip(pre_k, pre_v, plans)]
    want = cascade_attention(q, k, v, prefixes, scale=0.2, mask=mask, backend="torch", key_lower=key_lower,
                             suffix_lower=suffix_lower)
    if form == "fused":
        got = cascade_attention(q, k, v, prefixes, scale=0.2, mask=mask, backend="triton", key_lower=key_lower,
                                suffix_lower=suffix_lower)
    elif form == "two-pass":
        got = cascade_triton(q, k, v, prefixes, scale=0.2, mask=mask, causal=True, softcap=None, fuse_suffix=False,
                              key_lower=key_lower, suffix_lower=suffix_lower)
    else:
        fuse, configs = launch_configs(q, k, prefixes, fuse_suffix=True)
        configs = [(sched, 3, block_m, 16, warps, stages) for sched, _, block_m, _, warps, stages in configs]
        got = launch_cascade(q, k, v, [(kk, vv) for kk, vv, _ in prefixes], configs, True, scale=0.2, mask=mask,
                             causal=True, softcap=None, key_lower=key_lower, suffix_lower=suffix_lower)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    finite = ~torch.isneginf(want[1])
    torch.testing.assert_close(got[1][finite], want[1][finite], atol=2e-5, rtol=2e-5)


def test_cascade_attention_rejects_half_given_bounds():
    from hf_cascade.ops import cascade_attention, plan_shared_prefix

    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 3, 8)
    plan = plan_shared_prefix(torch.tensor([0, 0]), torch.tensor([0, 4]))
    level = (torch.randn(1, 4, 8), torch.randn(1, 4, 8), plan)
    with pytest.raises(ValueError, match="`key_lower`.*`suffix_lower`.*together"):
        cascade_attention(q, k, k, [level], scale=0.3, key_lower=[torch.zeros(2, 1, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"`suffix_lower` must be int64 \[B, Lq\] = \[2, 1\]"):
        cascade_attention(q, k, k, [level], scale=0.3, key_lower=[torch.zeros(2, 1, dtype=torch.int64)],
                          suffix_lower=torch.zeros(2, 1, dtype=torch.int32))


@needs_triton
@pytest.mark.parametrize("family, overrides", _params([("gpt_oss", dict(sliding_window=6)),
                                                       ("gemma2", dict(sliding_window=5)),
                                                       ("llama4", dict(attention_chunk_size=6))]))
def test_windowed_models_through_the_triton_kernels(family, overrides, monkeypatch):
    """The eager bounded layers as they run on CUDA: the Triton kernels with per-query lower bounds (interpreter)."""
    import hf_cascade.ops.cascade_wrapper as cascade_wrapper  # the door every bounded layer goes through

    monkeypatch.setattr(cascade_wrapper, "resolve_backend", lambda *args: "triton")
    ref, cas = model_pair(family, **overrides)
    rows = make_prompts(seed=7)
    want, got, want_new, got_new, _ = run_pair(ref, cas, rows, dict(do_sample=False))
    assert torch.equal(got_new, want_new)
    assert_logits_close(want, got)
