"""benchmarks/bench_peers_gpu.py --tiny: the one device call of issue 51 on CPU (tiny fp32 models, every workload and
peer, records written with versions and git SHA); greedy tokens of every peer equal sdpa's."""

from _bench_run import run_benchmark


def test_bench_peers_gpu_tiny(tmp_path):
    records = run_benchmark("bench_peers_gpu.py", "--tiny", tmp_path, timeout=300, TRITON_INTERPRET="1")
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
