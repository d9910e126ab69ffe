"""``hf_cascade.generate``: cascade decoding for the user's own ``model.generate(...)`` call, with one argument.

Pass it as transformers' official ``custom_generate`` hook::

    out = model.generate(**batch, max_new_tokens=64, num_return_sequences=8, custom_generate=hf_cascade.generate)
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=16)
    pipe(prompts, custom_generate=hf_cascade.generate)             # pipeline forwards it to generate()

How it works. generate() does all of its usual preparation — generation config, logits processors, stopping
criteria, positions, and the rows already expanded for ``num_return_sequences`` / ``num_beams`` — and then calls
this function instead of its decoding loop. Here the expanded rows are planned as one prefix tree: what prompts
share (a system prompt), and each prompt's own tokens, which its samples or beams share, are prefilled and stored
once (:func:`~hf_cascade.inputs.plan_cascade_batch`). The rows keep their width and columns, so outputs are as wide
as the input plus the new tokens. Then transformers' own decoding method for the mode (``_sample`` for greedy and
sampling, ``_beam_search`` for beam search and beam sampling) runs on the cascade cache.
Every decision of the call is made once, before any work, by :func:`hf_cascade.run_plan.resolve` (a frozen
:class:`~hf_cascade.run_plan.RunPlan`); :func:`run` executes it.

Where sharing does not pay (the cost model on CUDA rejects every segment), where the user passed a cache that is
not an hf_cascade cache, or for modes other than greedy/sampling/beams, the decoding method runs exactly as
generate() prepared it, so the result is generate()'s own. Limits (transformers' hook, not ours): a
``custom_generate`` callable never receives ``streamer``, ``tokenizer`` (so no ``stop_strings``), an assistant
model or ``synced_gpus``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
import warnings

import torch
from transformers.utils import logging

from hf_cascade.attention import check_model_uses_cascade
from hf_cascade.cache import CascadeCache
from hf_cascade.cpu_threads import ContentionProbe, cpu_decode_threads
from hf_cascade.compiled_layers import new_shapes
from hf_cascade.decode.sampling import sample
from hf_cascade.inputs import refuse_prompt_readers_on_suffix_rows
from hf_cascade.step_buffers import step_buffers
from hf_cascade.step_context import step_context
from hf_cascade.options import CascadeOptions
from hf_cascade.run_plan import Request, RunPlan, resolve
from hf_cascade.tiers import record_call
from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)

_DECODING_METHODS = {"_sample", "_beam_search"}


def _refuse_autocast(device_type: str) -> None:
    """A ValueError under ``torch.autocast``: the cascade cache does not follow autocast's per-op dtypes."""
    if torch.is_autocast_enabled(device_type):
        raise ValueError(
            f"hf_cascade.generate was called under torch.autocast ({device_type}, "
            f"{torch.get_autocast_dtype(device_type)}): the cascade cache does not follow autocast's per-op dtypes "
            "(keys and values would be stored in different dtypes). Call generate() outside autocast, with the model "
            "in the dtype you want (`model.to(torch.bfloat16)`); with TRL, pass `GRPOConfig(bf16=False)` "
            "(docs/trl.md)."
        )


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    cascade_caches: list | None = None,
    cascade_options: dict | None = None,
    **model_kwargs,
):
    """transformers' ``custom_generate`` entry point: plan the shared prefixes of the prepared rows, then decode.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"`` (``model`` as generate() passes it).
        input_ids: ``[B * n, L]`` the rows generate() prepared (each prompt already repeated ``n`` times for
            ``num_return_sequences`` / ``num_beams``), left-padded (right-padded rows that share a segment raise a
            ValueError; a right-padded batch that shares nothing runs as generate()'s own).
        logits_processor, stopping_criteria, generation_config: as generate() prepared them.
        cascade_caches: optional list; the :class:`CascadeCache` built for this call is appended to it (to read
            ``nbytes`` or ``prefix_tree``). Pass it to ``generate()`` / a pipeline call like any other kwarg.
        cascade_options: optional planning options, any of ``min_shared_tokens`` (default 4), ``min_rows`` (2),
            ``max_levels`` (4), ``cost_model`` ("auto": the measured cost model on CUDA; None: share everything),
            as in :func:`hf_cascade.shared_prefix_inputs`, ``fixed_buffers`` (None: on where the decode step is
            recorded or compiled — CUDA, greedy or sampling; ``disable_compile=True`` records, compiles nothing; True /
            False), and
            ``batch_buckets``: where the step is recorded or compiled, add rows (copies of the last row, cut from the output,
            finished from the first step) up to a bucket size (:func:`~hf_cascade.inputs.batch_bucket`), so that
            batches of other sizes run the same compiled step. None (default): for greedy search only, where the
            added rows change nothing; True: also when sampling (the samples are as random, but a seed then gives
            other samples than a call without the rows); False: never. ``defer_stop_check`` (None: on CUDA; True;
            False): greedy search and sampling read the "every row finished" flag one step late instead of waiting
            for the GPU at every step (:mod:`hf_cascade.decode.sampling`; the same tokens). ``decode_step`` (greedy search
            and sampling on CUDA with fixed buffers): ``"layers"`` (the step recorded into a CUDA graph, the
            decoder layers compiled once per model for all layers and layouts: :mod:`hf_cascade.compiled_layers`),
            ``"graphs"`` (the eager step recorded, no compilation: :mod:`hf_cascade.decode.captured_step`),
            ``"compile"`` (transformers' compiled step: as fast as ``"layers"`` after a compilation of about a
            minute for an 8B model), ``"eager"``, or ``"auto"`` (default): on CUDA the tier :mod:`hf_cascade.tiers` picks
            (``"graphs"`` on PyTorch's own attention kernels for the first calls, nothing compiled; Triton's kernels
            and then ``"layers"`` once the calls have lost what getting there costs), elsewhere ``"layers"``.
            ``compile``: ``"auto"`` (default, the tiers), ``"now"`` (the compiled tier from the first call) or
            ``"never"`` (no compiled layers); only with the default ``decode_step`` and ``compile_prefill``.
            ``compile_prefill``: run
            the prefill forwards (each shared segment's, then the rows' first forward) with the decoder layers
            compiled for any batch and length (:func:`~hf_cascade.compiled_layers.compiled_forward`: one
            compilation per model fuses the model's norms, rotary and activations). None (default): where the
            decode step is ``"layers"``; True (any device); False. ``cpu_decode_threads``: on CPU, ``"auto"``
            (default): the rows' first forward and the decode steps run single-threaded when the shared prefill
            found the CPU busy (:mod:`hf_cascade.cpu_threads`); an int: at most that many threads; None: torch's.
        model_kwargs: generate()'s model kwargs (``attention_mask`` ``[B * n, L]``, ``position_ids``,
            the cache (``past_key_values``, ``cache`` from transformers 5.24), ...).
    Returns:
        What generate() returns for the mode (a ``[B * n, L + new]`` tensor, or a ``GenerateOutput``).
    """
    options = CascadeOptions.from_user(cascade_options)
    if cascade_caches is not None and not isinstance(cascade_caches, list):
        raise ValueError(
            f"`cascade_caches` must be None or a list (the CascadeCache built for the call is appended to it); got "
            f"{type(cascade_caches).__name__} {cascade_caches!r}. Pass `cascade_caches=[]`."
        )
    request = _read_request(model, input_ids, generation_config, model_kwargs, sys._getframe(1), logits_processor)
    started = time.perf_counter()
    plan = resolve(model, options, request)
    if plan.why_not_shared is not None:
        warnings.warn(
            f"hf_cascade.generate: {plan.why_not_shared} cannot be served with shared prefixes; this call runs "
            "generate()'s own decoding (exact, no sharing).", stacklevel=2,
        )
    return run(model, plan, request, logits_processor, stopping_criteria, cascade_caches, started)


def _read_request(model, input_ids, generation_config, model_kwargs: dict, caller, logits_processor=None) -> Request:
    """The call as generate() handed it (``caller``: generate()'s frame), refusing what the hook cannot run."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    check_model_uses_cascade(model, "model")
    _refuse_autocast(input_ids.device.type)
    method_name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    if method_name not in _DECODING_METHODS:
        raise NotImplementedError(
            f"hf_cascade.generate runs greedy search, sampling, beam search and beam sampling; this generation config "
            f"asks for {generation_config.get_generation_mode().name.lower()}. Call generate() without "
            "`custom_generate` for it."
        )
    streamer = _arguments_the_hook_drops(caller, method_name)
    if streamer is not None:  # generate() put the prompt into it; the decoding loop streams the rest and ends it
        model_kwargs["streamer"] = streamer
    if generation_config.return_dict_in_generate and generation_config.output_attentions:
        raise NotImplementedError(
            "`output_attentions=True`: the cascade attention, like sdpa, never computes attention weights, so "
            "generate() would return none. For the weights, load the model with attn_implementation='eager' and call "
            "generate() without `custom_generate=hf_cascade.generate`."
        )
    user_cache = model_kwargs.get(CACHE_KWARG)
    if not getattr(user_cache, "_is_user_defined", False):
        user_cache = None  # the empty DynamicCache generate() made: replaced by the cascade cache
    if isinstance(user_cache, CascadeCache):
        refuse_prompt_readers_on_suffix_rows(input_ids, model_kwargs.get("attention_mask"), logits_processor)
    return Request(input_ids, generation_config, dict(model_kwargs), method_name, streamer, user_cache)


def run(model, plan: RunPlan, request: Request, logits_processor, stopping_criteria, cascade_caches: list | None,
        started: float):
    """Execute ``plan`` (:func:`~hf_cascade.run_plan.resolve`) for ``request``: generate()'s own decoding, or the
    cascade cache planned (or the user's), the decoding method on it, the tier's call recorded (``started``: when
    the call began) and the background build started where the plan says."""
    own = (model, request.input_ids, logits_processor, stopping_criteria, request.generation_config,
           dict(request.model_kwargs))
    if plan.own:
        return _run(getattr(type(model), plan.method_name), *own)
    probe = ContentionProbe(request.input_ids.device, plan.threads)
    if request.input_ids.device.type == "cuda":
        from hf_cascade.ops._backend import prepare_triton

        # Triton's cache shared with torch.compile, its key hashed in the background: on the built-in tier too, so
        # that the hashing (0.4 s on the H100) overlaps this call and not the first Triton-tier call after it.
        prepare_triton()
    planned = _cascade_inputs(model, plan, request, probe, stopping_criteria)
    if planned is None:  # nothing worth sharing: generate()'s own cache and rows, untouched
        return _run(getattr(type(model), plan.method_name), *own)
    cache, input_ids, model_kwargs, stopping_criteria = planned
    cache.positions_checked = True  # (planned here from generate()'s rows, or checked by resolve: position_ids)
    user_cache, tier = request.user_cache, plan.tier
    decode = getattr(type(model), plan.method_name)
    if plan.method_name == "_sample":  # transformers' loop, without a wait for the GPU at every step
        decode = functools.partial(sample, defer_stop_check=plan.options.defer_stop_check,
                                   decode_step=plan.decode_step,
                                   compile_prefill=plan.prefill_compiled(cache.max_suffix_length is not None))
    if cache is not user_cache:
        cache.pad_levels = plan.pad_levels  # recorded steps (CUDA) launch for the tree's real levels only
    if cascade_caches is not None:
        cascade_caches.append(cache)
    args = (decode, model, input_ids, logits_processor, stopping_criteria, request.generation_config, model_kwargs)
    steps_on_buffers = user_cache is None and cache.max_suffix_length is not None and plan.max_new_tokens > 1
    if not steps_on_buffers:
        out = _run(*args, threads=probe.decode_threads(), shapes=plan.shapes)
    else:
        # Fixed buffers in a cache of our own, and decode steps to run: take them from the model's StepBuffers, so
        # that a call with the same shapes as an earlier one replays its CUDA graphs instead of recording them again;
        # give them back after. (A call of one new token runs no decode step: it neither takes nor replaces the set.)
        buffers = step_buffers(model)
        cache.use_step_buffers(buffers)
        try:
            out = _run(*args, threads=probe.decode_threads(), shapes=plan.shapes)
        finally:
            buffers.keep(cache.step_buffer_tensors())
    if tier is not None and cache is not user_cache:
        record_call(model, tier, time.perf_counter() - started, plan.shapes)
    if steps_on_buffers and plan.background_build:
        from hf_cascade.tier_build import build_in_background

        build_in_background(model, request.input_ids, request.generation_config, request.model_kwargs,
                            plan.options.user_dict(), plan.batch_buckets, cache.nbytes, tier=plan.background_build)
    return out if plan.bucket is None else _first_rows(out, request.input_ids.shape[0], input_ids.shape[0])


def _cascade_inputs(model, plan: RunPlan, request: Request, probe, stopping_criteria):
    """``(cache, input_ids, model_kwargs, stopping_criteria)`` of the cascade call: the user's planned CascadeCache
    as it is, else the rows planned into a new one (prefilled: rows added up to ``plan.bucket``, and a criterion
    that marks them finished), or None where nothing is worth sharing."""
    input_ids, model_kwargs, user_cache = request.input_ids, dict(request.model_kwargs), request.user_cache
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:  # transformers >= 5.18 drops an all-ones mask
        attention_mask = torch.ones_like(input_ids)
    if isinstance(user_cache, CascadeCache) and user_cache.rows_verified:
        user_cache.check_planned_rows(input_ids, attention_mask)  # (its token ids: the positions are not checked)
        cache = user_cache  # planned for these rows (shared_prefix_inputs, a cascade call); its room checked by resolve
    else:
        from hf_cascade.inputs import plan_cascade_batch

        rows, fixed = input_ids.shape[0], plan.fixed_buffers
        plan_ids, plan_mask = input_ids, attention_mask
        if plan.bucket is not None:
            plan_ids, plan_mask = (_add_rows(t, plan.bucket, rows) for t in (input_ids, attention_mask))
        with probe, new_shapes(plan.shapes):  # on CPU: a busy CPU found before the prefill runs it single-threaded
            cache, input_ids, attention_mask = plan_cascade_batch(
                model, plan_ids, plan_mask, prefix_cache=user_cache, max_new_tokens=plan.max_new_tokens,
                fixed_buffers=fixed, bucket_buffers=fixed, compile_layers=plan.prefill_compiled(fixed),
                builtin_kernels=plan.tier is not None and plan.tier.builtin_kernels, **plan.options.planning(),
            )
        if cache is None:
            return None
        if plan.bucket is not None:
            model_kwargs = {k: _add_rows(v, plan.bucket, rows) for k, v in model_kwargs.items()}
            stopping_criteria = _with_added_rows_done(stopping_criteria, rows)
        model_kwargs["attention_mask"] = attention_mask
    model_kwargs[CACHE_KWARG] = cache
    return cache, input_ids, model_kwargs, stopping_criteria


def _arguments_the_hook_drops(caller, method_name: str):
    """The ``streamer`` given to the generate() call that called this hook, or None; refuses an assistant model and
    ``synced_gpus=True``.

    transformers' ``custom_generate`` hook passes a callable neither ``streamer`` nor ``assistant_model`` nor
    ``synced_gpus`` (it routes only the keys that ``_sample`` does not take). generate() has already put the prompt
    into the streamer: without it the decoding loop would never call ``end()``, and a ``TextIteratorStreamer``
    consumer would wait forever. They are read from generate()'s own frame (``caller``, the frame that called the
    hook), found by its code object.
    """
    from transformers.generation.utils import GenerationMixin

    if caller is None or caller.f_code is not inspect.unwrap(GenerationMixin.generate).__code__:
        return None
    arguments = caller.f_locals
    if arguments.get("assistant_model") is not None:
        raise NotImplementedError(
            "hf_cascade.generate does not run assisted generation (`assistant_model`): transformers' custom_generate "
            "hook does not pass it on. Call generate() without `custom_generate=hf_cascade.generate` for it."
        )
    if arguments.get("synced_gpus"):
        raise NotImplementedError(
            "hf_cascade.generate does not run with `synced_gpus=True` (DeepSpeed ZeRO-3 / FSDP): transformers' "
            "custom_generate hook does not pass it on. Call generate() without `custom_generate=hf_cascade.generate`."
        )
    streamer = arguments.get("streamer")
    if streamer is not None and method_name == "_beam_search":
        raise ValueError(
            "`streamer` cannot be used with beam search (as in generate()); set `num_beams=1` or leave out the "
            "streamer."
        )
    return streamer


def _add_rows(value, size: int, rows: int):
    """``value`` with copies of its last row up to ``size`` rows, if it is a tensor of ``rows`` rows."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
        return value
    return torch.cat([value, value[-1:].expand(size - rows, *value.shape[1:])])


def _with_added_rows_done(stopping_criteria, real_rows: int):
    """generate()'s stopping criteria + one that marks the added rows finished from the first step, so that they
    never keep the loop going (with an EOS they get pad tokens)."""
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class _AddedRowsDone(StoppingCriteria):
        done = None  # built at the first step, reused at every step after

        def __call__(self, input_ids, scores, **kwargs):
            if self.done is None:
                self.done = torch.arange(input_ids.shape[0], device=input_ids.device) >= real_rows
            return self.done

    return StoppingCriteriaList([*(stopping_criteria or []), _AddedRowsDone()])


def _first_rows(value, rows: int, total: int):
    """generate()'s output (a tensor, or a ModelOutput of tensors and nested tuples) cut to its first ``rows`` rows;
    the cache is left as it is."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.dim() and value.shape[0] == total else value
    if isinstance(value, tuple):
        return tuple(_first_rows(v, rows, total) for v in value)
    if isinstance(value, list):
        return [_first_rows(v, rows, total) for v in value]
    if hasattr(value, "keys") and hasattr(value, "__setitem__") and not isinstance(value, CascadeCache):
        for key in list(value.keys()):
            if key != CACHE_KWARG:
                value[key] = _first_rows(value[key], rows, total)
    return value


def _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
         threads: int | None = None, shapes=None):
    """Run generate()'s decoding method; ``threads``: the cascade call's CPU thread policy for its rows' first
    forward and decode steps (:mod:`hf_cascade.cpu_threads`; None: torch's setting, as generate()'s own paths);
    ``shapes``: what its compiled layers do with shapes new to them (:func:`hf_cascade.tiers.shape_policy`)."""
    with step_context(in_generate=True), _layout_independent_shapes(model_kwargs.get(CACHE_KWARG)), \
            cpu_decode_threads(input_ids.device, threads), new_shapes(shapes):
        return decode(
            model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, **model_kwargs,
        )


def _layout_independent_shapes(cache):
    """For a cascade cache with fixed buffers: compile the decode step without dynamo's duck sizing, which gives
    dynamic sizes that happen to be equal at the first compile one symbol (and the graph a guard that they stay
    equal). A layout's sizes (each level's prefix length, node and tile counts, the buffers' capacity) coincide
    by chance; without it a later batch whose sizes differ would compile again."""
    import contextlib

    if not isinstance(cache, CascadeCache) or cache.max_suffix_length is None:
        return contextlib.nullcontext()
    from torch.fx.experimental import _config as shape_config

    return shape_config.patch(use_duck_shape=False)
