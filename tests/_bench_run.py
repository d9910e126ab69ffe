"""Run a benchmark script in a CPU smoke mode the way a user would (a new process, records to a file) and read its
records back: shared by the benchmarks' smoke tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, smoke_flag: str, tmp_path: Path, *, timeout: float, **env: str) -> list[dict]:
    """``python benchmarks/<script> <smoke_flag> --output FILE`` with ``env`` added (the repo on ``PYTHONPATH``, the
    tier records in ``tmp_path``); asserts it exits 0 and returns the JSON-lines records it wrote."""
    output = tmp_path / f"{Path(script).stem}.jsonl"
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "HF_CASCADE_RECORDS": str(tmp_path / "records")}
    env.pop("OUT", None)  # (the ResultWriter mirrors records into $OUT on the device machine)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), smoke_flag, "--output", str(output)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in output.read_text().splitlines()]
