"""benchmarks/bench_stall.py --tiny: the stall benchmark's plumbing on CPU (tiny Llama, fp32): its three workloads,
the stream of layouts, the steady repeats and the sdpa peer run, and its records are written."""

from _bench_run import run_benchmark


def test_bench_stall_smoke(tmp_path):
    records = {r["phase"]: r for r in run_benchmark("bench_stall.py", "--tiny", tmp_path, timeout=120,
                                                     OMP_NUM_THREADS="1")}
    assert set(records) == {"samples32", "tree64", "prompts16x8", "stream", "summary"}
    assert records["tree64"]["rows"] == 64 and records["prompts16x8"]["rows"] == 128
    stream = records["stream"]
    assert stream["stream_batches"] == 8 and stream["rated_batches"] == 8 and stream["sdpa"]
    assert all(call["over_steady"] > 0 for call in stream["calls"])
    summary = records["summary"]
    assert summary["git_sha"] and summary["torch"] and summary["stream_total_over_steady"] > 0
