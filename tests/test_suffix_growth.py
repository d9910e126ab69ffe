"""The dynamic suffix KV (``SuffixLayer``) appends a step's columns into spare room instead of ``torch.cat`` of the
whole suffix: the same tensors as concatenation after any sequence of updates, crops, reorders and resets."""

import torch

from hf_cascade.suffix_layers import SuffixLayer


def _cat_model(ops, B=3, H=2, D=4):
    """Replays ``ops`` on a SuffixLayer and on plain concatenation; checks they agree after every op."""
    layer = SuffixLayer()
    keys = values = None
    gen = torch.Generator().manual_seed(0)
    for op, arg in ops:
        if op == "update":
            k = torch.randn(B if keys is None else keys.shape[0], H, arg, D, generator=gen)
            v = torch.randn(k.shape, generator=gen)
            got_k, got_v = layer.update(k, v)
            keys = k if keys is None else torch.cat([keys, k], dim=-2)
            values = v if values is None else torch.cat([values, v], dim=-2)
            assert got_k is layer.keys and got_v is layer.values
        elif op == "crop":
            layer.crop(arg)
            keys, values = keys[..., : keys.shape[-2] - arg, :], values[..., : values.shape[-2] - arg, :]
        elif op == "reorder":
            index = torch.tensor(arg)
            layer.reorder_cache(index)
            keys, values = keys[index], values[index]
        elif op == "repeat":
            layer.batch_repeat_interleave(arg)
            keys, values = keys.repeat_interleave(arg, 0), values.repeat_interleave(arg, 0)
        elif op == "reset":
            layer.reset()
            keys = values = None
            assert layer.get_seq_length() == 0
            continue
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values), (op, arg)
        assert layer.get_seq_length() == keys.shape[-2]
    return layer


def test_decode_steps_write_in_place():
    layer = _cat_model([("update", 5)] + [("update", 1)] * 40)
    # 45 columns: at most one buffer per doubling, the last one still holding the columns written
    assert layer.keys.data_ptr() == layer._room[0].data_ptr()


def test_one_step_copies_only_its_column():
    layer = SuffixLayer()
    layer.update(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4))
    room = layer._room[0].data_ptr()
    before = layer.keys
    layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert layer._room[0].data_ptr() == room  # no new buffer: the column went into the spare room
    assert before.shape[-2] == 6 and torch.equal(layer.keys[..., :6, :], before)


def test_crop_reorder_repeat_reset():
    _cat_model([("update", 7), ("update", 1), ("crop", 3), ("update", 1), ("update", 2), ("reorder", [2, 0, 0]),
                ("update", 1), ("repeat", 2), ("update", 1), ("crop", 1), ("update", 60), ("reset", None),
                ("update", 4), ("update", 1)])
