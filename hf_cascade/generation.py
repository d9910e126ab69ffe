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

from hf_cascade.attention import IN_CASCADE_GENERATE, check_model_uses_cascade
from hf_cascade.cache import CascadeCache
from hf_cascade.cpu_threads import ContentionProbe, cpu_decode_threads
from hf_cascade.decode.compiled_layers import new_shapes
from hf_cascade.decode.sampling import sample
from hf_cascade.decode.step_buffers import step_buffers
from hf_cascade.options import CascadeOptions
from hf_cascade.tiers import choose_tier, record_call, shape_policy
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
            recorded or compiled — CUDA, greedy or sampling, no ``disable_compile=True``; True / False), and
            ``batch_buckets``: where the step is recorded or compiled, add rows (copies of the last row, cut from the output,
            finished from the first step) up to a bucket size (:func:`~hf_cascade.inputs.batch_bucket`), so that
            batches of other sizes run the same compiled step. None (default): for greedy search only, where the
            added rows change nothing; True: also when sampling (the samples are as random, but a seed then gives
            other samples than a call without the rows); False: never. ``defer_stop_check`` (None: on CUDA; True;
            False): greedy search and sampling read the "every row finished" flag one step late instead of waiting
            for the GPU at every step (:mod:`hf_cascade.decode.sampling`; the same tokens). ``decode_step`` (greedy search
            and sampling on CUDA with fixed buffers): ``"layers"`` (the step recorded into a CUDA graph, the
            decoder layers compiled once per model for all layers and layouts: :mod:`hf_cascade.decode.compiled_layers`),
            ``"graphs"`` (the eager step recorded, no compilation: :mod:`hf_cascade.decode.captured_step`),
            ``"compile"`` (transformers' compiled step: as fast as ``"layers"`` after a compilation of about a
            minute for an 8B model), ``"eager"``, or ``"auto"`` (default): on CUDA the tier :mod:`hf_cascade.tiers` picks
            (``"graphs"`` on PyTorch's own attention kernels for the first calls, nothing compiled; Triton's kernels
            and then ``"layers"`` once the calls have lost what getting there costs), elsewhere ``"layers"``.
            ``compile``: ``"auto"`` (default, the tiers), ``"now"`` (the compiled tier from the first call) or
            ``"never"`` (no compiled layers); only with the default ``decode_step`` and ``compile_prefill``.
            ``compile_prefill``: run
            the prefill forwards (each shared segment's, then the rows' first forward) with the decoder layers
            compiled for any batch and length (:func:`~hf_cascade.decode.compiled_layers.compiled_forward`: one
            compilation per model fuses the model's norms, rotary and activations). None (default): where the
            decode step is ``"layers"``; True (any device); False. ``cpu_decode_threads``: on CPU, ``"auto"``
            (default): the rows' first forward and the decode steps run single-threaded when the shared prefill
            found the CPU busy (:mod:`hf_cascade.cpu_threads`); an int: at most that many threads; None: torch's.
        model_kwargs: generate()'s model kwargs (``attention_mask`` ``[B * n, L]``, ``position_ids``,
            the cache (``past_key_values``, ``cache`` from transformers 5.24), ...).
    Returns:
        What generate() returns for the mode (a ``[B * n, L + new]`` tensor, or a ``GenerateOutput``).
    """
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    options = CascadeOptions.from_user(cascade_options)
    if cascade_caches is not None and not isinstance(cascade_caches, list):
        raise ValueError(
            f"`cascade_caches` must be None or a list (the CascadeCache built for the call is appended to it); got "
            f"{type(cascade_caches).__name__} {cascade_caches!r}. Pass `cascade_caches=[]`."
        )
    check_model_uses_cascade(model, "model")
    _refuse_autocast(input_ids.device.type)
    method_name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    if method_name not in _DECODING_METHODS:
        raise NotImplementedError(
            f"hf_cascade.generate runs greedy search, sampling, beam search and beam sampling; this generation config "
            f"asks for {generation_config.get_generation_mode().name.lower()}. Call generate() without "
            "`custom_generate` for it."
        )
    streamer = _arguments_the_hook_drops(sys._getframe(1), method_name)
    if streamer is not None:  # generate() put the prompt into it; the decoding loop streams the rest and ends it
        model_kwargs["streamer"] = streamer
    if generation_config.return_dict_in_generate and generation_config.output_attentions:
        raise NotImplementedError(
            "`output_attentions=True`: the cascade attention, like sdpa, never computes attention weights, so "
            "generate() would return none. For the weights, load the model with attn_implementation='eager' and call "
            "generate() without `custom_generate=hf_cascade.generate`."
        )
    decode = getattr(type(model), method_name)
    handed_in = input_ids, dict(model_kwargs)  # what a background build of the compiled tier runs again
    user_cache = model_kwargs.get(CACHE_KWARG)
    real_rows = None  # set when rows are added up to a batch bucket (cut from the output)
    if not getattr(user_cache, "_is_user_defined", False):
        user_cache = None  # the empty DynamicCache generate() made: replaced by the cascade cache below
    if (user_cache is not None and not isinstance(user_cache, CascadeCache)) or (
        model_kwargs.get("inputs_embeds") is not None and user_cache is None
    ) or generation_config.use_cache is False:
        # The user's own cache, prompts given as embeddings (no token ids to find sharing in), or no cache at all:
        # generate()'s own.
        return _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    reason = _unshareable_request(input_ids, generation_config, model_kwargs)
    if reason is not None:
        if user_cache is not None:
            raise ValueError(
                f"hf_cascade.generate cannot serve {reason} with the CascadeCache passed to it: its prefix KV were "
                "computed for the shared rows' own positions and its rows feed only their suffix columns. Leave the "
                "option out, or call generate() with no CascadeCache (and no `custom_generate`)."
            )
        warnings.warn(
            f"hf_cascade.generate: {reason} cannot be served with shared prefixes; this call runs generate()'s own "
            "decoding (exact, no sharing).", stacklevel=2,
        )
        return _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    defer, decode_step, compile_prefill = options.defer_stop_check, options.decode_step, options.compile_prefill
    threads_policy = options.cpu_decode_threads
    compiles = _compiles_decode(model, input_ids, generation_config, method_name)
    if compiles and threads_policy == "auto":
        # A compiled step guards on torch's thread count (dynamo's global state): a count chosen per call by the
        # load would compile the step again whenever the load changes. Compiled CPU steps keep torch's setting.
        threads_policy = None
    probe = ContentionProbe(input_ids.device, threads_policy)
    started = time.perf_counter()
    tier = None  # on CUDA with the default decode step: the engine tiers.choose_tier picks (no compiler stall)
    compile_choice = options.compile
    if input_ids.device.type == "cuda" and decode_step == "auto" and compile_prefill is None:
        tier = choose_tier(model, compile_choice if compiles else ("never" if compile_choice == "auto" else
                                                                   compile_choice))
        if method_name == "_sample":
            decode_step = "layers" if tier.compiled else "graphs"
    elif method_name == "_sample" and decode_step == "auto":
        decode_step = "layers"
    shapes = None if tier is None else shape_policy(model, tier, compile_choice)  # shapes new to the compiled tier
    if input_ids.device.type == "cuda":
        from hf_cascade.ops._backend import prepare_triton

        # Triton's cache shared with torch.compile, its key hashed in the background: on the built-in tier too, so
        # that the hashing (0.4 s on the H100) overlaps this call and not the first Triton-tier call after it.
        prepare_triton()

    def prefill_compiled(fixed: bool) -> bool:  # by default with the compiled decode step: its prefill graph alongside
        if compile_prefill is not None:
            return compile_prefill
        return bool(fixed and decode_step == "layers" and compiles and not _offloaded(model))

    buckets = options.batch_buckets
    if buckets is None:
        buckets = not generation_config.do_sample
    if streamer is not None:  # the streamer must see the user's rows only
        buckets = False
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:  # transformers >= 5.18 drops an all-ones mask
        attention_mask = torch.ones_like(input_ids)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    if isinstance(user_cache, CascadeCache) and user_cache.rows_verified:
        # Already planned for these rows (shared_prefix_inputs): check the room it has before any work.
        cache = user_cache
        _check_capacity(cache, input_ids.shape[1], max_new_tokens)
    else:
        from hf_cascade.inputs import batch_bucket, plan_cascade_batch

        fixed = options.fixed_buffers
        if fixed is None:  # compiled decode by default where transformers compiles it (CUDA, greedy/sampling)
            fixed = compiles or (user_cache is not None and user_cache.max_suffix_length is not None)
        rows, bucket = input_ids.shape[0], batch_bucket(input_ids.shape[0])
        if fixed and compiles and buckets and user_cache is None and bucket > rows:
            real_rows = rows
        plan_ids, plan_mask = input_ids, attention_mask
        if real_rows is not None:
            plan_ids, plan_mask = (_add_rows(t, bucket, rows) for t in (input_ids, attention_mask))
        with probe, new_shapes(shapes):  # on CPU: a busy CPU found before the prefill runs it single-threaded
            cache, planned_ids, attention_mask = plan_cascade_batch(
                model, plan_ids, plan_mask, prefix_cache=user_cache, max_new_tokens=max_new_tokens,
                fixed_buffers=fixed, bucket_buffers=fixed, compile_layers=prefill_compiled(fixed),
                builtin_kernels=tier is not None and tier.builtin_kernels, **options.planning(),
            )
        if cache is None:  # nothing worth sharing: generate()'s own cache and rows, untouched
            return _run(getattr(type(model), method_name), model, input_ids, logits_processor, stopping_criteria,
                        generation_config, model_kwargs)
        if real_rows is not None:
            model_kwargs = {k: _add_rows(v, bucket, rows) for k, v in model_kwargs.items()}
            stopping_criteria = _with_added_rows_done(stopping_criteria, real_rows)
        input_ids = planned_ids
        model_kwargs["attention_mask"] = attention_mask
    model_kwargs[CACHE_KWARG] = cache
    if method_name == "_sample":  # transformers' loop, without a wait for the GPU at every step
        decode = functools.partial(sample, defer_stop_check=defer, decode_step=decode_step,
                                   compile_prefill=prefill_compiled(cache.max_suffix_length is not None))
    if cache is not user_cache:
        # Padding levels let one compiled graph serve trees of 1-4 levels; a recorded step (CUDA) is recorded per
        # tree and launches for its real levels only.
        cache.pad_levels = decode_step not in ("layers", "graphs") or input_ids.device.type != "cuda"
    if cascade_caches is not None:
        cascade_caches.append(cache)
    if user_cache is not None or cache.max_suffix_length is None or max_new_tokens <= 1:
        out = _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                   threads=probe.decode_threads(), shapes=shapes)
        if tier is not None and cache is not user_cache:
            record_call(model, tier, time.perf_counter() - started, shapes)
        return out if real_rows is None else _first_rows(out, real_rows, input_ids.shape[0])
    # Fixed buffers in a cache of our own, and decode steps to run: take them from the model's StepBuffers, so that
    # a call with the same shapes as an earlier one replays its CUDA graphs instead of recording them again; give
    # them back after. (A call of one new token runs no decode step: it neither takes nor replaces the kept set.)
    buffers = step_buffers(model)
    cache.use_step_buffers(buffers)
    try:
        out = _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                   threads=probe.decode_threads(), shapes=shapes)
    finally:
        buffers.keep(cache.step_buffer_tensors())
    if tier is not None:
        record_call(model, tier, time.perf_counter() - started, shapes)
        missed = shapes is not None and shapes.misses > 0  # ran layers uncompiled: compile them in the background
        if (not tier.compiled or missed) and compile_choice == "auto" and compiles and method_name == "_sample":
            from hf_cascade.tier_build import build_in_background

            build_in_background(generate, model, handed_in[0], generation_config, handed_in[1], cascade_options,
                                buckets, cache.nbytes, layout=(input_ids.shape[0], cache.num_levels))
    return out if real_rows is None else _first_rows(out, real_rows, input_ids.shape[0])


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


def _compiles_decode(model, input_ids, generation_config, method_name: str) -> bool:
    """Whether transformers' decoding loop will compile the step for a compileable cache: its own criteria
    (``_sample`` only, not ``disable_compile``, CUDA unless the compile config says all devices)."""
    if method_name != "_sample" or getattr(generation_config, "disable_compile", False):
        return False
    if generation_config.use_cache is False:
        return False
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return False
    compile_config = getattr(generation_config, "compile_config", None)
    all_devices = bool(getattr(compile_config, "_compile_all_devices", False))
    return model.device.type == "cuda" or all_devices


def _offloaded(model) -> bool:
    """Part of the model offloaded to the CPU or disk (transformers does not compile such a model's step)."""
    devices = set(getattr(model, "hf_device_map", {}).values())
    return "disk" in devices or ("cpu" in devices and len(devices) > 1)


def _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
         threads: int | None = None, shapes=None):
    """Run generate()'s decoding method; ``threads``: the cascade call's CPU thread policy for its rows' first
    forward and decode steps (:mod:`hf_cascade.cpu_threads`; None: torch's setting, as generate()'s own paths);
    ``shapes``: what its compiled layers do with shapes new to them (:func:`hf_cascade.tiers.shape_policy`)."""
    token = IN_CASCADE_GENERATE.set(True)
    try:
        with _layout_independent_shapes(model_kwargs.get(CACHE_KWARG)), cpu_decode_threads(input_ids.device, threads), \
                new_shapes(shapes):
            return decode(
                model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, **model_kwargs,
            )
    finally:
        IN_CASCADE_GENERATE.reset(token)


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


def _unshareable_request(input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> str | None:
    """What in this call a cascade cache cannot give exactly as generate() does, described for a message, or None.

    * ``position_ids`` other than the attention mask's running count (what generate() computes when none are
      given): the shared prefix KV are computed once, at the positions 0..P-1 every sharing row has.
    * ``output_hidden_states`` in a dict output: generate() feeds a cascade cache only each row's suffix columns,
      so the prefill's hidden states would be narrower than the prompt (sdpa's cover every prompt column).
    """
    position_ids = model_kwargs.get("position_ids")
    if position_ids is not None:
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(input_ids)
        if position_ids.dim() != 2 or position_ids.shape[-1] != mask.shape[-1]:
            return f"`position_ids` of shape {tuple(position_ids.shape)}"
        real = mask.bool()
        counted = mask.long().cumsum(-1) - 1
        if not torch.equal(torch.where(real, position_ids.expand_as(counted), 0), torch.where(real, counted, 0)):
            return ("`position_ids` other than the attention mask's running count (`attention_mask.cumsum(-1) - 1`, "
                    "what generate() uses when none are given)")
    if generation_config.return_dict_in_generate and generation_config.output_hidden_states:
        return "`output_hidden_states=True` (the hidden states of every prompt column, as sdpa gives)"
    return None


def _check_capacity(cache: CascadeCache, width: int, max_new_tokens: int) -> None:
    """Fixed buffers must hold the rows' suffix columns plus every new token: refuse before the prefill."""
    if cache.max_suffix_length is None:
        return
    needed = width - cache.prefix_length + max_new_tokens - 1  # the last new token is never fed back
    if needed > cache.max_suffix_length:
        raise ValueError(
            f"This CascadeCache's fixed buffers hold {cache.max_suffix_length} suffix tokens per row, and this "
            f"generate() needs {needed} ({width - cache.prefix_length} prompt columns after the prefix + "
            f"max_new_tokens={max_new_tokens}). Build it with `shared_prefix_inputs(..., max_new_tokens="
            f"{max_new_tokens})` (or a larger `max_suffix_length`), or lower `max_new_tokens`."
        )
