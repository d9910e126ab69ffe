"""Issue 51's peers on CPU, fp32 (the device run is ``benchmarks/bench_peers_gpu.py``): transformers' continuous
batching (``generate_batch`` with prefix sharing, ``benchmarks/cb_peer.py``) gives generate()'s greedy tokens and
hf_cascade's, in both configurations; the TRL GRPO rollout reproduced in ``benchmarks/trl_rollout.py`` gives the
same completions through hf_cascade's route as through TRL's default path (same seed), and its generation config is
the one TRL's ``GRPOTrainer`` builds (where trl is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cb_peer  # noqa: E402
import trl_rollout  # noqa: E402


def test_generate_batch_tokens_equal_generate_and_hf_cascade():
    record = cb_peer.tokens_check("cpu")
    assert record["passed"], record
    for name, batch in record["batches"].items():
        for config in ("defaults", "best"):
            assert batch[f"generate_batch_{config}_status"] == "ok", (name, batch)
        # prefix sharing ran: later requests found the first one's complete pages
        assert batch["generate_batch_defaults_prefix_tokens_reused"] > 0, (name, batch)
    assert record["batches"]["tree"]["hf_cascade_levels"] == 2


def test_a_setting_this_transformers_lacks_is_recorded_not_passed():
    config, applied, unsupported = cb_peer.make_cb_config({"page_size": 16, "no_such_setting": 1})
    assert set(applied) <= {"page_size", "block_size"} and applied and config is not None
    assert list(unsupported) == ["no_such_setting"]


def test_trl_rollout_through_hf_cascade_equals_the_default_path():
    record = trl_rollout.tiny_check("cpu")
    assert record["passed"], record
    assert record["hf_cascade_levels"] == 2  # the shared system prompt, then each prompt for its generations


def test_a_probes_cascade_options_reach_the_rollout():
    """``rollout_cascade(..., cascade_options={"max_levels": 1})`` (probe_trl_step's A/B): one shared level instead of
    two, and the same completions as TRL's default path in fp32 with the same seed."""
    import torch

    model = trl_rollout.build_model("tiny", device="cpu", dtype=torch.float32)
    prompts = trl_rollout.make_prompts("tiny", prompts=3, system=24, own=(6, 14))
    rows = [p for p in prompts for _ in range(4)]
    config = trl_rollout.trl_generation_config("tiny", 6)
    caches = []
    torch.manual_seed(2)
    flat = trl_rollout.rollout_cascade(model, rows, config, caches, cascade_options={"max_levels": 1})
    torch.manual_seed(2)
    default = trl_rollout.rollout_default(model, rows, config)
    assert caches[-1].num_levels == 1 and flat == default


def test_reproduced_generation_config_is_grpo_trainers(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from hf_cascade.model_zoo import tiny_model
    from hf_cascade.tiny import tiny_tokenizer

    folder = str(tmp_path / "model")
    model, tok = tiny_model("qwen2", attn_implementation="sdpa", vocab_size=260), tiny_tokenizer()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    eos = model.generation_config.eos_token_id
    monkeypatch.setitem(trl_rollout.SHAPES, "test", dict(
        pad=tok.pad_token_id, bos=tok.bos_token_id, tokenizer_eos=tok.eos_token_id,
        model_eos=[eos] if isinstance(eos, int) else list(eos or [])))
    dataset = datasets.Dataset.from_dict({"prompt": ["Q: 1 + 1 = ?\nA:", "Q: 2 + 3 = ?\nA:"]})
    for paged in (False, True):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_completion_length=8,
                          num_generations=4, per_device_train_batch_size=8, report_to="none",
                          use_transformers_continuous_batching=paged)
        trainer = GRPOTrainer(model=folder, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=dataset)
        assert trainer.generation_config.to_dict() == trl_rollout.trl_generation_config("test", 8).to_dict()
        if paged:  # the paged path's pool: half the free memory (trl_rollout.rollout_paged)
            assert trainer.continuous_batching_config.max_memory_percent == 0.5
