"""PyTorch's fused attention as hf_cascade calls it (CUDA): every kernel and GQA form against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from hf_cascade.ops.fused_attention import cudnn_attention_agrees, fused_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reference(q, k, v, scale, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v), s.logsumexp(-1)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("hq,hkv,lq,lk,causal", [(32, 8, 130, 517, False), (8, 8, 64, 300, False),
                                                 (12, 4, 77, 77, True), (32, 8, 1, 4099, False)])
def test_fused_attention_matches_the_reference(kernel, hq, hkv, lq, lk, causal):
    if kernel == "cudnn" and not cudnn_attention_agrees(torch.device("cuda")):
        pytest.skip("cuDNN attention does not run here (hf_cascade falls back to the flash kernel)")
    g = torch.Generator(device="cuda").manual_seed(hq + lk)
    q = torch.randn(2, hq, lq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, hkv, lk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, hkv, lk, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k_view = torch.cat([k, k], dim=2)[:, :, :lk]  # a strided view of a longer buffer, as the KV storage is
    out, lse = fused_attention(q, k_view, v, scale=0.088, causal=causal, kernel=kernel)
    ref_out, ref_lse = _reference(q, k, v, 0.088, causal)
    rounding = (ref_out.bfloat16().float() - ref_out).abs().max().item()
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert (out.float() - ref_out).abs().max().item() <= 2 * rounding + 1e-3
    assert (lse - ref_lse).abs().max().item() < 2e-3
