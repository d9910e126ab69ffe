"""Names in transformers' generation API that differ between the releases hf_cascade supports (5.17 to the newest).

transformers 5.24 renamed the cache argument of ``generate()``, of ``prepare_inputs_for_generation()`` and of the
models' ``forward()`` from ``past_key_values`` to ``cache`` (the old name still accepted, with a deprecation
warning), and the model outputs' field with it. hf_cascade reads and passes the cache under the name the
installed transformers uses, so neither release warns nor loses the cache.
"""

from __future__ import annotations

import functools
import inspect

from transformers.generation.utils import GenerationMixin


def _cache_kwarg() -> str:
    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


CACHE_KWARG: str = _cache_kwarg()
"""The key of generate()'s cache in its model kwargs, in a model's inputs and in its outputs: ``"cache"`` from
transformers 5.24, ``"past_key_values"`` before."""

CACHE_KWARG_NAMES: tuple[str, ...] = ("cache", "past_key_values")
"""Every name a user may pass the cache under (the old one is still accepted by the newest transformers)."""


def output_cache(output):
    """The cache a model or generate() output (``ModelOutput``) holds, under the installed release's name; None if
    it holds none."""
    return getattr(output, CACHE_KWARG, None)


def text_config(config):
    """The decoder's config (a multimodal config's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def compileable_cache_masks_fail(model) -> bool:
    """Whether generate() fails on ``model`` with a compileable cache (fixed buffers) in this transformers: 5.17's
    ``create_masks_for_generate`` hands ``block_sequence_ids`` to every layer type's mask function, and the chunked
    one (Llama 4's ``chunked_attention`` layers) takes no such argument (a ``TypeError`` in transformers' own
    ``prepare_inputs_for_generation``; its ``StaticCache`` fails alike). Growing caches are not affected."""
    text = text_config(getattr(model, "config", None))
    return "chunked_attention" in (getattr(text, "layer_types", None) or ()) and _chunked_masks_fail()


@functools.lru_cache(maxsize=1)
def _chunked_masks_fail() -> bool:
    """transformers' generate-time mask builder hands its chunked mask function an argument it does not take."""
    from transformers import masking_utils

    hands = "block_sequence_ids" in inspect.signature(masking_utils.create_masks_for_generate).parameters
    takes = "block_sequence_ids" in inspect.signature(masking_utils.create_chunked_causal_mask).parameters
    return hands and not takes


def fixed_buffers_refusal(model) -> str | None:
    """Why a cache of fixed buffers cannot serve ``model`` in this transformers (:func:`compileable_cache_masks_fail`:
    the ValueError's message, naming the fixes), or None."""
    if not compileable_cache_masks_fail(model):
        return None
    import transformers

    return (f"transformers {transformers.__version__} fails on this model's chunked attention layers with a cache of "
            "fixed buffers (its create_masks_for_generate hands `block_sequence_ids` to create_chunked_causal_mask, "
            "which takes none; its own StaticCache fails alike). Leave out `max_new_tokens` / `max_suffix_length` / "
            "`fixed_buffers` / `decode_step` (the cache then grows: the default here), or upgrade transformers (5.24 "
            "works).")
