"""Probe: would compiling each decoder layer on its own (regional compilation) make the compiled decode step cheap
to get? The recorded decode step (``decode_step="graphs"``) against the same step with
every decoder layer ``torch.compile``'d (inductor, no CUDA graphs of its own) inside the recording.

The layers are compiled only while hf_cascade runs or records a decode step (the model's own calls never see it);
this is a measurement, not a code path of hf_cascade (``decode_step="layers"``, the default since 1ee2477, keeps
the cache behind one op and the layer index symbolic instead: hf_cascade/compiled_layers.py). Regional
compilation pays off where the compiled code of one layer serves every layer; here transformers' attention passes ``self.layer_idx`` (a Python int) to the cache, so
dynamo specialises each layer (one compilation per layer: the record's ``unique_graphs``).

    python benchmarks/probes/probe_regional_compile.py           # Llama-3-8B shape, B=32 sharing 4,096, 64 new tokens
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from bench_generate import build_model, make_batch  # noqa: E402
from common import ResultWriter, add_shared_workload_args, timed_with_compile_breakdown, wall_time  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.decode.captured_step import CapturedDecodeStep, _model_graphs, recorded_steps  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_workload_args(parser)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    from torch._dynamo.utils import counters

    writer = ResultWriter("regional_compile.jsonl", args.output)
    model = build_model(args.layers)
    ids, mask = make_batch(args.batch, args.prefix, args.suffix, model.config.vocab_size)
    layers = model.model.layers

    def generate(new):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, custom_generate=hf_cascade.generate,
                              cascade_options=dict(decode_step="graphs"))

    def measure(name):
        first, compile_s, out = timed_with_compile_breakdown(lambda: generate(args.new_tokens))
        full = sorted(wall_time(lambda: generate(args.new_tokens))[0] for _ in range(3))[1]
        short = sorted(wall_time(lambda: generate(2))[0] for _ in range(3))[1]
        record = {
            "bench": "regional_compile_probe", "step": name, "layers": args.layers, "batch": args.batch,
            "prefix": args.prefix, "suffix": args.suffix, "new_tokens": args.new_tokens,
            "first_call_s": round(first, 3), "first_call_compile_s": compile_s,
            "call_s": round(full, 4), "decode_ms_per_step": round((full - short) / (args.new_tokens - 2) * 1e3, 3),
            "unique_graphs": counters["stats"]["unique_graphs"], "recorded": recorded_steps(model),
        }
        writer.write(record)
        print(record, flush=True)
        return out[:, ids.shape[1]:]

    recorded = measure("graphs")
    torch._dynamo.config.recompile_limit = 4 * args.layers  # one compilation per layer (see the docstring)
    compiled = [torch.compile(layer._call_impl, dynamic=False) for layer in layers]

    @contextlib.contextmanager
    def compiled_layers():
        for layer, fn in zip(layers, compiled):
            layer._compiled_call_impl = fn
        try:
            yield
        finally:
            for layer in layers:
                layer._compiled_call_impl = None

    run_once, record = CapturedDecodeStep._run_once, CapturedDecodeStep._record

    def run_once_compiled(self, *a, **k):
        with compiled_layers():
            return run_once(self, *a, **k)

    def record_compiled(self, *a, **k):
        with compiled_layers():
            return record(self, *a, **k)

    CapturedDecodeStep._run_once, CapturedDecodeStep._record = run_once_compiled, record_compiled
    store = _model_graphs(model)
    store.graphs.clear()  # record the step again, with the compiled layers
    store.warm.clear()
    regional = measure("graphs_with_compiled_layers")
    writer.write({"bench": "regional_compile_probe_tokens", "greedy_tokens_equal_frac":
                  (recorded == regional).float().mean().item(), "note": "bf16 random weights: near-uniform logits"})


if __name__ == "__main__":
    main()
