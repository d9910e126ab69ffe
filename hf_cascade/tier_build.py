"""The compiled tier built in the background: no generate() call waits for the compiler.

:mod:`hf_cascade.tiers` starts a model's calls on tiers that need no compilation. After such a call (greedy or
sampling on CUDA, default options) :func:`build_in_background` starts one thread per model that runs a *build
call*: the same rows again through ``hf_cascade.generate`` with ``cascade_options={"compile": "now"}`` (same
options, same batch bucket and buffer capacity, so the same graphs), greedy, stopped after :data:`BUILD_STEPS`
decode steps, its output dropped. It compiles the decoder layers for the prefill and the decode step, builds the
Triton kernels and records the compiled step, while the calling thread goes on serving calls on the tier it has.
When the build call ends, :func:`hf_cascade.tiers.record_call` marks the compiled tier ready and the next call
runs it.

What the build shares with the serving thread, and how it stays out of its way:

* the model: the compiled layer calls are installed per thread
  (:class:`~hf_cascade.decode.compiled_layers._ThreadCompiledCall`), so other threads run the model's own layers;
* the GPU: the build runs on its own CUDA stream; it starts only where free device memory is at least
  :data:`MIN_FREE_FRACTION` of the GPU and :data:`CACHE_MULTIPLE` times the call's KV (it allocates about what the
  call did); an error (out of memory included) ends the build, a warning says why, and the calls stay on the
  tiers they have;
* the interpreter: compiling is Python work that holds the GIL in 5 ms turns by default, and each of the serving
  thread's ~3,000 launches per call would wait for a turn; while the build runs, the switch interval is
  :data:`SWITCH_INTERVAL_S` (restored after);
* the process's end: the thread is a daemon; an interpreter that exits while it compiles does not wait for it.

Where this does not start: ``compile="now"`` / ``"never"``, beam search, CPU, a user's own cache, a call without
decode steps, or :data:`ENABLED` set False (the benchmarks compare the policies).
"""

from __future__ import annotations

import copy
import sys
import threading
import time

import torch
from transformers.utils import logging

from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)

__all__ = ["BUILD_STEPS", "ENABLED", "build_in_background", "wait_for_build"]

ENABLED = True
# Decode steps of the build call: the first new key runs once (compiling the layers), the next step records the
# compiled step, one more replays it.
BUILD_STEPS = 4
SWITCH_INTERVAL_S = 0.0002
MIN_FREE_FRACTION = 0.15
CACHE_MULTIPLE = 3


def build_in_background(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict,
                        cascade_options: dict | None, batch_buckets: bool, cache_nbytes: int) -> bool:
    """Start building ``model``'s compiled tier on a background thread, from the rows of the call that just ran.

    Args:
        model: the model of the call (on CUDA).
        input_ids: ``[B, L]`` int64, the rows as generate() handed them to ``hf_cascade.generate``.
        generation_config: the call's generation config (copied; the build is greedy).
        model_kwargs: the call's model kwargs as handed in (tensors copied; its cache and streamer left out).
        cascade_options: the user's ``cascade_options`` (the build adds ``compile="now"`` and ``batch_buckets``).
        batch_buckets: whether the call added rows up to a batch bucket (the build does the same).
        cache_nbytes: bytes of the call's KV (the memory check).
    Returns:
        Whether a build started (False: one is running or done or failed for this model, or it would not fit).
    """
    from hf_cascade.tiers import building_state

    if not ENABLED or input_ids.device.type != "cuda":
        return False
    state = building_state(model)
    with state.lock:
        if state.ready["compiled"] or state.building is not None or state.build_error is not None:
            return False
        device = input_ids.device
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free < max(MIN_FREE_FRACTION * total, CACHE_MULTIPLE * cache_nbytes):
            return False
        config = copy.deepcopy(generation_config)
        for name, value in (("do_sample", False), ("num_beams", 1), ("return_dict_in_generate", False),
                            ("output_scores", False), ("output_logits", False)):
            setattr(config, name, value)
        kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in model_kwargs.items()
                  if k not in (CACHE_KWARG, "streamer")}
        options = {**(cascade_options or {}), "compile": "now", "batch_buckets": batch_buckets}
        ids = input_ids.clone()
        inputs_ready = torch.cuda.Event()
        inputs_ready.record(torch.cuda.current_stream(device))
        thread = threading.Thread(target=_build, args=(model, state, ids, config, kwargs, options, inputs_ready),
                                  name="hf_cascade-compiled-tier", daemon=True)
        state.building = thread
        state.build_started = time.perf_counter()
    thread.start()
    return True


def wait_for_build(model, timeout: float | None = None) -> bool:
    """Wait until ``model``'s background build (if one runs) ends; True when the compiled tier is ready."""
    from hf_cascade.tiers import building_state

    state = building_state(model)
    with state.lock:
        thread = state.building
    if thread is not None:
        thread.join(timeout)
    with state.lock:
        return state.ready["compiled"]


def _build(model, state, input_ids, generation_config, model_kwargs, options, inputs_ready) -> None:
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    from hf_cascade.generation import generate

    stop_at = input_ids.shape[1] + BUILD_STEPS

    class _StopAfterBuildSteps(StoppingCriteria):
        def __call__(self, ids, scores, **kwargs):
            return torch.full((ids.shape[0],), ids.shape[1] >= stop_at, dtype=torch.bool, device=ids.device)

    stopping = StoppingCriteriaList([MaxLengthCriteria(generation_config.max_length), _StopAfterBuildSteps()])
    from hf_cascade.tiers import IN_BUILD

    IN_BUILD.active = True
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    error = None
    try:
        stream = torch.cuda.Stream(device=input_ids.device)
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_event(inputs_ready)
            generate(model, input_ids, LogitsProcessorList(), stopping, generation_config,
                     cascade_options=options, **model_kwargs)
        stream.synchronize()
    except Exception as err:  # noqa: BLE001 (a compiler error or out of memory: the calls keep the tiers they have)
        error = f"{type(err).__name__}: {str(err)[:300]}"
        logger.warning(f"hf_cascade: building the compiled tier in the background failed ({error}); generate() "
                       "calls stay on the tiers that need no compilation.")
    finally:
        if sys.getswitchinterval() == min(interval, SWITCH_INTERVAL_S):
            sys.setswitchinterval(interval)
        with state.lock:
            state.building = None
            state.build_error = error
            state.build_s = round(time.perf_counter() - state.build_started, 3)
