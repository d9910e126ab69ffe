"""The plotting code on small synthetic result files shaped like benchmarks/bench_*.py output."""

import json

import pytest

pytest.importorskip("matplotlib")

from hf_cascade.plots import generate_speedups, kernel_speedups, load_records, memory_series, plot_results  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, records, extra_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def kernel_records():
    out = [{"bench": "copy_bandwidth", "gbs": 2990.0, "gpu": "NVIDIA H100 80GB HBM3"}]
    for p in (1024, 16384):
        for b in (8, 64):
            out.append({"bench": "decode_step", "gpu": "NVIDIA H100 80GB HBM3", "heads": "32/8", "batch": b,
                        "prefix": p, "suffix": 256, "cascade_ms": 0.1, "sdpa_ms": 0.1 * b * p / 8192,
                        "speedup_vs_sdpa": b * p / 8192})
    out.append({"bench": "decode_step", "batch": 256, "prefix": 32768, "cascade_ms": 0.5,
                "sdpa_status": "skipped: replicated KV would not fit"})  # no speedup: skipped
    return out


def generate_records():
    out = [{"bench": "generate_check", "first_token_match": True}]
    for b in (32, 64):
        out.append({"bench": "generate", "peer": "cascade", "batch": b, "prefix": 4096, "suffix": 64,
                    "total_s": 3.0, "peak_gib": 20.0 + b / 8, "status": "ok"})
    out.append({"bench": "generate", "peer": "sdpa", "batch": 32, "prefix": 4096, "suffix": 64, "total_s": 12.0,
                "peak_gib": 44.6, "status": "ok"})
    out.append({"bench": "generate", "peer": "sdpa", "batch": 64, "prefix": 4096, "suffix": 64,
                "status": "out of memory"})
    out.append({"bench": "generate", "peer": "generate_batch", "batch": 32, "prefix": 4096})  # no numbers
    return out


def test_series_extraction():
    kernels = kernel_speedups(kernel_records())
    assert set(kernels) == {"P=1K", "P=16K"}
    assert sorted(kernels["P=16K"]) == [(8, 16.0), (64, 128.0)]
    gen = generate_speedups(generate_records())
    assert gen == {"P=4K": [(32, 4.0)]}  # B=64 has no sdpa time (out of memory)
    memory, oom = memory_series(generate_records())
    assert sorted(memory) == ["cascade", "sdpa"] and oom == {"sdpa": [64]}


def test_plot_writes_png(tmp_path):
    path = write_jsonl(tmp_path / "results.jsonl", kernel_records() + generate_records(), ["", "not json", "[1, 2]"])
    assert len(load_records([path])) == len(kernel_records()) + len(generate_records())
    png = plot_results(path, tmp_path / "plots" / "bench.png")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_robust_to_missing_fields(tmp_path):
    # Only a memory-less generate run with aliases for the field names; then only a kernel run.
    records = [{"peer": "cascade", "batch_size": 8, "prefix_len": 512, "time_s": 1.0},
               {"peer": "sdpa", "batch_size": 8, "prefix_len": 512, "time_s": 2.0}]
    png = plot_results(records, tmp_path / "gen.png", title="aliases")
    assert png.read_bytes().startswith(PNG_MAGIC)
    png = plot_results([write_jsonl(tmp_path / "k.jsonl", kernel_records())], tmp_path / "k.png")
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_nothing_to_plot_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", [{"bench": "copy_bandwidth", "gbs": 1.0}])
    with pytest.raises(ValueError, match="No plottable benchmark records"):
        plot_results(path, tmp_path / "x.png")
