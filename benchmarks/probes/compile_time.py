"""Where the first compiled generate() call's time goes: torch.compile's phases, hf_cascade vs transformers' own
static-cache step, on one model.

    python benchmarks/probes/compile_time.py                               # CPU: tiny 32-layer Llama, aot_eager backend
    python benchmarks/probes/compile_time.py --device cuda --backend inductor --layers 32 --tiny   # GPU, tiny layers

Each peer runs in a fresh process (nothing compiled or cached in memory by the other); on-disk Inductor caches
are what the machine has. Records ``compile_time`` lines in ``results/compile_time.jsonl``: the call's seconds,
the seconds of each torch.compile phase (``common.compile_seconds``), and the decode graph's inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import preamble  # noqa: E402, F401  (the repository root and benchmarks/ on sys.path)

from common import ResultWriter  # noqa: E402

PEERS = ("cascade_generate", "sdpa_static")


def measure(peer: str, layers: int, device: str, backend: str, mark_layers: bool = False) -> dict:
    """One peer's first compiled call (run in this process): seconds, phase seconds, graph inputs. ``mark_layers``:
    the decoder layer's forward marked ``torch.compiler.nested_compile_region`` (an experiment: this patches the
    model class in this process only)."""
    import torch
    from transformers import CompileConfig
    from transformers.models.llama import modeling_llama

    if mark_layers:
        layer = modeling_llama.LlamaDecoderLayer
        layer.forward = torch.compiler.nested_compile_region(layer.forward)

    import hf_cascade
    from common import timed_with_compile_breakdown
    from hf_cascade.tiny import tiny_model

    model = tiny_model("llama", attn_implementation="cascade" if peer == "cascade_generate" else "sdpa",
                       device=device, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 128, (24,), generator=g)
    rows = [torch.cat([system, torch.randint(3, 128, (5 + 3 * i,), generator=g)]) for i in range(4)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    ids, mask = ids.to(device), mask.to(device)
    inputs_seen = []

    def counting_backend(gm, example_inputs):
        inputs_seen.append(sum(node.op == "placeholder" for node in gm.graph.nodes))
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    config = CompileConfig(backend=counting_backend, mode=None if device == "cpu" else "reduce-overhead",
                           fullgraph=True)
    config._compile_all_devices = True
    gen = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False, compile_config=config)
    if peer == "cascade_generate":
        gen.update(custom_generate=hf_cascade.generate, cascade_options=dict(min_shared_tokens=2, fixed_buffers=True,
                                                                      decode_step="compile"))
    else:
        gen.update(cache_implementation="static")
    seconds, phases, _ = timed_with_compile_breakdown(lambda: model.generate(ids, attention_mask=mask, **gen))
    return {"first_call_s": round(seconds, 3), "compile_s": phases, "graph_inputs": inputs_seen}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (inductor, aot_eager, ...)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--mark-layers", action="store_true",
                        help="experiment: hierarchical compilation (nested_compile_region on the decoder layer)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.layers, args.device, args.backend, args.mark_layers)))
        return
    writer = ResultWriter("compile_time.jsonl", args.output)
    for peer in args.peers:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", peer, "--layers", str(args.layers),
             "--device", args.device, "--backend", args.backend, *(["--mark-layers"] if args.mark_layers else [])],
            capture_output=True, text=True, check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        record = {"bench": "compile_time", "peer": peer, "layers": args.layers, "device": args.device,
                  "backend": args.backend, "model": "tiny llama", "nested_compile_region": args.mark_layers, **result}
        writer.write(record)
        print(record, flush=True)


if __name__ == "__main__":
    main()
