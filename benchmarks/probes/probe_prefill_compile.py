"""How fast are the prefill's compiled layers, under which inductor settings? (GPU; issue 11)

The default path compiles the decoder layers for the prefill forwards with symbolic batch and length
(``hf_cascade.compiled_layers.compiled_forward``). This probe compiles them afresh under each inductor variant, then
profiles a warm one-token call of the shared workload (the prefill, the same call as ``prefill_s`` in
``bench_generate.py``) and reports, per variant: the call's wall time (median of 3), the GPU time of the
inductor-generated kernels (``triton_*``) and of the slowest few, and the whole GPU time. ``static`` compiles with
static shapes (one graph per shape: the floor the symbolic graph is compared with, not a path hf_cascade takes).
With ``--dump``, the source of the slowest generated kernel of the first variant is printed.

    python benchmarks/probes/probe_prefill_compile.py --layers 4 --variants default assume_32bit_indexing static
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args, wall_time  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.compiled_layers import compiled_prefills, decoder_layers  # noqa: E402
from hf_cascade.compiled_layers import layer_calls  # noqa: E402

VARIANTS = {
    "default": {},
    "assume_32bit_indexing": {"assume_32bit_indexing": True},
    "prefer_nd_tiling": {"triton.prefer_nd_tiling": True},
    "32bit_nd_tiling": {"assume_32bit_indexing": True, "triton.prefer_nd_tiling": True},
    "static": {},
}


def _fresh_layers(model, variant: str) -> None:
    """Forget the compiled prefill layers (dynamo's caches too), so that the next prefill compiles them anew."""
    torch._dynamo.reset()
    state = layer_calls(model)
    state.calls = None
    state.dynamic_calls = None
    if variant == "static":
        state.dynamic_calls = [torch.compile(layer._call_impl, dynamic=False) for layer in decoder_layers(model)]


def _kernel_times(prof) -> dict[str, float]:
    """GPU milliseconds per kernel name."""
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0)
        if us:
            times[evt.key] = times.get(evt.key, 0.0) + us / 1e3
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    add_shared_workload_args(parser, layers=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--dump", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    writer = ResultWriter("probe_prefill_compile.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    gen = dict(do_sample=False, pad_token_id=0, custom_generate=hf_cascade.generate, max_new_tokens=1)
    call = lambda: model.generate(ids, attention_mask=mask, **gen)  # noqa: E731
    for variant in args.variants:
        settings = {k: v for k, v in VARIANTS[variant].items() if _has_setting(k)}
        record = {"bench": "probe_prefill_compile", "variant": variant, "settings": settings, "layers": args.layers,
                  "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix,
                  "missing_settings": sorted(set(VARIANTS[variant]) - set(settings))}
        _fresh_layers(model, variant)
        with torch._inductor.config.patch(settings):
            before = compiled_prefills(model)
            record["first_call_s"], _ = wall_time(call)
            record["compiled_prefills"] = compiled_prefills(model) - before
            record["one_token_call_s"] = statistics.median(wall_time(call)[0] for _ in range(3))
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        times = _kernel_times(prof)
        generated = {k: v for k, v in times.items() if k.startswith("triton_")}
        record["gpu_ms"] = round(sum(times.values()), 3)
        record["generated_ms"] = round(sum(generated.values()), 3)
        record["slowest_generated"] = sorted(([k[:90], round(v, 3)] for k, v in generated.items()),
                                             key=lambda kv: -kv[1])[:6]
        writer.write(record)
        if args.dump and variant == args.variants[0] and generated:
            _dump(max(generated, key=generated.get))


def _has_setting(name: str) -> bool:
    obj = torch._inductor.config
    *parents, leaf = name.split(".")
    for part in parents:
        obj = getattr(obj, part, None)
    return obj is not None and hasattr(obj, leaf)


def _dump(kernel: str) -> None:
    """Print the generated source of ``kernel`` from inductor's cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for path in glob.glob(os.path.join(cache_dir(), "**", "*.py"), recursive=True):
        with open(path) as f:
            text = f.read()
        start = text.find(f"def {kernel}(")
        if start >= 0:
            head = text.rfind("@triton", 0, start)
            print(f"# {path}\n{text[max(head, 0):start + 4000]}")
            return
    print(f"# source of {kernel} not found under {cache_dir()}")


if __name__ == "__main__":
    main()
