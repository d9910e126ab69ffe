"""Greedy search and sampling for a cascade cache, without a host-device synchronisation per step.

transformers' ``_sample`` ends every step with ``bool(unfinished_sequences.max() == 0)``: the host waits until the
GPU has finished the step before it prepares the next one, so the step's host work (inputs, mask, CUDA-graph input
copies, logits processors, stopping criteria) adds to its GPU time. With the decode step compiled into CUDA graphs
the GPU part of an 8B model's step is ~7.6 ms on an H100 and the host part ~5.5 ms: 14.4 ms per step with the wait,
8.75 ms without it (``benchmarks/probes/profile_decode.py``). transformers already has the cure, ``DeferredStopCheck``
(copy the stop flag to the host asynchronously, read it one step later, undo the one extra step), but turns it on
only for ``mps``. :func:`sample` is ``_sample``'s loop, step for step, with that deferred check on CUDA; elsewhere
(a CPU computes each op as it is called, nothing to overlap) it checks at once, as ``_sample`` does.

Same tokens, scores and logits as ``_sample``: the extra step only runs where ``_sample`` would already have
stopped (every row finished before ``max_new_tokens``), and is undone (its token, scores and logits dropped, its KV
column cropped from the cache). Logits processors and stopping criteria are called once more for it, as with
transformers' ``DeferredStopCheck``.
"""

from __future__ import annotations

import copy

import torch

from hf_cascade.compiled_layers import compiled_forward
from hf_cascade.step_context import step_context
from hf_cascade.transformers_compat import CACHE_KWARG


class _StopFlag:
    """Whether every row has finished, read by the host one step late (``defer``) or at once.

    ``update(unfinished)`` queues a copy of ``unfinished.max() == 0`` into a pinned host flag and returns the flag of
    the step before, whose copy the GPU finished while this step's work was being queued (two slots alternate)."""

    def __init__(self, device: torch.device, defer: bool):
        self.defer = defer
        cuda = device.type == "cuda"
        self.flags = [torch.zeros((), dtype=torch.bool, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)] if defer and cuda else None
        self.step = 0
        self.extra_steps = 0  # steps run after the one at which every row had finished (0 or 1)

    def update(self, unfinished: torch.Tensor) -> bool:
        if not self.defer:
            return bool(unfinished.max() == 0)
        slot = self.step % 2
        self.flags[slot].copy_(unfinished.max() == 0, non_blocking=True)
        if self.copied is not None:  # the copy runs on the current stream of the flag's device
            self.copied[slot].record(torch.cuda.current_stream(unfinished.device))
        self.step += 1
        if self.step == 1:
            return False
        previous = 1 - slot
        if self.copied is not None:
            self.copied[previous].synchronize()  # the step before: done on the GPU while this one was queued
        if bool(self.flags[previous]):
            self.extra_steps = 1
            return True
        return False


def sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    defer_stop_check: bool | None = None,
    decode_step: str = "compile",
    compile_prefill: bool = False,
    **model_kwargs,
):
    """transformers' ``_sample`` (greedy search or multinomial sampling) with the stop check deferred on CUDA.

    Args:
        model: the causal LM (``model`` as generate() passes it to ``custom_generate``).
        input_ids: ``[B, L]`` int64, the prepared rows.
        logits_processor, stopping_criteria, generation_config: as generate() prepared them.
        defer_stop_check: read the "every row finished" flag one step late (no wait for the GPU per step). None
            (default): on CUDA only; True: on any device (on a CPU it only adds the extra step; for tests); False:
            never.
        decode_step: how the decode steps run on a CUDA fixed-buffer :class:`~hf_cascade.cache.CascadeCache`:
            ``"compile"`` (transformers' compiled step where generate() would compile it), ``"layers"`` (the
            step recorded into a CUDA graph with the decoder layers compiled once for all layers:
            :mod:`hf_cascade.compiled_layers`), ``"graphs"`` (the eager step recorded, no compilation:
            :mod:`hf_cascade.decode.captured_step`) or ``"eager"``. Other caches and devices: transformers' choice
            (``"layers"`` and ``"graphs"`` are ``"compile"`` there).
        compile_prefill: run the first forward with the decoder layers compiled for any batch and length
            (:func:`~hf_cascade.compiled_layers.compiled_forward`) when the cache is a
            :class:`~hf_cascade.cache.CascadeCache` and the prefill is not chunked.
        model_kwargs: generate()'s model kwargs (the cache, ``attention_mask``, ``use_cache``, ...).
    Returns:
        ``[B, L + new]`` int64, or a ``GenerateDecoderOnlyOutput`` when ``return_dict_in_generate``; as ``_sample``.
    Calls that this loop does not cover (an encoder-decoder, ``synced_gpus``, a streamer, attentions or hidden
    states in the output) run transformers' own ``_sample``.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if (
        model.config.is_encoder_decoder or synced_gpus or streamer is not None
        or generation_config.output_attentions or generation_config.output_hidden_states
        or getattr(generation_config, "is_assistant", False)
    ):
        return type(model)._sample(
            model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
        )
    pad_token_id = generation_config._pad_token_tensor
    return_dict = generation_config.return_dict_in_generate
    scores = () if (return_dict and generation_config.output_scores) else None
    raw_logits = () if (return_dict and generation_config.output_logits) else None
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    model_forward = _decode_forward(model, model_kwargs, generation_config, decode_step)
    # Greedy search with nothing that reads the scores: the token is read from the logits as they are.
    plain_greedy = (not generation_config.do_sample and len(logits_processor) == 0 and scores is None
                    and raw_logits is None)
    outputs = _first_forward(model, input_ids, generation_config, model_kwargs, compile_prefill)
    if defer_stop_check is None:
        defer_stop_check = input_ids.device.type == "cuda"
    stop = _StopFlag(input_ids.device, defer_stop_check)
    max_length = getattr(stopping_criteria, "max_length", None)
    prefill_consumed = finished = False
    with step_context(decode_masks=True):  # see attention.cascade_mask: no host read of the mask
        with model._optimize_model_for_decode():
            while not finished:
                if prefill_consumed:
                    next_sequence_length = 1 if model_kwargs["use_cache"] else None
                    model_inputs = model.prepare_inputs_for_generation(
                        input_ids, next_sequence_length=next_sequence_length, **model_kwargs
                    )
                    outputs = model_forward(**model_inputs, return_dict=True)
                prefill_consumed = True
                model_kwargs = model._update_model_kwargs_for_generation(
                    outputs, model_kwargs, is_encoder_decoder=False
                )
                if plain_greedy:  # the same token as argmax of the fp32 copy, without the copy
                    next_tokens = greedy_tokens(outputs.logits[:, -1])
                else:
                    next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32,
                                                                 device=input_ids.device)
                    next_token_scores = logits_processor(input_ids, next_token_logits)
                    if scores is not None:
                        scores += (next_token_scores,)
                    if raw_logits is not None:
                        raw_logits += (next_token_logits,)
                    if generation_config.do_sample:
                        probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
                        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                    else:
                        next_tokens = torch.argmax(next_token_scores, dim=-1)
                if has_eos_stopping_criteria:  # finished rows get the pad token
                    next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
                input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
                unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)
                at_max_length = max_length is not None and input_ids.shape[1] >= max_length
                finished = stop.update(unfinished_sequences) or at_max_length
                del outputs
    cache = model_kwargs.get(CACHE_KWARG)
    if stop.extra_steps:  # the step after every row had finished: undone
        input_ids = input_ids[:, : -stop.extra_steps]
        scores = None if scores is None else scores[: -stop.extra_steps]
        raw_logits = None if raw_logits is None else raw_logits[: -stop.extra_steps]
        if cache is not None:
            cache.crop(-stop.extra_steps)
    if return_dict:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids, scores=scores, logits=raw_logits, attentions=None, hidden_states=None,
            **{CACHE_KWARG: cache},
        )
    return input_ids


def greedy_tokens(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """``torch.argmax(logits.float(), dim=-1)`` (the first index of each row's maximum, NaN the maximum) for
    ``logits [B, V]`` of any float dtype, in two reductions: the maximum of each of ``chunks`` chunks of a row, then
    the first chunk holding the row's maximum, with no fp32 copy (a float dtype's values and their order are exact
    in float32). Measured per greedy step, B=32, 128K logits, H100 (``profile_decode.jsonl``): 26 + 5 us against
    the fp32 copy (14 us) + argmax (28 us). ``chunks``: None picks 32, 16, 8 or 4 (a divisor of V
    leaving >= 256 per chunk) on CUDA and one (``torch.argmax``) elsewhere. Returns ``[B]`` int64."""
    rows, vocab = logits.shape
    if chunks is None:
        chunks = next((c for c in (32, 16, 8, 4) if vocab % c == 0 and vocab // c >= 256), 1)
        if logits.device.type != "cuda":
            chunks = 1
    if chunks == 1 or vocab % chunks:
        return torch.argmax(logits, dim=-1)
    best, where = logits.view(rows, chunks, vocab // chunks).max(dim=-1)  # first maximum of each chunk
    chunk = torch.argmax(best, dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * (vocab // chunks) + where.gather(1, chunk)).squeeze(1)


def _first_forward(model, input_ids, generation_config, model_kwargs: dict, compile_prefill: bool):
    """generate()'s first forward (``model._prefill``), with the decoder layers compiled where asked and possible."""
    from hf_cascade.cache import CascadeCache

    def forward():
        return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)

    cache = model_kwargs.get(CACHE_KWARG)
    if (not compile_prefill or not isinstance(cache, CascadeCache)
            or getattr(generation_config, "prefill_chunk_size", None) is not None):  # (chunks: one forward each)
        return forward()
    return compiled_forward(model, cache, forward)


def _decode_forward(model, model_kwargs: dict, generation_config, decode_step: str):
    """The callable that runs the decode steps (see :func:`sample`'s ``decode_step``; ``"auto"`` is resolved by
    ``hf_cascade.generate`` before the loop starts)."""
    if decode_step not in ("compile", "layers", "graphs", "eager"):
        raise ValueError(f"`decode_step` must be 'compile', 'layers', 'graphs' or 'eager'; got {decode_step!r}.")
    cache = model_kwargs.get(CACHE_KWARG)
    # A cascade or context-parallel cache with fixed buffers (their `fixed_decode_buffers`; transformers' own: no).
    fixed = bool(getattr(cache, "fixed_decode_buffers", False))
    fixed_cascade = fixed and model.device.type == "cuda"
    if fixed_cascade and decode_step == "eager":
        return model.__call__
    # Recorded where transformers would compile (its checks: no offload, a compileable quantizer): what a compiled
    # step may not do, a recorded one may not either. ``disable_compile=True`` (TRL passes it to every rollout) rules
    # out compiling the layers, not recording the eager step: a CUDA graph of the step's kernels compiles nothing.
    if fixed_cascade and decode_step in ("layers", "graphs") and _recordable(model, model_kwargs, generation_config):
        from hf_cascade.decode.captured_step import CapturedDecodeStep

        compile_layers = decode_step == "layers" and not generation_config.disable_compile
        return CapturedDecodeStep(model, cache, compile_layers=compile_layers)
    if model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return model.get_compiled_call(generation_config.compile_config)
    return model.__call__


def _recordable(model, model_kwargs: dict, generation_config) -> bool:
    """transformers' criteria for compiling the decode step (:meth:`_valid_auto_compile_criteria`: the device, a
    compileable cache, no offload, a compileable quantizer), ``disable_compile`` aside."""
    if not generation_config.disable_compile:
        return model._valid_auto_compile_criteria(model_kwargs, generation_config)
    config = copy.copy(generation_config)
    config.disable_compile = False
    return model._valid_auto_compile_criteria(model_kwargs, config)
