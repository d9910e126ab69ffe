"""hf_cascade's environment variables that name a folder or turn something off: ``HF_CASCADE_CACHE`` (dequantised
GGUF weights, compile records), ``HF_CASCADE_RECORDS`` (compile records) and ``HF_CASCADE_BACKGROUND`` (background
builds of the compiled tier: :mod:`hf_cascade.tier_build`)."""

from __future__ import annotations

import os

__all__ = ["OFF_VALUES", "background_off", "cache_root", "is_off"]

# What turns a folder setting off (any case): `HF_CASCADE_CACHE=OFF` is not a folder named "OFF".
OFF_VALUES = frozenset({"off", "0", "false", "no"})


def is_off(value: str | None) -> bool:
    """Whether a folder setting (an environment variable or a ``cache_dir`` argument) says "off", in any case."""
    return isinstance(value, str) and value.strip().lower() in OFF_VALUES


def cache_root(cache_dir: str | None = None) -> str | None:
    """hf_cascade's cache folder: ``cache_dir``, else ``$HF_CASCADE_CACHE``, else ``~/.cache/hf_cascade`` (under
    ``$XDG_CACHE_HOME`` where set); None when the one given says off (:func:`is_off`)."""
    root = cache_dir or os.environ.get("HF_CASCADE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf_cascade"
    )
    return None if is_off(root) else root


def background_off() -> bool:
    """Whether ``HF_CASCADE_BACKGROUND`` says off (:func:`is_off`): no background build of the compiled tier starts
    (:mod:`hf_cascade.tier_build`); calls then move up and compile new shapes themselves by the ski rental. Read at
    every call."""
    return is_off(os.environ.get("HF_CASCADE_BACKGROUND"))
