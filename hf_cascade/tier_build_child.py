"""The child process of a background build (:func:`hf_cascade.tier_build.start_build`): build the model cut to a
few layers from the pickled spec, run the build call on the call's rows (where the spec says ``rows``; then print
``ROWS_DONE``), then on each batch of the spec's grid slice (its ``grid`` batches, else its ``grid_slice`` of
:func:`~hf_cascade.build_grid.variant_grid`) while its time budget lasts (``GRID_DONE`` / ``GRID_FAILED`` per batch,
``GRID_END <batches> <seconds>``): this fills the compile caches on disk.

    python -m hf_cascade.tier_build_child SPEC.pt PARENT_PID
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

from hf_cascade.build_grid import variant_grid
from hf_cascade.generation import generate

# Decode steps of the build call: the first compiles the layers for the decode step, the next runs them again (a
# build records no CUDA graph: hf_cascade.decode.captured_step).
BUILD_STEPS = 2


def main(path: str, parent_pid: int = 0) -> int:
    _leave_with_parent(parent_pid)
    spec = torch.load(path, weights_only=False)
    torch.manual_seed(0)
    device = torch.device(spec["device"])
    with torch.device(device):
        model = spec["model_class"]._from_config(spec["config"], dtype=spec["dtype"])
    model.eval()
    model.set_attn_implementation("cascade")
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in spec["model_kwargs"].items()}
    ids, config = spec["input_ids"].to(device), spec["generation_config"]
    if spec.get("rows", True):
        _build_call(model, ids, config, kwargs, spec["options"])
        _synchronize(device)
        print("ROWS_DONE", flush=True)
    _run_grid(model, spec, config.max_length - ids.shape[1], device)
    return 0


def _run_grid(model, spec: dict, new_tokens: int, device: torch.device) -> None:
    """The build call on each grid batch, once per path of the spec's ``grid_options`` (greedy, the call's other
    options and new tokens, no batch bucket), until the spec's time budget is spent; a batch that fails is reported
    and the next one runs."""
    started = time.perf_counter()
    base = {k: v for k, v in spec["options"].items() if k not in ("compile", "decode_step")}
    kwargs = {k: v for k, v in spec["model_kwargs"].items() if not isinstance(v, torch.Tensor)}  # (use_cache, ...)
    index, count = spec.get("grid_slice", (0, 0))
    batches = spec.get("grid")
    if batches is None:
        batches = variant_grid(model, spec["input_ids"], spec["generation_config"]) if count else []
    batches = batches[index::count] if count else batches
    runs = [(ids, mask, {**base, **path, "batch_buckets": False}) for ids, mask in batches
            for path in spec.get("grid_options", ({"compile": "now"},))]
    for ids, mask, options in runs:
        if time.perf_counter() - started > spec.get("grid_budget_s", 0.0):
            break
        config = copy.deepcopy(spec["generation_config"])
        config.max_length = ids.shape[1] + new_tokens
        try:
            _build_call(model, ids.to(device), config, {**kwargs, "attention_mask": mask.to(device)}, options)
            _synchronize(device)
            print("GRID_DONE", flush=True)
        except Exception as err:  # noqa: BLE001 (one batch's failure must not stop the others)
            print(f"GRID_FAILED {type(err).__name__}: {str(err)[:200]!r}", flush=True)
    print(f"GRID_END {len(runs)} {time.perf_counter() - started:.3f}", flush=True)


def _build_call(model, input_ids, generation_config, model_kwargs, options) -> None:
    """The build call: ``hf_cascade.generate`` of the rows, greedy, stopped after :data:`BUILD_STEPS` steps."""
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    stop_at = input_ids.shape[1] + BUILD_STEPS

    class _StopAfterBuildSteps(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            return torch.full((ids.shape[0],), ids.shape[1] >= stop_at, dtype=torch.bool, device=ids.device)

    stopping = StoppingCriteriaList([MaxLengthCriteria(generation_config.max_length), _StopAfterBuildSteps()])
    with torch.no_grad():
        generate(model, input_ids, LogitsProcessorList(), stopping, generation_config, cascade_options=options,
                 **model_kwargs)


def _leave_with_parent(parent_pid: int) -> None:
    """In the child: the lowest CPU priority (nice 19: where a core runs the caller's process and a child, the child
    gets ~1.5% of it; ~10% at nice 10, when the stream calls that ran beside the grid's children took up to 2.1x their
    steady time against <= 1.14x after it, ``benchmarks/results/stall.jsonl``), and end when the process that
    started it ends (Linux: the kernel sends SIGTERM; a parent already gone ends it now), so an interpreter that
    exits mid-build leaves no child behind."""
    import signal

    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid and os.getppid() != parent_pid:
        raise SystemExit(0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
