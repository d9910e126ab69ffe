"""What one ``hf_cascade.generate`` call does, decided once before any work: :func:`resolve` reads the request
(:class:`Request`) and the validated :class:`~hf_cascade.options.CascadeOptions` and returns a :class:`RunPlan`;
:func:`hf_cascade.generation.run` executes it.

Every decision lives here: whether the call runs generate()'s own decoding (and why), the tier on CUDA
(:mod:`hf_cascade.tiers`), the decode step, compiled prefill, fixed buffers and the batch bucket, what the compiled
layers do with shapes new to them, the CPU thread policy, and whether a background build starts after the call.
The only state read is the model's tier state (``choose_tier`` / ``shape_policy``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_cascade.attention import dropout_in_training, unshareable_model
from hf_cascade.cache import CascadeCache
from hf_cascade.compiled_layers import NewShapes
from hf_cascade.options import CascadeOptions
from hf_cascade.tiers import Tier, choose_tier, shape_policy
from hf_cascade.transformers_compat import compileable_cache_masks_fail

__all__ = ["Request", "RunPlan", "resolve"]


@dataclasses.dataclass(frozen=True)
class Request:
    """What generate() handed the hook, read once: the rows, the prepared generation config, the model kwargs (the
    streamer put back), transformers' decoding method for the mode, the streamer, and the user's own cache (None for
    the empty cache generate() made)."""

    input_ids: torch.Tensor
    generation_config: Any
    model_kwargs: dict
    method_name: str
    streamer: Any = None
    user_cache: Any = None


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Every decision of one call.

    ``own``: generate()'s own decoding as it prepared it (``why_not_shared``: what cannot be shared, for a warning;
    None: a user's non-cascade cache, embeddings or no cache, silently). ``tier``: the engine on CUDA with the default
    decode step (None elsewhere). ``shapes``: what the compiled layers do with shapes new to them. ``threads``: the
    CPU thread policy. ``fixed_buffers`` / ``bucket`` (rows added up to it, None: none) / ``batch_buckets``: how a
    cache of this call's own is planned. ``pad_levels``: the planned cache pads its levels (a compiled graph for
    trees of 1-4 levels). ``background_build``: the tier whose background build a call that runs decode steps on
    fixed buffers starts after it (``"compiled"``; ``"triton"`` where the step may not compile, as TRL's
    ``disable_compile=True``, and the call ran the built-in kernels), or None.
    """

    options: CascadeOptions
    method_name: str
    own: bool = False
    why_not_shared: str | None = None
    compiles: bool = False
    tier: Tier | None = None
    decode_step: str = "auto"
    shapes: NewShapes | None = None
    threads: Any = None
    fixed_buffers: bool = False
    bucket: int | None = None
    batch_buckets: bool = False
    max_new_tokens: int = 0
    pad_levels: bool = True
    offloaded: bool = False
    background_build: str | None = None

    def prefill_compiled(self, fixed: bool) -> bool:
        """Whether the prefill forwards run compiled layers: the option, else with the compiled decode step on
        fixed buffers (its prefill graph alongside)."""
        if self.options.compile_prefill is not None:
            return self.options.compile_prefill
        return bool(fixed and self.decode_step == "layers" and self.compiles and not self.offloaded)


def resolve(model, options: CascadeOptions, request: Request) -> RunPlan:
    """Decide everything ``request`` needs (see :class:`RunPlan`). Raises the ValueErrors of a request that cannot
    run: a CascadeCache of the user's with an unshareable option, or fixed buffers too small."""
    input_ids, config, method_name = request.input_ids, request.generation_config, request.method_name
    user_cache, kwargs = request.user_cache, request.model_kwargs
    if isinstance(user_cache, CascadeCache):
        _check_cascade_cache_request(input_ids, config, kwargs, user_cache)
    if (user_cache is not None and not isinstance(user_cache, CascadeCache)) or (
        kwargs.get("inputs_embeds") is not None and user_cache is None
    ) or config.use_cache is False:
        # The user's own cache, prompts given as embeddings (no token ids to find sharing in), or no cache at all.
        return RunPlan(options, method_name, own=True)
    reason = unshareable_model(model) or dropout_in_training(model) or _unshareable_request(input_ids, config, kwargs)
    if reason is not None:
        if user_cache is not None:
            raise ValueError(
                f"hf_cascade.generate cannot serve {reason} with the CascadeCache passed to it: its prefix KV were "
                "computed for the shared rows' own positions and its rows feed only their suffix columns. Leave the "
                "option out, or call generate() with no CascadeCache (and no `custom_generate`)."
            )
        return RunPlan(options, method_name, own=True, why_not_shared=reason)
    max_new_tokens = config.max_length - input_ids.shape[1]
    if isinstance(user_cache, CascadeCache) and user_cache.rows_verified:
        _check_capacity(user_cache, input_ids.shape[1], max_new_tokens)  # before any work
    compiles = _compiles_decode(model, input_ids, config, method_name)
    records = compiles or _compiles_decode(model, input_ids, config, method_name, recording=True)
    if compileable_cache_masks_fail(model):  # transformers 5.17, Llama 4: growing caches only (by default)
        compiles = records = False
    cuda = input_ids.device.type == "cuda"
    tier, decode_step = _tier_and_step(model, options, cuda, compiles, method_name)
    buckets = (not config.do_sample if options.batch_buckets is None else options.batch_buckets) and (
        request.streamer is None)  # the streamer must see the user's rows only
    fixed = options.fixed_buffers
    if fixed is None:  # compiled or recorded decode by default where transformers would compile (CUDA, greedy/sampling)
        fixed = records or (user_cache is not None and user_cache.max_suffix_length is not None)
    from hf_cascade.inputs import batch_bucket

    rows, bucket = input_ids.shape[0], batch_bucket(input_ids.shape[0])
    added = fixed and records and buckets and user_cache is None and bucket > rows
    # A compiled step guards on torch's thread count (dynamo's global state): a count chosen per call by the load
    # would compile the step again whenever the load changes. Compiled CPU steps keep torch's setting.
    threads = None if compiles and options.cpu_decode_threads == "auto" else options.cpu_decode_threads
    return RunPlan(
        options, method_name, compiles=compiles, tier=tier, decode_step=decode_step,
        shapes=None if tier is None else shape_policy(model, tier, options.compile), threads=threads,
        fixed_buffers=fixed, bucket=bucket if added else None, batch_buckets=buckets, max_new_tokens=max_new_tokens,
        pad_levels=decode_step not in ("layers", "graphs") or not cuda, offloaded=_offloaded(model),
        background_build=_background_build(tier, options, compiles, records, method_name),
    )


def _background_build(tier, options: CascadeOptions, compiles: bool, records: bool, method_name: str) -> str | None:
    """The tier a background build prepares after this call (:mod:`hf_cascade.tier_build`), or None."""
    if tier is None or options.compile != "auto" or method_name != "_sample":
        return None
    if compiles:
        return None if tier.compiled else "compiled"
    return "triton" if records and tier.builtin_kernels else None


def _tier_and_step(model, options: CascadeOptions, cuda: bool, compiles: bool, method_name: str):
    """``(tier, decode_step)``: on CUDA with the default decode step the tier :func:`~hf_cascade.tiers.choose_tier`
    picks (no compiler stall) and its step; elsewhere no tier, and ``"layers"`` for ``"auto"``."""
    decode_step, choice = options.decode_step, options.compile
    if cuda and decode_step == "auto" and options.compile_prefill is None:
        tier = choose_tier(model, choice if compiles else ("never" if choice == "auto" else choice))
        if method_name == "_sample":
            decode_step = "layers" if tier.compiled else "graphs"
        return tier, decode_step
    if method_name == "_sample" and decode_step == "auto":
        decode_step = "layers"
    return None, decode_step


def _compiles_decode(model, input_ids, generation_config, method_name: str, recording: bool = False) -> bool:
    """Whether transformers' decoding loop will compile the step for a compileable cache: its own criteria
    (``_sample`` only, not ``disable_compile``, CUDA unless the compile config says all devices). ``recording``:
    whether the step may be recorded into CUDA graphs instead: the same criteria on CUDA, ``disable_compile`` aside
    (a recorded step compiles nothing; TRL passes ``disable_compile=True`` to every rollout)."""
    if method_name != "_sample" or (getattr(generation_config, "disable_compile", False) and not recording):
        return False
    if generation_config.use_cache is False:
        return False
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return False
    compile_config = getattr(generation_config, "compile_config", None)
    all_devices = bool(getattr(compile_config, "_compile_all_devices", False)) and not recording
    return model.device.type == "cuda" or all_devices


def _offloaded(model) -> bool:
    """Part of the model offloaded to the CPU or disk (transformers does not compile such a model's step)."""
    devices = set(getattr(model, "hf_device_map", {}).values())
    return "disk" in devices or ("cpu" in devices and len(devices) > 1)


# Model kwargs that carry images, videos or audio into a multimodal model's forward (name prefixes).
MEDIA_INPUTS = ("pixel_values", "image_", "video_", "input_features", "audio_", "aspect_ratio", "cross_attention_mask",
                "mm_")  # (mm_encoder_outputs: transformers >= 5.24 encodes the media before the decoding loop)


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
    media = sorted(k for k, v in model_kwargs.items() if v is not None and k.startswith(MEDIA_INPUTS))
    if media:  # (an image's tokens are alike in every row: they would be shared without the image)
        return f"image, video or audio inputs ({', '.join(f'`{k}`' for k in media)}: shared prefixes are prefilled " \
               "from token ids alone)"
    return None


def _check_cascade_cache_request(input_ids: torch.Tensor, generation_config, model_kwargs: dict,
                                 cache: CascadeCache) -> None:
    """A CascadeCache passed with what it cannot serve: ``use_cache=False`` (generate()'s own decoding would run the
    rows without their stored prefix), or prompts given as embeddings alone to a cache whose rows are not planned
    yet (``from_prefix``: the rows are matched to the stored prefix by their token ids)."""
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` with a CascadeCache: the rows' prefix lives only in the cache, which a forward without "
            "a cache leaves out. Drop `use_cache=False`, or drop the cache (generate() then runs the whole prompts)."
        )
    embeds_only = model_kwargs.get("inputs_embeds") is not None and input_ids.shape[-1] == 0
    if embeds_only and not cache.rows_verified:
        raise ValueError(
            "`inputs_embeds` without `input_ids` with a CascadeCache: hf_cascade.generate matches the rows to the "
            "cache's stored prefix by their token ids. Pass `input_ids` too (the embeddings of those ids), or call "
            "generate() without the cache."
        )


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
