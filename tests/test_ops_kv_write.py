"""write_suffix_kv: the Triton kernel (interpreter on CPU) writes exactly what the reference writes (index_copy_ of K
and V, the length advanced), and bad arguments raise a ValueError naming them."""

import pytest
import torch

from hf_cascade.ops.kv_write import write_suffix_kv
from hf_cascade.ops.reference import write_suffix_kv_ref

from _ops_common import needs_triton


def _case(B, H, Q, D, S, dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # as transformers' projections give them: [B, Q, H, D] memory, viewed [B, H, Q, D]
        key = torch.randn(B, Q, H, D, generator=g).to(dtype).transpose(1, 2)
        value = torch.randn(B, Q, H, D, generator=g).to(dtype).transpose(1, 2)
    else:
        key = torch.randn(B, H, Q, D, generator=g).to(dtype)
        value = torch.randn(B, H, Q, D, generator=g).to(dtype)
    keys = torch.randn(B, H, S, D, generator=g).to(dtype)
    values = torch.randn(B, H, S, D, generator=g).to(dtype)
    start = S - Q - 2
    return key, value, keys, values, torch.arange(Q) + start, torch.tensor(start, dtype=torch.int64)


@needs_triton
@pytest.mark.parametrize("B,H,Q,D,S", [(3, 2, 1, 64, 9), (2, 5, 3, 80, 16), (1, 1, 4, 16, 4 + 2 + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_writes_what_the_reference_writes(B, H, Q, D, S, dtype, transposed):
    key, value, keys, values, positions, length = _case(B, H, Q, D, S, dtype, transposed)
    want = [t.clone() for t in (keys, values, length)]
    write_suffix_kv_ref(key, value, *want[:2], positions, want[2])
    write_suffix_kv(key, value, keys, values, positions, length, backend="triton")
    assert torch.equal(keys, want[0]) and torch.equal(values, want[1])
    assert int(length) == int(want[2]) == int(positions[0]) + Q
    assert torch.equal(keys[:, :, positions].transpose(1, 2), key.transpose(1, 2))  # the new tokens, nothing else


def test_empty_step_writes_nothing():
    key, value, keys, values, positions, length = _case(2, 2, 1, 16, 5, torch.float32, False)
    before = keys.clone()
    write_suffix_kv(key[:, :, :0], value[:, :, :0], keys, values, positions[:0], length)
    assert torch.equal(keys, before) and int(length) == 2


def test_bad_arguments_raise_value_errors_naming_them():
    key, value, keys, values, positions, length = _case(2, 2, 1, 16, 5, torch.float32, False)
    with pytest.raises(ValueError, match="key and value"):
        write_suffix_kv(key, value[:, :1], keys, values, positions, length)
    with pytest.raises(ValueError, match="buffers"):
        write_suffix_kv(key, value, keys[:1], values[:1], positions, length)
    with pytest.raises(ValueError, match="dtype"):
        write_suffix_kv(key.half(), value.half(), keys, values, positions, length)
    with pytest.raises(ValueError, match="positions"):
        write_suffix_kv(key, value, keys, values, positions.int(), length)
    with pytest.raises(ValueError, match="length"):
        write_suffix_kv(key, value, keys, values, positions, length[None])
