"""The CPU thread policy of the cascade call (hf_cascade.cpu_threads): decided from the shared prefill, applied to
the decode steps only, restored after, and the tokens are the same whatever it decides."""

import pytest
import torch

import hf_cascade
from hf_cascade.cpu_threads import ContentionProbe, cpu_decode_threads
from hf_cascade.tiny import tiny_model, tiny_tokenizer


def probe(cpu_s, wall_s, policy="auto", device="cpu"):
    p = ContentionProbe(device, policy)
    p.cpu_s, p.wall_s = cpu_s, wall_s
    return p


def test_probe_decides_from_the_prefill(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert probe(1.9, 1.0).decode_threads() is None  # the threads got their cores: quiet, nothing changes
    assert probe(0.8, 1.0).decode_threads() == 1  # 3 busy processes beside it: 0.8 of 2 cores
    assert probe(0.01, 0.02).decode_threads() is None  # too short to say
    assert probe(0.8, 1.0, policy=None).decode_threads() is None
    assert probe(1.9, 1.0, policy=3).decode_threads() == 3
    assert probe(0.8, 1.0, device="meta").decode_threads() is None  # not a CPU
    busy_before = probe(1.9, 1.0)
    busy_before.busy_before = True  # the probe before the prefill found it busy: the steps single-threaded too
    assert busy_before.decode_threads() == 1


def test_probe_before_the_prefill_sees_a_quiet_cpu_as_quiet():
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to probe")
    p = ContentionProbe("cpu", "auto")
    # Quiet or not is this machine's state; the probe must at least measure and decide without error.
    assert p.probe_before() in (True, False)
    assert ContentionProbe("cpu", None).probe_before() is False


def test_threads_restored_and_tokens_unchanged():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = ["A shared system prompt of some length.\nQ: " + q for q in ("one?", "two?", "three?")]
    batch = tok(prompts, return_tensors="pt", padding=True)
    before = torch.get_num_threads()
    seen = []
    forward = model.forward
    model.forward = lambda *a, **k: seen.append(torch.get_num_threads()) or forward(*a, **k)
    try:
        outs = [model.generate(**batch, max_new_tokens=4, do_sample=False, custom_generate=hf_cascade.generate,
                               cascade_options=dict(cpu_decode_threads=policy)) for policy in (None, 1, "auto")]
    finally:
        del model.forward
    assert torch.get_num_threads() == before
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert 1 in seen  # cpu_decode_threads=1 ran the steps single-threaded (when torch has several threads)
    with pytest.raises(ValueError, match="cpu_decode_threads"):
        model.generate(**batch, max_new_tokens=2, custom_generate=hf_cascade.generate,
                       cascade_options=dict(cpu_decode_threads=0))


def test_cpu_decode_threads_context():
    before = torch.get_num_threads()
    with cpu_decode_threads("cpu", 1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with cpu_decode_threads("cpu", None):
        assert torch.get_num_threads() == before
