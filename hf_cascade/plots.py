"""PNG plots of benchmark results (JSON lines written by ``benchmarks/bench_*.py``): :func:`plot_results`.

Panels, each drawn only when the records hold its data:

* **decode-step speedup** vs batch, one line per prefix length (``bench_kernels.py``: ``speedup_vs_sdpa``, or
  ``sdpa_ms / cascade_ms``);
* **generate() speedup** vs batch, one line per prefix length (``bench_generate.py``: sdpa ``total_s`` over
  cascade ``total_s`` for the same workload);
* **peak memory** vs batch, one line per peer (and prefix length), out-of-memory points marked.

Records missing a field are skipped; field names have a few accepted aliases (``batch``/``batch_size``,
``prefix``/``prefix_len``...). Needs ``matplotlib`` (``pip install matplotlib``, or ``pip install -e ".[plot]"`` in
the checkout); draws with the Agg backend, no display needed.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

_BATCH = ("batch", "batch_size", "bs", "B")
_PREFIX = ("prefix", "prefix_len", "prefix_length", "prefix_tokens", "P")
_TOTAL_S = ("total_s", "time_s", "seconds")
_PEAK_GIB = ("peak_gib", "peak_memory_gib", "memory_gib")
_PEAK_BYTES = ("peak_bytes", "peak_memory_bytes", "memory_bytes")
_PEER = ("peer", "impl", "method", "attn_implementation")
# Fields that identify a generate() workload (rows with equal values are compared with each other).
_WORKLOAD = ("bench", "layers", "suffix", "new_tokens", "model", "dtype", "heads")


def load_records(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """All JSON objects of the given JSON-lines files; blank or malformed lines are skipped."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    return records


def _get(record: dict, names: tuple[str, ...]):
    for name in names:
        value = record.get(name)
        if value is not None:
            return value
    return None


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _ok(record: dict) -> bool:
    status = record.get("status")
    return status is None or status == "ok"


def _prefix_label(prefix) -> str:
    if prefix is None:
        return "prefix ?"
    prefix = int(prefix)
    return f"P={prefix // 1024}K" if prefix >= 1024 and prefix % 1024 == 0 else f"P={prefix}"


def kernel_speedups(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """``{series label: [(batch, speedup), ...]}`` from decode-step records (one line per prefix length; the
    head layout and suffix length join the label when the records hold several)."""
    points = []
    for r in records:
        if r.get("bench") not in (None, "decode_step", "kernels") or _get(r, _PEER) is not None:
            continue
        batch = _number(_get(r, _BATCH))
        speedup = _number(r.get("speedup_vs_sdpa"))
        if speedup is None:
            cascade, sdpa = _number(r.get("cascade_ms")), _number(r.get("sdpa_ms"))
            speedup = sdpa / cascade if cascade and sdpa else _number(r.get("speedup"))
        if batch is not None and speedup is not None:
            points.append((_get(r, _PREFIX), (r.get("heads"), r.get("suffix")), batch, speedup))
    several = len({key for _, key, _, _ in points}) > 1
    series = defaultdict(list)
    for prefix, (heads, suffix), batch, speedup in points:
        label = _prefix_label(prefix)
        if several:
            extra = ", ".join(x for x in (f"H={heads}" if heads else "", f"S={suffix}" if suffix else "") if x)
            label = f"{label} ({extra})" if extra else label
        series[label].append((batch, speedup))
    return dict(series)


def generate_speedups(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """``{series label: [(batch, sdpa total_s / cascade total_s), ...]}`` from end-to-end generate records
    (peer ``cascade``; ``cascade_compiled`` as its own series, labelled ", compiled")."""
    times = defaultdict(dict)
    for r in records:
        peer = _get(r, _PEER)
        if peer is None or r.get("bench") not in (None, "generate"):
            continue
        batch, total = _number(_get(r, _BATCH)), _number(_get(r, _TOTAL_S))
        if batch is None or total is None or total <= 0 or not _ok(r):
            continue
        workload = tuple(r.get(k) for k in _WORKLOAD) + (_get(r, _PREFIX), batch)
        times[workload][str(peer)] = total
    series = defaultdict(list)
    for workload, by_peer in times.items():
        for peer in ("cascade", "cascade_compiled"):
            if peer in by_peer and "sdpa" in by_peer:
                label = _prefix_label(workload[-2]) + (", compiled" if peer == "cascade_compiled" else "")
                series[label].append((workload[-1], by_peer["sdpa"] / by_peer[peer]))
    return dict(series)


def memory_series(records: list[dict]) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[float]]]:
    """``({label: [(batch, peak GiB)]}, {label: [batches that ran out of memory]})``."""
    series, oom = defaultdict(list), defaultdict(list)
    prefixes = {_get(r, _PREFIX) for r in records if _get(r, _PEER) is not None}
    for r in records:
        peer = _get(r, _PEER)
        batch = _number(_get(r, _BATCH))
        if peer is None or batch is None:
            continue
        label = str(peer) if len(prefixes) <= 1 else f"{peer}, {_prefix_label(_get(r, _PREFIX))}"
        status = str(r.get("status") or "")
        if "out of memory" in status:
            oom[label].append(batch)
            continue
        gib = _number(_get(r, _PEAK_GIB))
        if gib is None:
            nbytes = _number(_get(r, _PEAK_BYTES))
            gib = nbytes / 2**30 if nbytes is not None else None
        if gib is not None and _ok(r):
            series[label].append((batch, gib))
    return dict(series), dict(oom)


def plot_results(
    results: str | os.PathLike | Iterable[str | os.PathLike] | list[dict],
    output: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Write a PNG of benchmark results and return its path.

    Args:
        results: a JSON-lines path, several paths, or already-loaded records (dicts).
        output: the PNG path (parent folders are created).
        title: figure title (default: "hf_cascade benchmarks" and the GPU name found in the records).
    Raises:
        ValueError: when no record holds a plottable (batch, speedup or memory) point.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if isinstance(results, (str, os.PathLike)):
        records = load_records([results])
    else:
        results = list(results)
        records = results if all(isinstance(r, dict) for r in results) else load_records(results)

    panels = []
    kernels = kernel_speedups(records)
    if kernels:
        panels.append(("speedup", "Decode step: cascade vs SDPA", kernels, {}))
    generate = generate_speedups(records)
    if generate:
        panels.append(("speedup", "generate(): cascade vs sdpa", generate, {}))
    memory, oom = memory_series(records)
    if memory or oom:
        panels.append(("memory", "Peak GPU memory (generate)", memory, oom))
    if not panels:
        raise ValueError(
            f"No plottable benchmark records ({len(records)} read): expected JSON lines with a batch size and either "
            "`speedup_vs_sdpa` / `cascade_ms`+`sdpa_ms` (bench_kernels.py) or `peer` + `total_s` / `peak_gib` "
            "(bench_generate.py)."
        )

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (kind, panel_title, series, marks) in zip(axes[0], panels):
        for label in sorted(series, key=_sort_key):
            pts = sorted(series[label])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if kind == "speedup":
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
            ax.set_ylabel("speedup over sdpa")
            values = [p[1] for pts in series.values() for p in pts]
            if max(values) / max(min(values), 1e-9) >= 20:
                ax.set_yscale("log", base=2)
            else:
                ax.set_ylim(bottom=0)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        else:
            ax.set_ylabel("peak memory (GiB)")
            top = max((p[1] for pts in series.values() for p in pts), default=1.0)
            for label, batches in marks.items():
                ax.scatter(batches, [top * 1.05] * len(batches), marker="x", color="red", zorder=3)
                for b in batches:
                    ax.annotate(
                        f"{label}: out of memory", (b, top * 1.05), textcoords="offset points", xytext=(-6, -12),
                        ha="right", fontsize=7, color="red",
                    )
            ax.set_ylim(bottom=0, top=top * 1.15)
        batches = sorted({p[0] for pts in series.values() for p in pts} | {b for bs in marks.values() for b in bs})
        if batches and batches[-1] / max(batches[0], 1) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([f"{b:g}" for b in batches])
        ax.set_xlabel("batch (rows sharing the prefix)")
        ax.set_title(panel_title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    gpus = sorted({str(r["gpu"]) for r in records if r.get("gpu")})
    fig.suptitle(title or ("hf_cascade benchmarks" + (f" ({', '.join(gpus)})" if gpus else "")), fontsize=11)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def _sort_key(label: str):
    """Order 'P=1K' < 'P=4K' < 'P=16K' numerically; other labels alphabetically after."""
    head = label.split(" ")[0].split(",")[0]
    if head.startswith("P="):
        value = head[2:]
        try:
            return (0, float(value[:-1]) * 1024 if value.endswith("K") else float(value), label)
        except ValueError:
            pass
    return (1, 0.0, label)
