"""benchmarks/bench_windows.py --smoke: the benchmark's plumbing on CPU (tiny Gemma 3, fp32), every peer and the
kernel point, records written; its greedy tokens equal sdpa's."""

from _bench_run import run_benchmark


def test_bench_windows_smoke(tmp_path):
    records = run_benchmark("bench_windows.py", "--smoke", tmp_path, timeout=300, TRITON_INTERPRET="1",
                            OMP_NUM_THREADS="1")
    by_bench = {}
    for r in records:
        by_bench.setdefault(r["bench"], []).append(r)
    assert by_bench["windows_check"][0]["check_ok"]
    peers = {r["peer"]: r for r in by_bench["windows_generate"]}
    assert set(peers) == {"sdpa", "hf_prefix_reuse", "cascade_default", "cascade_graphs", "cascade_compile_now"}
    for r in peers.values():
        assert r["status"] == "ok" and r["greedy_equal_sdpa"] and r["git_sha"], r
    assert peers["cascade_default"]["droppable_sliding_kv_gib"] > 0
    assert peers["cascade_default"]["bounded_paths"]
    kernels = by_bench["windows_kernels"][0]
    assert kernels["cut_nothing_max_abs_diff"] < 1e-5 and kernels["unbounded_us"] > 0
