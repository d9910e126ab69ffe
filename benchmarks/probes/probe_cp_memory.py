"""Where the context-parallel prefill's reserved-but-unallocated memory comes from (one launch).

    torchrun --nproc_per_node 4 benchmarks/probes/probe_cp_memory.py --out /tmp/cp_mem

Llama-3-8B-shaped random bf16 model. For each variant (``--variants``): a real prefill of each length, the
allocator's peaks (allocated, reserved, their ratio) and the prefill's seconds. The first variant's first length
runs with the allocator's history recorded on rank 0: ``<out>/cp_memory_segments.json`` lists, in order, every
segment the prefill made (size, the Python frames of the allocation that made it, how much of it was in use at the
end) and the free blocks left at the end. Variants:

* ``default``: ``context_parallel_inputs`` as a user calls it;
* ``chunk8192``: ``prefill_chunk_tokens=8192`` (rounds half as long);
* ``no_workspace``: the past state's buffers and the ring's exchange blocks made per layer (before the workspace);
* ``no_ring_exchange``: only the ring's exchange blocks made per layer (before they joined the workspace);
* ``release_every_layer``: the cached segments handed back at every layer's attention (before ``650e078``);
* ``no_release``: never handed back during the prefill;
* ``keep_transient``: handed back past the round's temporaries less the workspace (which is allocated, not cached).

Each record also counts the releases (``segment_releases``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import preamble  # noqa: F401  (the checkout's root and benchmarks/ on sys.path)
import torch
import torch.distributed as dist

import bench_context_parallel as cp
import hf_cascade
from hf_cascade.parallel import prefill_plan

GiB = 2**30
KEEP = ("hf_cascade", "transformers", "torch/nn")


def frames_of(entry) -> list[str]:
    out = []
    for f in entry.get("frames", []):
        name = f.get("filename", "")
        if any(k in name for k in KEEP) and "probe_cp_memory" not in name:
            out.append(f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f.get('line')} {f.get('name')}")
    return out[:6]


def segment_report(snapshot) -> dict:
    """The prefill's new segments in order (from the trace), and what each holds at the end."""
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    made = [dict(addr=e["addr"], mib=round(e["size"] / 2**20, 1), frames=frames_of(e))
            for e in trace if e["action"] == "segment_alloc"]
    freed = sum(1 for e in trace if e["action"] == "segment_free")
    by_addr = {s["address"]: s for s in snapshot["segments"]}
    for m in made:
        seg = by_addr.get(m["addr"])
        m["in_use_at_end_mib"] = None if seg is None else round(seg["allocated_size"] / 2**20, 1)
        m.pop("addr")
    free_blocks = sorted(((b["size"], seg["total_size"]) for seg in snapshot["segments"] for b in seg["blocks"]
                          if b["state"] == "inactive"), reverse=True)
    return dict(new_segments=made, segments_freed=freed,
                new_segments_gib=sum(m["mib"] for m in made) / 1024,
                free_blocks_mib=[[round(a / 2**20, 1), round(b / 2**20, 1)] for a, b in free_blocks[:40]],
                free_total_gib=sum(a for a, _ in free_blocks) / GiB)


_WORKSPACE = prefill_plan.PrefillState.workspace
_RELEASE = prefill_plan.PrefillState.release_cached


def per_call_workspace(self, numel, like, use="past"):  # no_workspace: a fresh buffer per call, as before
    return like.new_empty(numel)


def per_call_ring_exchange(self, numel, like, use="past"):  # no_ring_exchange: the ring's blocks per call
    return like.new_empty(numel) if use == "ring" else _WORKSPACE(self, numel, like, use)


def release_with(keep):
    def release(self, device):
        self.keep_cached = self.keep_cached if keep is None else keep
        return _RELEASE(self, device)
    return release


def release_past_transients(self, device):  # keep_transient: the threshold less the workspace (allocated, not cached)
    if not hasattr(self, "_keep_given"):
        self._keep_given = self.keep_cached
    kept = sum(w.numel() * w.element_size() for w in self._workspaces.values())
    self.keep_cached = max(0, self._keep_given - kept)
    return _RELEASE(self, device)


VARIANT_PATCHES = {
    "no_workspace": dict(workspace=per_call_workspace),
    "no_ring_exchange": dict(workspace=per_call_ring_exchange),
    "release_every_layer": dict(release_cached=release_with(0)),
    "no_release": dict(release_cached=release_with(1 << 62)),
    "keep_transient": dict(release_cached=release_past_transients),
}


def run(model, group, length, variant, trace, out_dir):
    ids = cp.prompt(length, model.config.vocab_size)
    kwargs = dict(prefill_chunk_tokens=8192) if variant == "chunk8192" else {}
    patches = VARIANT_PATCHES.get(variant, {})
    saved = {name: getattr(prefill_plan.PrefillState, name) for name in patches}
    for name, fn in patches.items():
        setattr(prefill_plan.PrefillState, name, fn)
    cp.reset_peak()
    before_alloc, before_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    if trace and dist.get_rank() == 0:
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    try:
        seconds, inputs = cp.timed(lambda: hf_cascade.context_parallel_inputs(model, ids, group=group, **kwargs),
                                   group)
    finally:
        for name, fn in saved.items():
            setattr(prefill_plan.PrefillState, name, fn)
    rec = dict(variant=variant, tokens=length, seconds=round(seconds, 3),
               peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
               before_allocated_gib=before_alloc / GiB, before_reserved_gib=before_res / GiB)
    rec["ratio"] = rec["peak_reserved_gib"] / rec["peak_allocated_gib"]
    rec["kv_gib"] = inputs[hf_cascade.CACHE_KWARG].nbytes / GiB
    rec["segment_releases"] = inputs[hf_cascade.CACHE_KWARG].prefill_releases
    if trace and dist.get_rank() == 0:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(os.path.join(out_dir, f"cp_memory_segments_{variant}.json"), "w") as f:
            json.dump(dict(record=rec, **segment_report(snap)), f, indent=1)
    worst = [None] * dist.get_world_size(group)
    dist.all_gather_object(worst, rec, group=group)
    if dist.get_rank() == 0:
        rec["ratio_max_rank"] = max(r["ratio"] for r in worst)
        rec["peak_reserved_max_rank_gib"] = max(r["peak_reserved_gib"] for r in worst)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(out_dir, "cp_memory.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    del inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="131072,524288")
    p.add_argument("--variants", default="default,no_ring_exchange,release_every_layer,no_release,keep_transient")
    p.add_argument("--trace", default="default", help="variants whose first length is traced")
    p.add_argument("--out", default="/tmp/cp_mem")
    args = p.parse_args()
    cp.start_process_group(False, datetime.timedelta(minutes=4))
    os.makedirs(args.out, exist_ok=True)
    group = dist.group.WORLD
    model = cp.build_model(cp.llama3_8b_config(32, False), torch.bfloat16, cp._device())
    start = time.time()
    with torch.no_grad():
        hf_cascade.context_parallel_inputs(model, cp.prompt(4096, model.config.vocab_size), group=group)  # warm-up
        for variant in args.variants.split(","):
            for i, length in enumerate(int(x) for x in args.lengths.split(",")):
                run(model, group, length, variant, i == 0 and variant in args.trace.split(","), args.out)
    if dist.get_rank() == 0:
        print(f"probe done in {time.time() - start:.0f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
