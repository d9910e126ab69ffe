"""The no-compilation attention path (``hf_cascade.ops.builtin_cascade``) and the tier policy that picks it
(``hf_cascade.tiers``): the path against float64 attention per row (odd shapes, GQA and MHA, multi-node levels, rows
without a node, empty nodes, an empty suffix, masks, soft-capping, K/V of different head sizes); generate() with a
cache on the built-in kernels gives sdpa's greedy tokens; the ski-rental policy moves up only when the regret
reaches the cost, reads and writes its markers, and refuses unknown choices."""

import pytest
import torch

from hf_cascade.ops import plan_shared_prefix
from hf_cascade.ops import builtin_cascade
from hf_cascade.ops.builtin_cascade import builtin_cascade_attention
from hf_cascade.transformers_compat import CACHE_KWARG

from _ops_common import NEG_INF
from test_ops_kv_head_sizes import _f64

CASES = [  # (B, Hq, Hkv, D, Dv, Lq, S, levels: [(node lengths, row_node)])
    (5, 6, 2, 24, 24, 1, 7, [([9], [0, 0, 0, 0, 0])]),
    (5, 6, 2, 24, 24, 3, 7, [([9, 4], [0, 0, 1, 1, -1]), ([5, 0, 3], [2, 0, 0, 1, -1])]),
    (4, 4, 4, 16, 16, 2, 0, [([6, 5], [1, 0, 1, 0])]),
    (3, 6, 3, 24, 12, 2, 5, [([7], [0, 0, 0])]),  # MLA-style: values narrower than keys
    (6, 9, 3, 40, 40, 1, 11, [([13], [0] * 6), ([4, 4, 2], [0, 0, 1, 1, 2, 2])]),
]


def _levels(Hkv, D, Dv, spec, dtype):
    levels, prefixes = [], []
    for lengths, row_node in spec:
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        k = torch.randn(Hkv, int(starts[-1]), D, dtype=dtype)
        v = torch.randn(Hkv, int(starts[-1]), Dv, dtype=dtype)
        rows = torch.tensor(row_node, dtype=torch.int64)
        levels.append((k, v, rows, starts))
        prefixes.append((k, v, plan_shared_prefix(rows, starts)))
    return levels, prefixes


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_builtin_cascade_matches_float64(case, masked):
    torch.manual_seed(0)
    B, Hq, Hkv, D, Dv, Lq, S, spec = case
    q = torch.randn(B, Hq, Lq, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    levels, prefixes = _levels(Hkv, D, Dv, spec, torch.float32)
    causal = (torch.arange(S)[None, :] <= (S - Lq + torch.arange(Lq))[:, None])[None].expand(B, Lq, S)
    visible = causal & (torch.rand(B, 1, S) > 0.3) if masked else causal
    out, lse = builtin_cascade_attention(q, k, v, prefixes, scale=D ** -0.5, mask=visible if masked else None)
    want_out, want_lse = _f64(q, k, v, levels, D ** -0.5, visible)
    assert out.shape == (B, Lq, Hq, Dv) and out.is_contiguous() and lse.dtype == torch.float32
    torch.testing.assert_close(out.transpose(1, 2).double(), want_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-5)


def test_builtin_cascade_softcap_and_chunks(monkeypatch):
    """Soft-capping takes the matmul path of the nodes; tiny chunks give the same result as one chunk."""
    torch.manual_seed(1)
    B, Hq, Hkv, D, Lq, S = 4, 4, 2, 16, 5, 9
    q, k, v = torch.randn(B, Hq, Lq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    _, prefixes = _levels(Hkv, D, D, [([7, 3], [0, 1, 1, 0])], torch.float32)
    whole = builtin_cascade_attention(q, k, v, prefixes, scale=0.3, mask=None, softcap=5.0)
    monkeypatch.setattr(builtin_cascade, "CHUNK_ELEMENTS", 16)
    chunked = builtin_cascade_attention(q, k, v, prefixes, scale=0.3, mask=None, softcap=5.0)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-6, rtol=1e-6)
    # soft-capped scores bound every logit: |s| <= 5, so the LSE over n keys is at most 5 + log(n)
    assert float(whole[1].max()) <= 5.0 + torch.log(torch.tensor(7.0 + S)).item() + 1e-5


def test_builtin_cascade_bf16_within_eager_rounding():
    """bf16: no further from the float64 answer than the same attention computed in bf16 the eager way."""
    torch.manual_seed(2)
    B, Hq, Hkv, D, Lq, S = 4, 8, 2, 32, 2, 6
    q = torch.randn(B, Hq, Lq, D, dtype=torch.bfloat16)
    k, v = torch.randn(B, Hkv, S, D, dtype=torch.bfloat16), torch.randn(B, Hkv, S, D, dtype=torch.bfloat16)
    levels, prefixes = _levels(Hkv, D, D, [([12], [0] * B)], torch.bfloat16)
    causal = (torch.arange(S)[None, :] <= (S - Lq + torch.arange(Lq))[:, None])[None].expand(B, Lq, S)
    out, _ = builtin_cascade_attention(q, k, v, prefixes, scale=D ** -0.5, mask=None)
    want, _ = _f64(q, k, v, levels, D ** -0.5, causal)
    # eager: bf16 scores, fp32 softmax, bf16 probabilities
    kk = torch.cat([levels[0][0][None].expand(B, -1, -1, -1), k], 2).repeat_interleave(Hq // Hkv, 1)
    vv = torch.cat([levels[0][1][None].expand(B, -1, -1, -1), v], 2).repeat_interleave(Hq // Hkv, 1)
    s = (q @ kk.transpose(-1, -2) * D ** -0.5).float()
    s[..., 12:] = s[..., 12:].masked_fill(~causal[:, None], NEG_INF)
    eager = (torch.softmax(s, -1).to(torch.bfloat16) @ vv).double()
    ours = (out.transpose(1, 2).double() - want).abs().max()
    assert ours <= 2 * (eager - want).abs().max() + 1e-3


def _emulated_varlen_flash(padded_lse: bool):
    """``aten._flash_attention_forward`` (CUDA only) emulated in fp32 on the CPU, node by node, with either LSE
    layout: ``[Hq, total_q]`` (torch 2.11's, measured on an H200) or ``[N, Hq, max_q]`` padded per node."""
    def varlen(q, k, v, q_offsets, key_offsets, max_q, max_k, scale):
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for n in range(q_offsets.numel() - 1):
            (a, b), (c, d) = q_offsets[n:n + 2].tolist(), key_offsets[n:n + 2].tolist()
            kn, vn = (t[c:d].repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))  # [Hq, keys, D]
            s = torch.matmul(q[a:b].transpose(0, 1), kn.transpose(1, 2)) * scale  # [Hq, rows, keys]
            lse[:, a:b] = torch.logsumexp(s, -1)
            out[a:b] = torch.matmul(torch.softmax(s, -1), vn).transpose(0, 1)
        if padded_lse:
            padded = torch.full((q_offsets.numel() - 1, q.shape[1], max_q), float("-inf"))
            for n in range(padded.shape[0]):
                a, b = q_offsets[n:n + 2].tolist()
                padded[n, :, :b - a] = lse[:, a:b]
            lse = padded
        return out, lse
    return varlen


@pytest.mark.parametrize("padded_lse", [False, True])
@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (3, 3)])
def test_prefix_level_in_one_varlen_call_matches_node_by_node(monkeypatch, padded_lse, Lq, Hq, Hkv):
    """A prefix level in one variable-length flash call (rows sorted by node, nodes as packed sequences, rows
    without a node left at (0, -inf)) equals the node-by-node path: rows interleaved across nodes, an odd node size,
    a row with no node; GQA and MHA; decode (Lq 1) and a prefill chunk."""
    monkeypatch.setattr(builtin_cascade, "_varlen_flash", _emulated_varlen_flash(padded_lse))
    g = torch.Generator().manual_seed(5)
    row_node = torch.tensor([2, 0, 1, -1, 0, 2, 2, 1, 0])
    starts = torch.tensor([0, 7, 12, 21])
    plan = plan_shared_prefix(row_node, starts)
    D = 16
    query = torch.randn(row_node.numel(), Hq, Lq, D, generator=g)
    k_pre, v_pre = (torch.randn(Hkv, 23, D, generator=g) for _ in range(2))  # 2 columns past the level's keys
    want_out, want_lse = builtin_cascade._prefix_level(query, k_pre, v_pre, plan, 0.25, None)
    got_out, got_lse = builtin_cascade._prefix_level_varlen(query, k_pre, v_pre, plan, 0.25)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(got_lse[3] == float("-inf")) and torch.all(got_out[3] == 0)
    assert plan.varlen_layout[-1] and not plan_shared_prefix(row_node, torch.tensor([0, 7, 7, 21])).varlen_layout[-1]
    # rows already in node order (a prompt's samples side by side): nothing gathered or scattered, the same state
    in_order = plan_shared_prefix(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]), starts)
    assert in_order.varlen_layout[0] is None and plan.varlen_layout[0] is not None
    want_out, want_lse = builtin_cascade._prefix_level(query, k_pre, v_pre, in_order, 0.25, None)
    got_out, got_lse = builtin_cascade._prefix_level_varlen(query, k_pre, v_pre, in_order, 0.25)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def test_generate_on_builtin_kernels_gives_sdpa_tokens(tiny_llama_pair, monkeypatch):
    """A cache on the built-in kernels (fixed buffers and growing ones) gives sdpa's greedy tokens, fp32."""
    import hf_cascade
    import importlib

    cascade_module = importlib.import_module("hf_cascade.ops.cascade_attention")  # (the package names the function)
    calls = []
    monkeypatch.setattr(cascade_module, "builtin_cascade_attention",
                        lambda *a, **k: calls.append(1) or builtin_cascade_attention(*a, **k))
    from hf_cascade.transformers_compat import CACHE_KWARG

    model, ref = tiny_llama_pair
    torch.manual_seed(3)
    shared = torch.randint(3, model.config.vocab_size, (1, 23))
    ids = torch.cat([shared.expand(5, -1), torch.randint(3, model.config.vocab_size, (5, 4))], 1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for max_new in (None, 6):
        inputs = hf_cascade.shared_prefix_inputs(model, ids, mask, max_new_tokens=max_new)
        inputs[CACHE_KWARG].builtin_kernels = True
        got = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got[:, -6:], want[:, -6:]), max_new
        assert len(calls) >= 6 * model.config.num_hidden_layers  # every layer of every forward took the path
        calls.clear()


# --------------------------------------------------------------------------------------------------- the tiers
@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CASCADE_RECORDS", str(tmp_path))
    return tmp_path


def _fresh_process(model):
    """Forget the model's in-process tier state (as a new process would), keep the records on disk."""
    from hf_cascade.engine import engine_of

    engine_of(model).forget("tiers")


def test_ski_rental_moves_up_when_regret_reaches_cost(records, tiny_llama_pair):
    from hf_cascade import tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    assert tiers.choose_tier(model) == tiers._TIERS["builtin"]  # empty caches, no marker: nothing to build
    tiers.record_call(model, tiers._TIERS["builtin"], 10.0)  # regret 2.5 s < 8 s
    assert tiers.choose_tier(model).name == "builtin"
    tiers.record_call(model, tiers._TIERS["builtin"], 50.0)  # regret 15 s >= 8 s
    assert tiers.choose_tier(model).name == "triton"
    tiers.record_call(model, tiers._TIERS["triton"], 1.0)
    report = tiers.tier_report(model)
    assert report["ready"]["triton"] and report["record"].startswith(str(records))
    assert sorted(p.suffix for p in records.iterdir()) == [".triton"]
    # the compiled tier: regret 0.2 x 60 s (the builtin calls) + 0.2 x 1 s = 12.2 < 20
    assert tiers.choose_tier(model).name == "triton"
    tiers.record_call(model, tiers._TIERS["triton"], 40.0)
    assert tiers.choose_tier(model).name == "compiled"
    tiers.record_call(model, tiers._TIERS["compiled"], 26.5)
    assert tiers.choose_tier(model, "never").name == "triton"
    assert sorted(p.suffix for p in records.iterdir()) == [".compiled", ".triton"]
    # a new process: the markers say both tiers were built, so the warm costs are expected (1 s, 8 s)
    _fresh_process(model)
    assert tiers.choose_tier(model).name == "builtin"
    tiers.record_call(model, tiers._TIERS["builtin"], 4.0)  # regret 1.0 s >= the warm Triton cost
    assert tiers.choose_tier(model).name == "triton"
    assert tiers._cost("compiled", tiers.caches_warm(model, tiers.tier_state(model))) == tiers.WARM_COMPILE_COST_S
    tiers.record_call(model, tiers._TIERS["triton"], 30.0)  # regret 0.8 (built-in call) + 6.0 = 6.8 < 8
    assert tiers.choose_tier(model).name == "triton"
    tiers.record_call(model, tiers._TIERS["triton"], 7.0)  # 8.2 >= 8
    assert tiers.choose_tier(model).name == "compiled"


def test_markers_are_read_by_their_existence_only(records, tiny_llama_pair):
    """A marker's content is never parsed: a file of any content (edited, truncated, written by something else) is
    a marker, and no content can break a call (a JSON record of the wrong shape once broke every default CUDA
    generate() of its model)."""
    from hf_cascade import tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    tiers.record_call(model, tiers._TIERS["triton"], 1.0)
    stem = tiers.tier_report(model)["record"]
    with open(f"{stem}.triton", "w") as f:
        f.write("{not json")
    _fresh_process(model)
    state = tiers.tier_state(model)
    assert tiers.caches_warm(model, state, "triton") and not tiers.caches_warm(model, state)
    assert tiers.choose_tier(model).name == "builtin"


def test_calls_build_nothing_while_the_background_build_runs(records, tiny_llama_pair):
    """While hf_cascade.tier_build's rows child fills the compile caches (a real child process, still running), the
    calls stay on the tier they have whatever their regret (they would wait for what the build makes); once it has
    ended they move up."""
    from _build_children import sleeping, stop

    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    rows = sleeping()
    state.build = tier_build.BackgroundBuild([rows])
    try:
        for name in ("triton", "compiled"):
            state.regret[name] = 1e6
        assert tiers.choose_tier(model).name == "builtin"
        assert tiers.choose_tier(model, "never").name == "builtin"  # (a Triton tier's build: TRL's calls)
        assert tiers.choose_tier(model, "now").name == "compiled"  # the user's explicit choice is kept
        assert tiers.tier_report(model)["background_build"]["running"] is True
    finally:
        stop(rows)
    assert tiers.choose_tier(model).name == "compiled"  # (the child was killed: the cold costs, which 1e6 pays)
    report = tiers.tier_report(model)["background_build"]
    assert report["running"] is False and report["caches_filled"] is False and "failed" in report["error"]
    state.build = None
    assert tiers.tier_report(model)["background_build"] == {"running": False, "seconds": None, "error": None,
                                                             "prewarm": None, "caches_filled": False,
                                                             "grid_running": False}


def test_tier_choices_and_records_off(records, tiny_llama_pair, monkeypatch):
    from hf_cascade import tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    assert tiers.choose_tier(model, "now").name == "compiled"
    with pytest.raises(ValueError, match="compile"):
        tiers.choose_tier(model, "sometimes")
    monkeypatch.setenv("HF_CASCADE_RECORDS", "off")
    _fresh_process(model)
    tiers.record_call(model, tiers._TIERS["triton"], 1.0)
    assert tiers.tier_report(model)["record"] is None
    assert not any(records.iterdir())


def test_records_are_keyed_by_compile_cache_folders(records, tiny_llama_pair, monkeypatch, tmp_path):
    from hf_cascade import tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    tiers.record_call(model, tiers._TIERS["triton"], 1.0)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "new_triton_cache"))
    _fresh_process(model)
    assert tiers.choose_tier(model).name == "builtin"  # another (empty) Triton cache: its kernels are not built


def test_cascade_options_compile_is_validated(tiny_llama_pair):
    import hf_cascade

    model = tiny_llama_pair[0]
    ids = torch.randint(3, 50, (2, 9))
    with pytest.raises(ValueError, match=r"cascade_options\['compile'\]"):
        model.generate(ids, max_new_tokens=2, custom_generate=hf_cascade.generate,
                       cascade_options={"compile": "always"})


@pytest.fixture(scope="module")
def tiny_llama_pair():
    """(cascade model, sdpa model) with the same weights: a tiny Llama, fp32."""
    from hf_cascade.model_zoo import tiny_model

    return tiny_model("llama", "cascade", seed=0), tiny_model("llama", "sdpa", seed=0)


def test_warmup_command_runs_on_cpu(capsys):
    """``python -m hf_cascade warmup`` loads the model and runs its calls (on a CPU nothing compiles and no record
    is written; on a GPU the same command fills the compile caches: tests/test_gpu_generate.py)."""
    from hf_cascade.cli import main

    assert main(["warmup", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "2", "3",
                 "--prompt-tokens", "20", "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 rows x 20 shared tokens, 3 new" in out and "3 rows x 20 shared tokens, 3 new" in out
    assert "warmup: done" in out and "background build" not in out  # (children: CUDA only)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        main(["warmup", "--model", "tiny", "--device", "cuda"] if not torch.cuda.is_available() else ["--bad"])


@pytest.mark.parametrize("child_returncode", [0, 1])
def test_background_child_fills_the_caches_then_the_ski_rental_moves_up(records, tiny_llama_pair,
                                                                         child_returncode):
    """No thread: the calls' tier choice asks the rows child where it stands. Once it has filled the caches, the
    compiled tier's expected cost is WARM_COMPILE_COST_S (not the cold default), so the ski rental moves the next
    call up once the regret reaches it (the call compiles in the foreground, from warm caches); a child that fails
    is an error in the report, a warning, and the cold cost."""
    from _build_children import child, stop

    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    rows = child(f"import sys, time; time.sleep(1.0); print('ROWS_DONE'); sys.exit({child_returncode})")
    state.build = tier_build.BackgroundBuild([rows])
    state.regret["triton"], state.regret["compiled"] = 2.6, tiers.WARM_COMPILE_COST_S + 0.1
    try:
        assert tiers.choose_tier(model).name == "builtin"  # the child runs: no call builds anything
        assert tier_build.wait_for_build(model, timeout=60) is (child_returncode == 0)
    finally:
        stop(rows)
    report = tiers.tier_report(model)["background_build"]
    assert report["running"] is False and report["caches_filled"] is (child_returncode == 0)
    assert report["prewarm"]["returncode"] == child_returncode and "grid" not in report["prewarm"]
    if child_returncode == 0:
        assert report["error"] is None
        assert tiers.choose_tier(model).name == "compiled"
        state.regret["compiled"] = tiers.WARM_COMPILE_COST_S - 0.1
        assert tiers.choose_tier(model).name == "triton"  # the Triton kernels are in the caches too
    else:
        assert "child process" in report["error"]
        assert tiers.choose_tier(model).name == "builtin"  # the cold costs: 8 s for Triton


def test_calls_move_up_while_the_children_run_the_grid(records, tiny_llama_pair):
    """Once the rows child has succeeded, the caches count as filled and the build as done for the calls (the ski
    rental may move them up, from warm caches) while the grid's children go on: those beside it from the start,
    and those the tier choice starts once the rows child is done (told how many early ones still run); the report
    shows the grid running, then the children's outcome."""
    from _build_children import child, sleeping, stop

    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    rows = child("print('ROWS_DONE')")
    early = sleeping()
    late_started = []

    def start_late(running):
        late_started.append(running)
        return [child("print('GRID_DONE'); print('GRID_DONE'); print('GRID_END 2 0.1')")]

    state.build = tier_build.BackgroundBuild([rows], [early], start_late)
    state.regret["triton"], state.regret["compiled"] = 2.6, tiers.WARM_COMPILE_COST_S + 0.1
    try:
        rows[0].wait(60)
        assert tiers.choose_tier(model).name == "compiled"  # while the grid runs
        assert late_started == [1]
        report = tiers.tier_report(model)["background_build"]
        assert report["running"] is False and report["grid_running"] is True and report["caches_filled"] is True
    finally:
        stop(early)
    assert tier_build.wait_for_build(model, timeout=60)
    report = tiers.tier_report(model)["background_build"]
    assert report["grid_running"] is False and report["error"] is None
    grid = report["prewarm"]["grid"]
    assert {k: grid[k] for k in ("processes", "batches", "done", "failed")} == {
        "processes": 2, "batches": 2, "done": 2, "failed": 0}, report
    assert 0 <= grid["seconds_after_rows"] <= report["prewarm"]["seconds"]


def test_background_build_starts_only_where_the_caches_are_cold(records, tiny_llama_pair):
    """At most one build per model and process (running, failed or done), none where the compiled tier is ready or
    the compile caches are warm (filled by a build, or a marker after `warmup`: the ski rental with the warm cost),
    none on a CPU or with HF_CASCADE_BACKGROUND=off."""
    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert not tier_build.build_in_background(model, ids, None, {}, None, False, 0)  # (conftest: off; and a CPU)
    failed = tier_build.BackgroundBuild.failed("boom")
    state.build = failed
    assert tiers.tier_report(model)["background_build"]["error"] == "boom"
    assert not tiers.caches_warm(model, state)
    done = tier_build.BackgroundBuild([])
    done.rows_outcome = (0, "ROWS_DONE", None)
    state.build = done
    assert tiers.caches_warm(model, state)
    # a new process after `warmup` (its compiled calls left the markers): the caches are warm
    _fresh_process(model)
    tiers.record_call(model, tiers._TIERS["compiled"], 5.0)
    _fresh_process(model)
    state = tiers.tier_state(model)
    assert state.build is None and tiers.caches_warm(model, state) and tiers.caches_warm(model, state, "triton")


def test_background_child_ends_with_the_process_that_started_it(tmp_path):
    """A process that exits while its background child fills the caches leaves no child behind (the child asks
    the kernel for SIGTERM when its parent ends: tier_build_child._leave_with_parent)."""
    import os
    import subprocess
    import sys
    import time

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pid_file = tmp_path / "child.pid"
    parent = f"""
import os, subprocess, sys, threading, time
def run():
    subprocess.run([sys.executable, "-c", "import os, sys, time; from hf_cascade.tier_build_child import _leave_with_parent; "
                    "_leave_with_parent(int(sys.argv[1])); open(sys.argv[2], 'w').write(f'{{os.getpid()}} {{os.nice(0)}}'); "
                    "time.sleep(120)", str(os.getpid()), {str(pid_file)!r}])
threading.Thread(target=run, daemon=True).start()
deadline = time.time() + 120
while not os.path.exists({str(pid_file)!r}) and time.time() < deadline:
    time.sleep(0.1)
time.sleep(0.5)
"""
    done = subprocess.run([sys.executable, "-c", parent], timeout=200)
    assert done.returncode == 0
    child, niceness = (int(x) for x in pid_file.read_text().split())
    assert niceness == 19  # the lowest CPU priority
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(child, 9)
        raise AssertionError("the child outlived the process that started it")


def test_background_build_child_process_runs_the_call_on_a_cut_model(tiny_llama_pair, monkeypatch):
    """The children of a background build (hf_cascade.tier_build.start_build): the call's rows, prepared generation
    config and options pickled, the model's config cut to PREWARM_LAYERS layers, the build call run there (here on
    CPU, nothing compiled: the plumbing a CUDA build uses), exit code 0; the grid's children beside it and after it
    (started by the poll that sees the rows child done); the model is untouched."""
    from hf_cascade import build_grid, tier_build

    model = tiny_llama_pair[1]
    layers = model.config.num_hidden_layers
    captured = {}

    def capture(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        captured.update(input_ids=input_ids, generation_config=generation_config, kwargs=kwargs)
        return input_ids

    ids = torch.randint(3, 100, (3, 21))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
                   disable_compile=True, custom_generate=capture)
    kwargs = {k: v for k, v in captured["kwargs"].items() if k != CACHE_KWARG}
    monkeypatch.setattr(tier_build, "GRID_BUDGET_S", 600.0)  # every grid batch runs (a slow machine included)
    monkeypatch.setattr(tier_build, "grid_processes", lambda device, beside=0: 2)  # eager: 1 child, compiled: 2
    grid = build_grid.variant_grid(model, captured["input_ids"], captured["generation_config"])[:3]
    grid.append((torch.full((2, 5), 7), torch.ones(2, 4, dtype=torch.long)))  # a mask of another width: fails
    build = tier_build.start_build(model, captured["input_ids"], captured["generation_config"], kwargs,
                                   {"cost_model": None, "compile": "now", "batch_buckets": True}, grid_batches=grid)
    assert build.wait(timeout=600), "the children did not end"
    outcome = build.summary
    assert outcome["returncode"] == 0 and outcome["rows_done"] and build.caches_filled, outcome
    runs = len(build_grid.GRID_OPTIONS) * 4  # each batch on the compiled and on the eager layers
    assert outcome["grid"]["processes"] == 3, outcome
    assert outcome["grid"]["done"] == runs - len(build_grid.GRID_OPTIONS), outcome
    assert outcome["grid"]["failed"] == len(build_grid.GRID_OPTIONS) and outcome["grid"]["batches"] == runs, outcome
    assert model.config.num_hidden_layers == layers


def test_variant_grid_batches_are_left_padded_trees_of_every_grid_size(tiny_llama_pair):
    """The background child's grid (build_grid.variant_grid): every batch size of GRID_ROWS, one to three shared
    levels, short and long prefixes, own tokens fixed or ragged; left-padded rows whose masks mark their tokens,
    ids inside the vocabulary, rows of one batch sharing their first GRID_PREFIX_TOKENS tokens."""
    from hf_cascade import build_grid

    model = tiny_llama_pair[1]
    grid = build_grid.variant_grid(model, torch.zeros(1, 4, dtype=torch.long), None)
    widths = build_grid._own_widths(model)
    trees = len(build_grid.GRID_PREFIX_TOKENS) * 2 + 2  # one or two levels of each prefix, three of the short one,
    # and two of the short one with long documents below it
    assert len(grid) == len(build_grid.GRID_ROWS) * len(widths) * trees * 2
    assert widths[-1] == 64 and len(widths) >= 3
    assert {ids.shape[0] for ids, _ in grid} == set(build_grid.GRID_ROWS)
    for ids, mask in grid:
        assert ids.shape == mask.shape and mask[:, -1].all() and int(ids.max()) < model.config.vocab_size
        assert (mask.cumsum(1)[:, :-1] <= mask.cumsum(1)[:, 1:]).all()  # left padding: ones run to the end
        lengths = mask.sum(1)
        first = [row[ids.shape[1] - int(n):] for row, n in zip(ids, lengths)]
        shortest = min(build_grid.GRID_PREFIX_TOKENS)
        assert all(torch.equal(f[:shortest], first[0][:shortest]) for f in first)
    assert any(len(set(mask.sum(1).tolist())) > 1 for _, mask in grid)  # ragged batches
    from hf_cascade.prefix_tree import find_shared_prefixes

    depths = {len(find_shared_prefixes([row[m.bool()].tolist() for row, m in zip(ids, mask)]).levels)
              for ids, mask in grid if ids.shape[0] == 24}
    assert depths == {1, 2, 3}
    longest = max(int(mask.sum(1).max()) for ids, mask in grid if ids.shape[0] == 24)
    assert longest >= min(build_grid.GRID_PREFIX_TOKENS) + build_grid.GRID_DOCUMENT_TOKENS  # the documents' trees


def test_warmup_writes_the_bytecode_of_imported_modules(tmp_path):
    """`hf_cascade warmup` writes the bytecode of what the calls imported where none is up to date (as pip does at
    install), so later processes on an image without it do not compile every source they import."""
    import importlib.util

    from hf_cascade.warmup import compile_bytecode

    good, bad = tmp_path / "good_module.py", tmp_path / "bad_module.py"
    good.write_text("VALUE = 3\n")
    bad.write_text("def broken(:\n")
    lines = []
    result = compile_bytecode([str(good), str(bad)], report=lines.append)
    assert result["files"] == 2 and len(result["failed"]) == 1 and "bad_module" in result["failed"][0]
    assert (tmp_path / importlib.util.cache_from_source(str(good))).is_file()
    assert "bytecode of 2 imported modules" in lines[0] and "1 could not be written" in lines[0]


def test_first_call_of_a_process_waits_for_no_triton_key(records, tiny_llama_pair, monkeypatch):
    """Where the Triton tier would cost nothing, a new process's first Triton launch would still hash Triton's key
    (0.4 s): until the key is there the Triton tier costs that much more, so the first call stays built-in and the
    next one moves up."""
    from hf_cascade import tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    monkeypatch.setattr(tiers, "WARM_TRITON_COST_S", 0.0)
    state.built = {"triton"}  # (as a marker on disk would say)
    ready = {"key": False}
    monkeypatch.setattr(tiers, "triton_key_ready", lambda: ready["key"])
    assert tiers.choose_tier(model).name == "builtin"  # regret 0 < 0 + TRITON_KEY_COST_S
    tiers.record_call(model, tiers._TIERS["builtin"], 1.0)  # regret 0.25 s: still short of the key's cost
    assert tiers.choose_tier(model).name == "builtin"
    ready["key"] = True  # the background thread hashed it during the calls
    assert tiers.choose_tier(model).name == "triton"
    tiers.record_call(model, tiers._TIERS["triton"], 0.5)
    ready["key"] = False
    assert tiers.choose_tier(model).name == "triton"  # ready: the key no longer counts


def test_the_background_build_prepares_the_tier_the_calls_may_reach():
    """The run plan's background build (hf_cascade.run_plan): after a call on the built-in or Triton tier whose step
    transformers would compile, a build of the compiled tier; where the step may not compile but may be recorded
    (TRL's ``disable_compile=True``), a build of the Triton tier after a built-in call (its Triton kernels, recorded
    steps, nothing compiled: tier_build.TRITON_BUILD_OPTIONS); none with another ``compile`` choice, beam search,
    or nothing to gain."""
    from hf_cascade import tier_build, tiers
    from hf_cascade.options import CascadeOptions
    from hf_cascade.run_plan import _background_build

    auto = CascadeOptions.from_user(None)
    builtin, triton, compiled = (tiers._TIERS[n] for n in ("builtin", "triton", "compiled"))
    assert _background_build(builtin, auto, True, True, "_sample") == "compiled"
    assert _background_build(triton, auto, True, True, "_sample") == "compiled"
    assert _background_build(compiled, auto, True, True, "_sample") is None
    assert _background_build(builtin, auto, False, True, "_sample") == "triton"  # disable_compile
    assert _background_build(triton, auto, False, True, "_sample") is None
    assert _background_build(builtin, auto, False, False, "_sample") is None  # nothing recorded either
    assert _background_build(builtin, auto, True, True, "_beam_search") is None
    assert _background_build(None, auto, True, True, "_sample") is None  # CPU: no tier
    for choice in ("now", "never"):
        assert _background_build(builtin, CascadeOptions.from_user({"compile": choice}), True, True, "_sample") is None
    assert tier_build.TRITON_BUILD_OPTIONS == {"compile": "never", "decode_step": "graphs"}


def test_a_triton_build_fills_the_triton_tier_only(records, tiny_llama_pair):
    """A build for the Triton tier (compiled=False) that filled the caches makes the Triton tier's expected cost the
    warm one (the calls move up after a call or so), not the compiled tier's: that stays cold."""
    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    build = tier_build.BackgroundBuild([], compiled=False)
    build.rows_outcome = (0, "ROWS_DONE", None)
    state.build = build
    assert tiers.caches_warm(model, state, "triton") and not tiers.caches_warm(model, state)
    state.regret["triton"] = tiers.WARM_TRITON_COST_S + tiers.TRITON_KEY_COST_S
    state.regret["compiled"] = tiers.DEFAULT_COST_S["compiled"] - 0.1  # cold: not yet
    assert tiers.choose_tier(model).name == "triton"
    assert tiers.choose_tier(model, "never").name == "triton"


def test_a_grid_that_cannot_start_never_breaks_a_call(records, tiny_llama_pair):
    """The compiled-layer grid starts from a call's tier choice (BackgroundBuild.poll): where it cannot start (its
    spec cannot be written, say), the call goes on (a warning) and the build counts as done once the rows child is."""
    from _build_children import child, stop

    from hf_cascade import tier_build, tiers

    model = tiny_llama_pair[0]
    _fresh_process(model)
    state = tiers.tier_state(model)
    rows = child("print('ROWS_DONE')")

    def start_late(running):
        raise OSError("No space left on device")

    state.build = tier_build.BackgroundBuild([rows], [], start_late)
    try:
        rows[0].wait(60)
        assert tiers.choose_tier(model).name == "builtin"
    finally:
        stop(rows)
    report = tiers.tier_report(model)["background_build"]
    assert report["caches_filled"] and report["error"] is None and report["prewarm"]["rows_done"], report


def test_decode_step_levels_merge_inside_the_suffix_softmax(monkeypatch):
    """A decode step with two prefix levels (one node shared by all rows, then one node per 4 rows) runs the
    levels' merge inside the suffix pass's softmax: no stacked states, no separate merge, the output written once in
    the query's dtype. Each op is a kernel launch inside the first tier's recorded CUDA graph (the GPU time of ~50
    small kernels per layer was ~0.4 s of a 2.5 s TRL rollout call, benchmarks/results/probe_trl_step.jsonl).
    FlashAttention-2 emulated (CPU); its calls are not counted. Same state as float64."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    def flash_like(q, k, v, *, scale, causal):  # FlashAttention-2's contract: out in q's dtype, LSE fp32
        with _disable_current_modes():
            kk, vv = (t.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scale
            return torch.matmul(torch.softmax(s, -1), vv).to(q.dtype), torch.logsumexp(s, -1)

    monkeypatch.setattr(builtin_cascade, "fused_attention_applies", lambda *a, **k: True)
    monkeypatch.setattr(builtin_cascade, "fused_attention", flash_like)
    monkeypatch.setattr(builtin_cascade, "_varlen_applies", lambda *a: True)
    emulated = _emulated_varlen_flash(False)

    def varlen(*args):
        with _disable_current_modes():
            return emulated(*args)

    monkeypatch.setattr(builtin_cascade, "_varlen_flash", varlen)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
                return out  # a view launches nothing
            if func not in (torch.ops.aten.new_empty.default, torch.ops.aten.scalar_tensor.default,
                            torch.ops.aten._unsafe_view.default):  # (no kernel either)
                self.kernels.append(func.__name__)
            return out

    torch.manual_seed(4)
    B, Hq, Hkv, D, S = 8, 6, 2, 16, 9
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    levels, prefixes = _levels(Hkv, D, D, [([11], [0] * B), ([5, 7], [0, 0, 0, 0, 1, 1, 1, 1])], torch.float32)
    visible = torch.ones(B, 1, S, dtype=torch.bool)
    visible[2, :, :3] = False
    for _, _, plan in prefixes:
        plan.varlen_layout  # (built once per batch layout, before the step is recorded)
    with Ops() as ops:
        out, lse = builtin_cascade_attention(q, k, v, prefixes, scale=D ** -0.5, mask=visible)
    assert len(ops.kernels) <= 16, ops.kernels  # 16 today (40 with the merges apart, afb6166)
    assert "stack" not in ops.kernels and "logsumexp" not in ops.kernels, ops.kernels
    want_out, want_lse = _f64(q, k, v, levels, D ** -0.5, visible)
    torch.testing.assert_close(out.transpose(1, 2).double(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)
