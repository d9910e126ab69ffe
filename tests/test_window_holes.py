"""Sliding windows and attention chunks with masked columns inside rows (not left padding: the pads an earlier turn of
a batched chat leaves when its rows end at different steps). transformers' masks count a window in columns, masked
ones included, and chunks from each row's first real column; hf_cascade must give the same tokens (fp32) whether the
masked columns lie in a row's own tokens, inside what its rows share, or between the two (hf_cascade.windows).
"""

import numpy as np
import pytest
import torch

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.inputs import _real_tokens_on_host, _rows_for_sharing
from hf_cascade.model_zoo import available_families
from hf_cascade.transformers_compat import CACHE_KWARG

from test_generate import model_pair, pad_batch

# Windows and chunks of 8 / 16 tokens, shorter than the rows (26-33 tokens and 6 new).
FAMILIES = [("gemma3", {}), ("gpt_oss", {}), ("mistral", dict(sliding_window=16)), ("llama4", {})]
OPTIONS = dict(cost_model=None, min_shared_tokens=2)
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def _rows(seed=0):
    """Four rows: a 20-token system prompt shared by all, a 4-token block shared by pairs, 2-9 own tokens."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 120, (n,), generator=g).tolist()  # noqa: E731
    system, blocks = [1] + rand(19), [rand(4), rand(4)]
    return [system + blocks[i // 2] + rand(2 + 2 * i + (i % 2)) for i in range(4)]


def _with_holes(ids, mask, holes):
    """``mask`` with 0 at ``holes`` (``(row, column)``, each a real token that is not the row's last)."""
    mask = mask.clone()
    for row, column in holes:
        assert mask[row, column] == 1 and column < ids.shape[1] - 1
        mask[row, column] = 0
    return mask


def _check(ref, cas, ids, mask):
    want = ref.generate(ids, attention_mask=mask, **GEN)
    got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_options=OPTIONS, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.logits[0], want.logits[0], atol=1e-4, rtol=0)


def _skip_unavailable(family):
    if family not in available_families():
        pytest.skip(f"no {family} config in this transformers")


@pytest.mark.parametrize("family, overrides", FAMILIES)
@pytest.mark.parametrize("where", ["own tokens", "shared prefix", "after the shared prefix"])
def test_masked_columns_inside_rows_match_the_reference(family, overrides, where):
    _skip_unavailable(family)
    ref, cas = model_pair(family, seed=3, **overrides)
    rows = _rows()
    ids, mask = pad_batch(rows)
    width = ids.shape[1]
    lead = [width - len(r) for r in rows]  # each row's first real column
    holes = {
        "own tokens": [(0, width - 2), (2, width - 4), (3, width - 7)],
        "shared prefix": [(1, lead[1] + 9), (2, lead[2] + 3)],
        "after the shared prefix": [(0, lead[0] + 20), (3, lead[3] + 24)],  # the first column after a node
    }[where]
    _check(ref, cas, ids, _with_holes(ids, mask, holes))


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_batched_chat_second_turn_with_pads_inside(family):
    """Turn 1's rows end on EOS at different steps; turn 2 appends the answers (their pads masked) and a new user
    message to every row: the masked columns sit inside each row, after what the rows share."""
    _skip_unavailable(family)
    ref, cas = model_pair(family, seed=3)
    rows = _rows(seed=1)
    ids, mask = pad_batch(rows)
    first = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    answers = first[:, ids.shape[1]:].clone()
    answers[0, 2:] = 0  # row 0 ended after two tokens, row 2 after four: pads inside the next turn's rows
    answers[2, 4:] = 0
    message = torch.tensor([[40, 41, 42, 43, 44]]).expand(len(rows), -1)
    ids2 = torch.cat([ids, answers, message], 1)
    mask2 = torch.cat([mask, (answers != 0).long(), torch.ones_like(message)], 1)
    _check(ref, cas, ids2, mask2)


def test_rows_share_up_to_their_first_masked_column_only_where_a_window_is_shorter():
    """The tree's rows (inputs._rows_for_sharing): on a windowed model a row's tokens from its first masked column
    inside it on match no other row's; on a model without windows, or with windows longer than the rows and new
    tokens, the rows are their real tokens."""
    _, windowed = model_pair("mistral", seed=0, sliding_window=16)
    _, full = model_pair("llama", seed=0)
    ids, mask = pad_batch(_rows())
    mask = _with_holes(ids, mask, [(1, ids.shape[1] - 5)])
    real_ids, real_columns, lengths, _ = _real_tokens_on_host(ids, mask)
    rows = _rows_for_sharing(windowed, real_ids, real_columns, lengths, 0, ids.shape[1] + 6)
    before = int(lengths[1]) - 4  # the real tokens of row 1 before its masked column
    assert np.array_equal(rows[1, :before], real_ids[1, :before])
    assert len(set(rows[1, before:lengths[1]].tolist())) == 1 and rows[1, before] not in real_ids
    assert np.array_equal(np.delete(rows, 1, 0), np.delete(real_ids, 1, 0))
    assert _rows_for_sharing(full, real_ids, real_columns, lengths, 0, None) is real_ids
    assert _rows_for_sharing(windowed, real_ids, real_columns, lengths, 0, 16) is real_ids  # the window never binds


def test_a_masked_column_inside_a_prefix_cache_on_a_windowed_model_is_an_error():
    """A prefix_cache's tokens are shared by every row; where a row has a masked column inside them and the model's
    windows count columns, the stored prefix cannot stand for that row: a ValueError naming prefix_cache."""
    _, cas = model_pair("mistral", seed=0, sliding_window=16)
    rows = _rows()
    rows[2] = rows[2][:5] + [0] + rows[2][5:]  # a pad column between the prefix's tokens 4 and 5
    ids, mask = pad_batch(rows)
    mask[2, ids.shape[1] - len(rows[2]) + 5] = 0
    cache = CascadeCache.from_prefix(cas, torch.tensor(rows[0][:20]))
    with pytest.raises(ValueError, match="masked columns inside the 20-token prefix of `prefix_cache`"):
        hf_cascade.shared_prefix_inputs(cas, ids, mask, prefix_cache=cache, min_shared_tokens=2)


def test_attention_mask_of_another_width_is_a_clear_error():
    _, cas = model_pair("llama", seed=0)
    ids, mask = pad_batch(_rows())
    with pytest.raises(ValueError, match="`attention_mask` must have the shape of `input_ids`"):
        cas.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=2, do_sample=False, pad_token_id=0,
                     custom_generate=hf_cascade.generate, cascade_options=OPTIONS)


def test_from_prefix_rows_with_pads_after_the_prefix_count_positions():
    """A from_prefix cache given straight to generate() takes rows ``[prefix | pads | suffix]``: they stand for the
    left-padded rows of prefix + suffix, so its windows count positions (the pads are the layout's, not the user's)."""
    ref, cas = model_pair("mistral", seed=0, sliding_window=16)
    rows = _rows()
    prefix = rows[0][:20]
    suffixes = [r[20:] for r in rows]
    width = max(len(s) for s in suffixes)
    ids = torch.tensor([prefix + [0] * (width - len(s)) + s for s in suffixes])
    mask = torch.tensor([[1] * 20 + [0] * (width - len(s)) + [1] * len(s) for s in suffixes])
    got = cas.generate(ids, attention_mask=mask, **{CACHE_KWARG: CascadeCache.from_prefix(cas, prefix)}, **GEN)
    ref_ids, ref_mask = pad_batch(rows)
    want = ref.generate(ref_ids, attention_mask=ref_mask, **GEN)
    assert torch.equal(got.sequences[:, ids.shape[1]:], want.sequences[:, ref_ids.shape[1]:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("compile_choice", [None, "now"])
def test_gpu_masked_columns_inside_rows(compile_choice):
    """CUDA, fp32: masked columns in rows' own tokens and after their shared prefix, on a windowed and a chunked
    model, through the default tier (recorded steps on PyTorch's kernels) and the compiled one (the bounded op's
    Triton kernels): the reference's tokens."""
    for family, overrides in (("gemma3", {}), ("llama4", {})):
        if family not in available_families():
            continue
        ref, cas = (m.cuda() for m in model_pair(family, seed=3, **overrides))
        rows = _rows(seed=2)
        ids, mask = pad_batch(rows)
        lead = ids.shape[1] - len(rows[0])
        mask = _with_holes(ids, mask, [(0, lead + 20), (2, ids.shape[1] - 3)])
        ids, mask = ids.cuda(), mask.cuda()
        gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        want = ref.generate(ids, attention_mask=mask, **gen)
        options = dict(OPTIONS, **({"compile": compile_choice} if compile_choice else {}))
        for _ in range(2):  # a second call replays the recorded graphs
            got = cas.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate, cascade_options=options,
                               **gen)
            assert torch.equal(got, want), family
