"""benchmarks/bench_stall.py --tiny: the stall benchmark's plumbing on CPU (tiny Llama, fp32): its three workloads,
the stream of layouts, the steady repeats and the sdpa peer run, and its records are written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_stall_smoke(tmp_path):
    output = tmp_path / "stall.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_CASCADE_RECORDS": str(tmp_path / "r")}
    env.pop("OUT", None)  # (the ResultWriter mirrors records into $OUT on the device machine)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_stall.py"), "--tiny", "--output",
                           str(output)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = {r["phase"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert set(records) == {"samples32", "tree64", "prompts16x8", "stream", "summary"}
    assert records["tree64"]["rows"] == 64 and records["prompts16x8"]["rows"] == 128
    stream = records["stream"]
    assert stream["stream_batches"] == 8 and stream["rated_batches"] == 8 and stream["sdpa"]
    assert all(call["over_steady"] > 0 for call in stream["calls"])
    summary = records["summary"]
    assert summary["git_sha"] and summary["torch"] and summary["stream_total_over_steady"] > 0
