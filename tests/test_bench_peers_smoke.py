"""benchmarks/bench_peers_gpu.py --tiny: the one device call of issue 51 on CPU (tiny fp32 models, every workload and
peer, records written with versions and git SHA); greedy tokens of every peer equal sdpa's."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_peers_gpu_tiny(tmp_path):
    output = tmp_path / "peers.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "HF_CASCADE_RECORDS": str(tmp_path / "r")}
    env.pop("OUT", None)  # (the ResultWriter mirrors records into $OUT on the device machine)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers_gpu.py"), "--tiny", "--output",
                           str(output)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    checks = {r["bench"]: r for r in records if r["workload"] == "check"}
    assert checks["cb_tokens_check"]["passed"] and checks["trl_rollout_check"]["passed"]
    peers = {(r["workload"], r["peer"]): r for r in records if r["workload"] not in ("check", "setup")}
    for workload in ("shared", "nsamples", "tree", "grpo"):
        for peer in ("cascade_generate", "sdpa", "hf_prefix_reuse", "generate_batch_defaults", "generate_batch_best"):
            record = peers[workload, peer]
            assert record["status"] == "ok" and record["total_s"] > 0 and record["git_sha"], record
            if workload in ("shared", "tree") and peer != "sdpa":
                assert record["greedy_tokens_equal_sdpa_frac"] == 1.0, record
        assert peers[workload, "generate_batch_best"]["settings_requested"]["use_cuda_graph"] is True
    for peer in ("trl_default", "trl_paged", "trl_hf_cascade"):
        assert peers["trl", peer]["status"] == "ok", peers["trl", peer]
    assert peers["trl", "trl_hf_cascade"]["completions_equal_default"] is True
