"""Fourth sweep of inputs that gave wrong answers without a word (issue 49): each is now exact against sdpa (fp32,
same weights) or a clear error naming the cause and the fix.

* A NaN (or an fp16/bf16 overflow) inside one shared segment reached rows that never read it: masked prefix columns
  were multiplied by 0 (0 x NaN = NaN) in the PyTorch path's one-matmul and gathered levels.
* Right-padded rows sharing a prefix had their padding moved to the front, so their first new token came from their
  last real token, not from the last column as sdpa's does: now refused, naming ``padding_side="left"``.
"""

import pytest
import torch
import torch.nn.functional as F

import hf_cascade
from hf_cascade.ops import cascade_attention
from hf_cascade.ops.builtin_cascade import builtin_cascade_attention
from hf_cascade.ops.cascade_wrapper import planned_attention, step_inputs
from hf_cascade.model_zoo import tiny_model
from hf_cascade.ops.plan import plan_cascade, plan_shared_prefix

from _ops_common import needs_triton
from test_generate import model_pair, pad_batch

NAN_TOKEN = 77
GEN = dict(max_new_tokens=4, pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_logits=True)
ONE_ARGUMENT = dict(custom_generate=hf_cascade.generate, cascade_options=dict(min_shared_tokens=2))


def _tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 128, (n,), generator=generator).tolist()


# ------------------------------------------------------------------ a NaN in one shared segment
def _level(lengths, seed=0, hkv=2, d=16):
    """A level of nodes of ``lengths`` keys: ``(k, v [hkv, T, d], node_starts)``, and the same with node 0's keys
    and values NaN."""
    g = torch.Generator().manual_seed(seed)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    k, v = torch.randn(hkv, starts[-1], d, generator=g), torch.randn(hkv, starts[-1], d, generator=g)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, : starts[1]] = v_nan[:, : starts[1]] = float("nan")
    return (k, v), (k_nan, v_nan), starts


def _attend(way, q, ks, vs, k, v, row_node, starts):
    """``out [B, Hq, Lq, D]`` of one cascade layer, the prefix level read the way ``way`` names."""
    B = q.shape[0]
    if way == "builtin":
        plan = plan_shared_prefix(torch.tensor(row_node), torch.tensor(starts))
        return builtin_cascade_attention(q, ks, vs, [(k, v, plan)], scale=0.25, mask=None)[0].transpose(1, 2)
    if way == "op":  # a compiled step's op: the layout as device index tensors (no host plan)
        plan = plan_cascade(torch.tensor([row_node]), [starts], B, torch.device("cpu"))
        tensors = [t for level in step_inputs(plan, q, ks, [k]) for t in level]
        return planned_attention(q, ks, vs, [k], [v], tensors, None, 0.25, None, backend="torch")[0].transpose(1, 2)
    plan = plan_shared_prefix(torch.tensor(row_node), torch.tensor(starts))
    return cascade_attention(q, ks, vs, [(k, v, plan)], scale=0.25, backend=way)[0]


@pytest.mark.parametrize("way", ["torch", "op", "builtin", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("lengths, row_node, torch_way", [
    ((12,), (0, 0, 0, -1), "dense"),  # three rows on the NaN node, one on none
    ((5, 6), (0, 1, 0, 1), "dense"),  # two nodes, rows not consecutive
    ((600, 300) + (400,) * 7, (1, 2, 0, -1), "gather"),  # many nodes; row 3 reads none
    ((600, 300) + (400,) * 7, (1, 0, 2, 3), "gather"),
])
@pytest.mark.parametrize("lq", [1, 3])
def test_a_nan_node_reaches_only_its_own_rows(way, lengths, row_node, torch_way, lq):
    """A row's attention never reads another node's columns: with node 0's keys and values NaN, every row not on
    node 0 gets bit for bit what it gets with them finite (the PyTorch path's one matmul and gathered levels
    multiplied the hidden columns' weights 0 by NaN). Rows on node 0 come out NaN on the PyTorch path, as sdpa's."""
    (k, v), (k_nan, v_nan), starts = _level(lengths)
    assert plan_shared_prefix(torch.tensor(row_node), torch.tensor(starts)).torch_way == torch_way
    g = torch.Generator().manual_seed(1)
    B, hq, hkv, d, S = len(row_node), 4, 2, 16, 3
    q, ks, vs = (torch.randn(*shape, generator=g) for shape in ((B, hq, lq, d), (B, hkv, S, d), (B, hkv, S, d)))
    finite = _attend(way, q, ks, vs, k, v, row_node, starts)
    poisoned = _attend(way, q, ks, vs, k_nan, v_nan, row_node, starts)
    for row, node in enumerate(row_node):
        if node != 0:
            assert torch.equal(poisoned[row], finite[row]), f"row {row} (node {node}) changed by node 0's NaN"
        elif way in ("torch", "op"):
            assert torch.isnan(poisoned[row]).all()


def _nan_models(family="llama"):
    """The sdpa / cascade pair with token ``NAN_TOKEN``'s input embedding NaN."""
    ref, cas = model_pair(family)
    for model in (ref, cas):
        with torch.no_grad():
            model.get_input_embeddings().weight[NAN_TOKEN] = float("nan")
    return ref, cas


def _nan_rows(seed=3):
    """Three rows sharing a prefix that holds ``NAN_TOKEN``, a fourth sharing nothing."""
    g = torch.Generator().manual_seed(seed)
    shared = [1, *_tokens(4, g), NAN_TOKEN, *_tokens(6, g)]
    return [shared + _tokens(3, g), shared + _tokens(4, g), shared + _tokens(2, g), [1, *_tokens(9, g)]]


def test_a_nan_in_a_shared_prefix_stays_in_the_rows_that_read_it():
    """The fourth row's tokens and logits are sdpa's (they were NaN, its tokens 0s); the rows that read the NaN are
    NaN exactly where sdpa's are, with sdpa's tokens."""
    ref, cas = _nan_models()
    ids, mask = pad_batch(_nan_rows())
    want = ref.generate(ids, attention_mask=mask, **GEN)
    caches = []
    got = cas.generate(ids, attention_mask=mask, **GEN, **ONE_ARGUMENT, cascade_caches=caches)
    assert caches and caches[0].prefilled_prefix_tokens > 0  # the prefix was shared
    assert torch.equal(got.sequences, want.sequences)
    for w, g in zip(want.logits, got.logits):
        assert torch.isfinite(w[3]).all()
        torch.testing.assert_close(g[3], w[3], atol=1e-4, rtol=0)
        assert torch.equal(torch.isnan(g), torch.isnan(w))


def test_a_nan_in_a_shared_context_stays_out_of_score():
    """hf_cascade.score: the pair whose context shares nothing scores as sdpa scores it alone (it was NaN); the
    pairs whose shared context holds the NaN score NaN, as sdpa's."""
    ref, cas = _nan_models()
    g = torch.Generator().manual_seed(5)
    contexts = _nan_rows()
    continuations = [_tokens(2, g) for _ in contexts]
    got = hf_cascade.score(cas, contexts, continuations, min_shared_tokens=2)
    assert got.stats["shared_tokens"] > 0
    for context, continuation, logprob in zip(contexts, continuations, got.logprobs.tolist()):
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logits = ref(ids[:, :-1]).logits[0, -len(continuation):].double()
        want = float(F.log_softmax(logits, -1).gather(-1, torch.tensor(continuation)[:, None]).sum())
        if NAN_TOKEN in context:
            assert logprob != logprob and want != want  # NaN, both
        else:
            assert abs(logprob - want) < 1e-4, (logprob, want)


# ------------------------------------------------------------------ right padding
def _sharing_rows(seed=4):
    """Rows of different lengths sharing an 11-token prefix, and a row sharing nothing."""
    g = torch.Generator().manual_seed(seed)
    shared = [1, *_tokens(10, g)]
    return [shared + _tokens(3, g), shared + _tokens(5, g), shared + _tokens(2, g), [1, *_tokens(6, g)]]


@pytest.mark.parametrize("new_tokens", [1, 4])
def test_right_padded_rows_sharing_a_prefix_are_refused_before_any_work(new_tokens):
    """sdpa takes a right-padded row's first new token from the last column (a pad; transformers warns); the
    cascade path took it from the row's last real token, so the tokens differed from the first one on. Refused,
    naming the rows and padding_side="left", before any forward; the left-padded batch is sdpa's exactly."""
    ref, cas = model_pair("llama")
    rows = _sharing_rows()
    ids, mask = pad_batch(rows, side="right")
    forwards = []
    handle = cas.register_forward_pre_hook(lambda *args: forwards.append(1))
    message = (r"input_ids / attention_mask \[4, 16\]\) is right-padded: 3 of its rows end with padding \(row 0 "
               r"\(2 pad columns\), row 2 \(3 pad columns\), row 3 \(9 pad columns\)\).*padding_side = \"left\"")
    try:
        with pytest.raises(ValueError, match=message):
            cas.generate(ids, attention_mask=mask, **dict(GEN, max_new_tokens=new_tokens), **ONE_ARGUMENT)
        with pytest.raises(ValueError, match=message):
            hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2)
    finally:
        handle.remove()
    assert forwards == []
    left_ids, left_mask = pad_batch(rows)
    gen = dict(GEN, max_new_tokens=new_tokens)
    want = ref.generate(left_ids, attention_mask=left_mask, **gen)
    got = cas.generate(left_ids, attention_mask=left_mask, **gen, **ONE_ARGUMENT)
    assert torch.equal(got.sequences, want.sequences)


def test_right_padded_rows_sharing_nothing_are_sdpa_s_own():
    """Nothing shared: shared_prefix_inputs returns the user's rows as they are (it moved the right padding to the
    front, so the tokens differed from sdpa's), and generate() on them gives sdpa's tokens, right padding and all."""
    ref, cas = model_pair("llama")
    g = torch.Generator().manual_seed(13)
    ids, mask = pad_batch([_tokens(n, g) for n in (5, 9, 2)], side="right")
    want = ref.generate(ids, attention_mask=mask, **GEN)
    inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2)
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["attention_mask"], mask)
    got = cas.generate(**inputs, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    for w, g in zip(want.logits, got.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_generate_under_autocast_is_refused_clearly():
    """Under torch.autocast (TRL's default bf16=True) the cascade cache would hold keys and values of different dtypes:
    a clear ValueError naming autocast and the way out, before any work, instead of a dtype error deep in a kernel."""
    model = tiny_model("llama", "cascade", seed=0)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    ids[:, :6] = ids[0, :6]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0,
                       custom_generate=hf_cascade.generate)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0,
                         custom_generate=hf_cascade.generate)  # outside autocast: runs
    assert out.shape == (2, 11)
