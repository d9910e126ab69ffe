"""The lm-evaluation-harness model type "hf-cascade" == lm-eval's own "hf" on a local task, fp32 on CPU.

Offline: the task is a YAML over local JSON-lines files (:mod:`hf_cascade.eval_tasks`), the models a tiny random
model saved to a temporary folder and SmolLM2-135M-Instruct (the session's). Skipped without lm-eval
(``pip install lm-eval``).
"""

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import hf_cascade.eval_harness  # noqa: E402  (registers "hf-cascade")
from hf_cascade.eval_harness import CascadeLM  # noqa: E402
from hf_cascade.eval_tasks import write_arithmetic_task  # noqa: E402
from hf_cascade.tiny import tiny_model, tiny_tokenizer  # noqa: E402

TOL = 1e-5  # nats, per request: the tiny model's rounding differences are ~4e-6


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """``(TaskManager, multiple-choice task, generation task)``: 10 questions x 4 choices, 3 shots shared by all."""
    folder = tmp_path_factory.mktemp("tasks")
    mc = write_arithmetic_task(str(folder / "mc"), questions=10, shots=3, name="arith_mc")
    gen = write_arithmetic_task(str(folder / "gen"), questions=6, shots=3, name="arith_gen", generate=True)
    # include_defaults=False: lm-eval's thousands of built-in task files are not indexed (~9 s)
    return TaskManager(include_path=[str(folder / "mc"), str(folder / "gen")], include_defaults=False), mc, gen


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", attn_implementation="sdpa").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def evaluate(model, task, task_manager, **kwargs):
    """``(metric value, [per-request (loglikelihood, is_greedy) or text])`` of one task."""
    out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=task_manager, log_samples=True,
                                  **kwargs)
    (value,) = [v for k, v in out["results"][task].items() if k in ("acc,none", "exact_match,none")]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return value, [r[0] for s in samples for r in s["resps"]]


def assert_same(ours, theirs):
    assert ours[0] == theirs[0]  # the accuracy
    assert len(ours[1]) == len(theirs[1])
    for a, b in zip(ours[1], theirs[1]):
        if isinstance(a, str):
            assert a == b
        else:
            assert abs(a[0] - b[0]) < TOL and a[1] == b[1], (a, b)


def test_registered():
    assert lm_eval.api.registry.get_model("hf-cascade") is CascadeLM


def test_tiny_model_multiple_choice_same_as_hf(tasks, tiny_path):
    """By name, from a saved checkpoint (as ``--model hf-cascade --model_args pretrained=PATH``)."""
    task_manager, mc, _ = tasks
    args = f"pretrained={tiny_path},dtype=float32,device=cpu"
    ours = evaluate("hf-cascade", mc, task_manager, model_args=args + ",max_batch_tokens=64")  # several forwards
    assert_same(ours, evaluate("hf", mc, task_manager, model_args=args, batch_size=8))


def test_tiny_model_generate_until_and_rolling_same_as_hf(tasks, tiny_path):
    """generate_until through hf_cascade.generate (a batch of 6 prompts sharing the shots), and
    loglikelihood_rolling (lm-eval's windows scored by hf_cascade.score)."""
    task_manager, _, gen = tasks
    args = f"pretrained={tiny_path},dtype=float32,device=cpu"
    assert_same(evaluate("hf-cascade", gen, task_manager, model_args=args, batch_size=6),
                evaluate("hf", gen, task_manager, model_args=args, batch_size=6))
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "1 2 3 4 5 6 7 8 9 10", "x"]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    ours = CascadeLM(tiny_path, dtype="float32", device="cpu", max_length=48)  # windows of 48 tokens
    theirs = HFLM(tiny_path, dtype="float32", device="cpu", max_length=48)
    for a, b in zip(ours.loglikelihood_rolling(requests), theirs.loglikelihood_rolling(requests)):
        assert abs(a - b) < TOL + 1e-7 * abs(b)  # "hf" sums a window in fp32: 6e-5 is one ulp at -800 nats


def test_real_model_multiple_choice_same_as_hf(tasks, smollm2):
    """SmolLM2-135M-Instruct passed as a loaded model: the same accuracy as "hf" (sdpa); per-request log-likelihoods
    within 1e-4 (5e-5 seen: over 30 layers sdpa's own fp32 rounding is 2e-5 from float64, see test_scoring)."""
    global TOL
    task_manager, mc, _ = tasks
    model, tokenizer = smollm2
    model.set_attn_implementation("sdpa")
    try:
        theirs = evaluate(HFLM(model, tokenizer=tokenizer, batch_size=8), mc, task_manager)
    finally:
        model.set_attn_implementation("cascade")
    ours = evaluate(CascadeLM(model, tokenizer=tokenizer), mc, task_manager)
    TOL, saved = 1e-4, TOL
    try:
        assert_same(ours, theirs)
    finally:
        TOL = saved
    assert ours[0] >= 0.25  # better than chance on sums of small numbers


def test_attn_implementation_other_than_cascade_refused(tiny_path):
    with pytest.raises(ValueError, match="runs attn_implementation='cascade'; got attn_implementation='sdpa'"):
        CascadeLM(tiny_path, device="cpu", attn_implementation="sdpa")


def test_example_runs_on_the_tiny_model(capsys):
    """examples/score_multiple_choice.py end to end (tiny model, 8 questions): both parts, the same accuracy."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "score_multiple_choice.py"
    spec = importlib.util.spec_from_file_location("score_multiple_choice", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--model", "tiny", "--questions", "8", "--shots", "2"]) == 0
    out = capsys.readouterr().out
    assert "hf_cascade.score: 32 pairs" in out and "same accuracy: yes" in out
