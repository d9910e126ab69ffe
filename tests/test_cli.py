"""The CLI: `demo` and `info` run (in-process through main([...]) and once as `python -m hf_cascade`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_cascade.cli import demo_prompts, main

REPO = Path(__file__).resolve().parents[1]
SMALL_DEMO = ["demo", "--batch", "4", "--shots", "2", "--new-tokens", "4", "--device", "cpu"]


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
    assert "identical tokens: yes (4/4 rows" in out
    assert "KV cache" in out and "x smaller" in out
    assert "shared prefixes found: 2 levels" in out  # system prompt -> one of two few-shot blocks


def test_demo_json_numbers(capsys):
    assert main([*SMALL_DEMO, "--family", "qwen3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["identical"] and r["identical_rows"] == 4
    assert 0 < r["cascade_kv_bytes"] < r["reference_kv_bytes"]
    assert 0 < r["prefix_tokens_prefilled"] < r["shared_prompt_tokens"]


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
        assert main(["bench", "--output-dir", str(tmp_path / "out")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_runs_suite_scripts_and_plots(tmp_path, monkeypatch, capsys):
    """The orchestration, with a stand-in suite script (the real ones need a GPU): arguments passed through,
    results collected, PNG written."""
    pytest.importorskip("matplotlib")
    import hf_cascade.cli as cli

    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench_kernels.py").write_text(
        "import argparse, json\n"
        "p = argparse.ArgumentParser(); p.add_argument('--output'); p.add_argument('--quick', action='store_true')\n"
        "p.add_argument('--batches', type=int, nargs='+', default=[8])\n"
        "a = p.parse_args()\n"
        "with open(a.output, 'w') as f:\n"
        "    for b in a.batches:\n"
        "        f.write(json.dumps({'bench': 'decode_step', 'batch': b, 'prefix': 4096,\n"
        "                            'speedup_vs_sdpa': b / 8, 'quick': a.quick}) + '\\n')\n"
    )
    monkeypatch.setattr(cli, "find_benchmarks_dir", lambda: bench_dir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out_dir = tmp_path / "out"
    code = main(["bench", "--suite", "kernels", "--quick", "--output-dir", str(out_dir), "--", "--batches", "8", "64"])
    assert code == 0, capsys.readouterr().err
    results = list(out_dir.glob("kernels-*.jsonl"))
    assert len(results) == 1
    records = [json.loads(line) for line in results[0].read_text().splitlines()]
    assert [r["batch"] for r in records] == [8, 64] and all(r["quick"] for r in records)
    assert list(out_dir.glob("bench-*.png"))
    # The other suite's script is missing here: a clear message, not a traceback.
    assert main(["bench", "--suite", "generate", "--output-dir", str(out_dir)]) == 2
    assert "bench_generate.py" in capsys.readouterr().err
