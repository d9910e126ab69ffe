"""Names in transformers' generation API that differ between the releases hf_cascade supports (5.17 to the newest).

transformers 5.24 renamed the cache argument of ``generate()``, of ``prepare_inputs_for_generation()`` and of the
models' ``forward()`` from ``past_key_values`` to ``cache`` (the old name still accepted, with a deprecation
warning), and the model outputs' field with it. hf_cascade reads and passes the cache under the name the
installed transformers uses, so neither release warns nor loses the cache.
"""

from __future__ import annotations

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
