"""TRL's GRPOTrainer rollouts through hf_cascade (docs/trl.md): one GRPO step on a tiny random model, CPU, fp32.

The route: ``hf_cascade.write_custom_generate(folder)`` on the checkpoint folder, and ``GRPOConfig(...,
trust_remote_code=True)``; TRL loads the folder with ``from_pretrained(folder, trust_remote_code=True)``, which binds
the folder's ``custom_generate/generate.py`` as ``model.generate``, the call TRL's rollouts make. The same step is run
on the same folder without ``trust_remote_code`` (TRL's default path): the completions must be the same.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

import datasets  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import hf_cascade  # noqa: E402
import hf_cascade.generation  # noqa: E402
from hf_cascade.cache import CascadeCache  # noqa: E402
from hf_cascade.model_zoo import tiny_model  # noqa: E402
from hf_cascade.tiny import tiny_tokenizer  # noqa: E402

SYSTEM = "You are a careful assistant. Answer with one number.\n"
QUESTIONS = ["Q: 2 + 2 = ?\nA:", "Q: 13 + 5 = ?\nA:"]
NUM_GENERATIONS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("grpo_checkpoint"))
    # vocab_size=260: the byte-level tiny tokenizer's ids. Saved with sdpa: the written generate.py switches the
    # attention to "cascade" itself.
    tiny_model("llama", attn_implementation="sdpa", seed=0, vocab_size=260).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    hf_cascade.write_custom_generate(folder)
    return folder


def _grpo_step(folder: str, output_dir: str, mixed_precision: bool = False, **config) -> dict:
    """One GRPO step (max_steps=1) on ``folder``; the completions the reward function saw, the hf_cascade.generate
    calls and the CascadeCache each built."""
    seen, calls, caches = [], [], []

    def reward(completions, **kwargs):  # TRL passes it by keyword
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    real = hf_cascade.generation.generate

    @functools.wraps(real)  # keeps the signature transformers reads for the hook's own kwargs
    def counting_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape if "input_ids" in kwargs else args[1].shape)
        return real(*args, cascade_caches=caches, **kwargs)

    dataset = datasets.Dataset.from_dict({"prompt": [SYSTEM + q for q in QUESTIONS]})
    args = GRPOConfig(
        output_dir=output_dir, max_steps=1, per_device_train_batch_size=len(QUESTIONS) * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS, max_completion_length=8, use_cpu=True, fp16=False,
        bf16=mixed_precision,  # GRPOConfig's default is bf16=True (autocast), even with use_cpu
        report_to="none", save_strategy="no", logging_strategy="no", seed=1, **config,
    )
    with pytest.MonkeyPatch.context() as patch:
        # checkpoint_generate (the written generate.py's body) imports hf_cascade.generation.generate per call
        patch.setattr(hf_cascade.generation, "generate", counting_generate)
        trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset)
        trainer.train()
    return {"completions": seen, "calls": calls, "caches": caches,
            "attn": trainer.model.config._attn_implementation}


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("grpo_out"))
    return {
        "default": _grpo_step(checkpoint, out),  # TRL's default: trust_remote_code=False, transformers' generate()
        "cascade": _grpo_step(checkpoint, out, trust_remote_code=True),  # the one argument of docs/trl.md
    }


def test_grpo_rollouts_run_through_hf_cascade(runs):
    cascade, default = runs["cascade"], runs["default"]
    # one rollout batch: every prompt's num_generations rows in one generate() call, through hf_cascade.generate
    assert [rows for rows, _ in cascade["calls"]] == [len(QUESTIONS) * NUM_GENERATIONS]
    assert cascade["attn"] == "cascade"
    # ... and it shared: the system prompt (all rows) and each prompt (its samples) stored once, not decoded plainly
    assert len(cascade["caches"]) == 1
    cache = cascade["caches"][0]
    assert isinstance(cache, CascadeCache)
    assert cache.num_levels == 2
    assert cache.prefilled_prefix_tokens >= len(SYSTEM) + min(map(len, QUESTIONS))
    # the default path never enters hf_cascade
    assert default["calls"] == [] and default["caches"] == [] and default["attn"] != "cascade"


def test_grpo_completions_equal_default_path(runs):
    cascade, default = runs["cascade"], runs["default"]
    assert len(default["completions"]) == 1
    assert len(default["completions"][0]) == len(QUESTIONS) * NUM_GENERATIONS
    assert cascade["completions"] == default["completions"]


@pytest.mark.xfail(strict=True, raises=(ValueError, RuntimeError), reason=(
    "docs/trl.md limit: under TRL's default bf16=True (torch.autocast) hf_cascade.generate refuses (its cache "
    "does not follow autocast's per-op dtypes); strict: this test starts passing when that is supported"))
def test_grpo_under_default_bf16_autocast(checkpoint, tmp_path):
    run = _grpo_step(checkpoint, str(tmp_path), mixed_precision=True, trust_remote_code=True)
    assert len(run["calls"]) == 1
