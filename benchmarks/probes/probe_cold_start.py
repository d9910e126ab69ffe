"""Probe: where does a new process's first layout-stream batch spend the seconds a warm process does not? A
timeline without a profiler: imports, model build, then the first batch split into prefill (until the first
decode step), the first decode step (compiles the decoder layers), recording, and the rest; then the same batch
again (warm). Run it after a process that filled the disk caches (Triton, Inductor), so that what it measures is
what every new process pays.

    python benchmarks/probes/probe_cold_start.py                       # hf_cascade's default path
    python benchmarks/probes/probe_cold_start.py --peer sdpa           # the peer's own first-call cost
    python benchmarks/probes/probe_cold_start.py --time-keys           # time the compiler's source hashes first, apart

Records ``cold_start_probe`` in ``benchmarks/results/first_call.jsonl``.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402

_TORCH_S = time.perf_counter() - _STARTED

import transformers  # noqa: E402, F401

_TRANSFORMERS_S = time.perf_counter() - _STARTED - _TORCH_S

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

import hf_cascade  # noqa: E402

_HF_CASCADE_S = time.perf_counter() - _STARTED - _TORCH_S - _TRANSFORMERS_S

from bench_generate import LAYOUT_STREAM, build_model, make_tree_batch  # noqa: E402
from common import ResultWriter, TritonBuilds, timed_with_compile_breakdown, triton_cache_files  # noqa: E402

from hf_cascade.decode.captured_step import CapturedDecodeStep  # noqa: E402


class _Timeline:
    """Seconds spent inside a few methods, and when the first decode step began."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.first_step_at: float | None = None

    def wrap(self, cls, name: str, label: str):
        original = getattr(cls, name)
        timeline = self

        def timed(*args, **kwargs):
            if label == "decode_steps" and timeline.first_step_at is None:
                torch.cuda.synchronize()
                timeline.first_step_at = time.perf_counter()
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                timeline.spent[label] = timeline.spent.get(label, 0.0) + time.perf_counter() - t

        setattr(cls, name, timed)


def _time_compiler_keys() -> dict:
    """The source hashes torch.compile and Triton compute once per process (their cache keys)."""
    out = {}
    t = time.perf_counter()
    import torch._inductor.codecache as codecache

    out["import_inductor_codecache_s"] = time.perf_counter() - t
    t = time.perf_counter()
    codecache.torch_key()
    out["torch_key_s"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        from triton.compiler.compiler import triton_key
    except ImportError:
        from triton.runtime.cache import triton_key
    triton_key()
    out["triton_key_s"] = time.perf_counter() - t
    return {k: round(v, 3) for k, v in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peer", default="cascade_generate", choices=["cascade_generate", "sdpa"])
    parser.add_argument("--time-keys", action="store_true")
    parser.add_argument("--no-cudnn-sdp", action="store_true",
                        help="torch.backends.cuda.enable_cudnn_sdp(False): is the peer's first call cuDNN's plans?")
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("first_call.jsonl", args.output)
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    files_at_start, builds = triton_cache_files(), TritonBuilds()
    t = time.perf_counter()
    model = build_model(args.layers)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    keys = _time_compiler_keys() if args.time_keys else None
    timeline = _Timeline()
    if args.peer == "cascade_generate":
        model.set_attn_implementation("cascade")
        timeline.wrap(CapturedDecodeStep, "__call__", "decode_steps")
        timeline.wrap(CapturedDecodeStep, "_run_once", "first_step_run")
        timeline.wrap(CapturedDecodeStep, "_record", "record")
    else:
        model.set_attn_implementation("sdpa")
    levels, own = LAYOUT_STREAM[0]
    ids, mask = make_tree_batch(levels, own, 32, model.config.vocab_size, 0)
    extra = {"custom_generate": hf_cascade.generate} if args.peer == "cascade_generate" else {}

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=0, **extra)

    calls = []
    for _ in range(2):  # cold, then warm
        timeline.spent, timeline.first_step_at = {}, None
        before = builds.snapshot()
        started = time.perf_counter()
        seconds, compile_s, _ = timed_with_compile_breakdown(call)
        after = builds.snapshot()
        calls.append({
            "seconds": round(seconds, 3),
            "until_first_decode_step_s": None if timeline.first_step_at is None
            else round(timeline.first_step_at - started, 3),
            **{f"{k}_s": round(v, 3) for k, v in timeline.spent.items()},
            "compile_s": compile_s,
            "triton": {k: None if after[k] is None else round(after[k] - before[k], 3) for k in after},
        })
    from torch._dynamo.utils import compile_times

    record = {
        "bench": "cold_start_probe", "peer": args.peer, "label": args.label, "cudnn_sdp": not args.no_cudnn_sdp,
        "levels": [list(l) for l in levels],
        "import_s": {"torch": round(_TORCH_S, 3), "transformers": round(_TRANSFORMERS_S, 3),
                     "hf_cascade": round(_HF_CASCADE_S, 3)},
        "model_build_s": round(build_s, 2), "compiler_keys": keys, "calls": calls,
        "dynamo_compile_times": compile_times(repr="str", aggregate=True) if args.peer != "sdpa" else None,
        "triton_cache_files_at_start": files_at_start,
        "pycache_prefix": os.environ.get("PYTHONPYCACHEPREFIX"),
        "process_s": round(time.perf_counter() - _STARTED, 2),
    }
    writer.write(record)
    print({k: v for k, v in record.items() if k != "dynamo_compile_times"}, flush=True)
    print(record["dynamo_compile_times"])


if __name__ == "__main__":
    main()
