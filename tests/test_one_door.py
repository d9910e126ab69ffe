"""The caches' one door to the kernels (``CascadeWrapper.run`` -> one ``cascade_attention`` call): the op's backends
(``"builtin"``: PyTorch's own kernels; ``"torch"`` with a level's device index tensors) against the ones they stand
for, their refusals, and what an eager forward on fixed buffers passes (the buffers cut at the written count, no
device count: the kernel variants a growing cache's forwards launch)."""

import importlib

import pytest
import torch

import hf_cascade
from hf_cascade.ops import cascade_attention, plan_shared_prefix
from hf_cascade.ops.builtin_cascade import builtin_cascade_attention
from hf_cascade.transformers_compat import CACHE_KWARG

cascade_module = importlib.import_module("hf_cascade.ops.cascade_attention")  # (the package names the function)
wrapper_module = importlib.import_module("hf_cascade.ops.cascade_wrapper")


def _batch(B=5, Hq=6, Hkv=2, D=24, Lq=3, S=7, seed=0):
    """GQA 6/2, two levels (a shared node; two nodes, one row without a node), a masked suffix."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, Lq, S, generator=g) > 0.3
    mask[..., -1] = True
    prefixes, tensors = [], []
    for lengths, row_node in (([9], [0] * B), ([4, 6], [0, 1, 1, -1, 0])):
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        kp, vp = torch.randn(Hkv, int(starts[-1]), D, generator=g), torch.randn(Hkv, int(starts[-1]), D, generator=g)
        rows = torch.tensor(row_node, dtype=torch.int64)
        prefixes.append((kp, vp, plan_shared_prefix(rows, starts)))
        tensors.append((kp, vp, (starts, rows)))
    return q, k, v, mask, prefixes, tensors


def test_builtin_backend_is_the_builtin_kernels():
    q, k, v, mask, prefixes, _ = _batch()
    out, lse = cascade_attention(q, k, v, prefixes, scale=0.3, mask=mask, backend="builtin")
    want_out, want_lse = builtin_cascade_attention(q, k, v, prefixes, scale=0.3, mask=mask)
    assert torch.equal(out.transpose(1, 2), want_out) and torch.equal(lse, want_lse)


def test_torch_backend_takes_a_levels_device_index_tensors():
    q, k, v, mask, prefixes, tensors = _batch()
    want = cascade_attention(q, k, v, prefixes, scale=0.3, mask=mask, backend="torch")
    got = cascade_attention(q, k, v, tensors, scale=0.3, mask=mask, backend="torch")
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_backend_refusals_name_the_argument():
    q, k, v, mask, prefixes, tensors = _batch()
    with pytest.raises(ValueError, match="backend='builtin'.*key_length"):
        cascade_attention(q, k, v, prefixes, scale=0.3, mask=mask, backend="builtin",
                          key_length=torch.tensor(k.shape[2]))
    with pytest.raises(ValueError, match="PrefixPlan.*torch backend"):
        cascade_attention(q, k, v, tensors, scale=0.3, mask=mask, backend="triton")
    starts, rows = tensors[1][2]
    bad = [tensors[0], (tensors[1][0], tensors[1][1], (starts.int(), rows))]
    with pytest.raises(ValueError, match=r"node_starts, row_node\) must be int64"):
        cascade_attention(q, k, v, bad, scale=0.3, mask=mask, backend="torch")


def test_eager_forward_on_fixed_buffers_reads_the_written_columns(monkeypatch):
    """A cache with fixed buffers, forwards run eagerly (CPU): every call through the door gets the buffers cut at
    the written count and no device count, and generate() gives sdpa's greedy tokens."""
    from hf_cascade.model_zoo import tiny_model

    model, ref = tiny_model("llama", "cascade", seed=0), tiny_model("llama", "sdpa", seed=0)
    seen = []
    door = wrapper_module.cascade_attention

    def spy(query, key, value, prefixes=(), **kw):
        seen.append((key.shape[2], kw.get("key_length")))
        return door(query, key, value, prefixes, **kw)

    monkeypatch.setattr(wrapper_module, "cascade_attention", spy)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, model.config.vocab_size, (1, 19), generator=g)
    ids = torch.cat([shared.expand(4, -1), torch.randint(3, model.config.vocab_size, (4, 5), generator=g)], 1)
    mask = torch.ones_like(ids)
    inputs = hf_cascade.shared_prefix_inputs(model, ids, mask, max_new_tokens=6)
    cache = inputs[CACHE_KWARG]
    assert cache.fixed_decode_buffers and cache.max_suffix_length > 5 + 6 - 1
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got[:, -6:], want[:, -6:])
    assert seen and all(length is None for _, length in seen)
    assert max(columns for columns, _ in seen) < cache.max_suffix_length  # never the whole buffer
    assert {columns for columns, _ in seen} >= {5, 6}  # the rows' first forward, then one column more a step
