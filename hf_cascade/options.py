"""``CascadeOptions``: the ``cascade_options`` of one ``hf_cascade.generate`` call, validated once, passed down whole.

Every value is checked by type when the call starts (a ValueError names the option, what it got and what it takes);
the rest of the call reads fields, never the user's dict. The meaning of each option is documented on
:func:`hf_cascade.generate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hf_cascade.cpu_threads import DEFAULT_CPU_DECODE_THREADS, check_threads

__all__ = ["COMPILE_CHOICES", "DECODE_STEPS", "CascadeOptions"]

# "auto": the tiers (hf_cascade.tiers) on CUDA, "layers" elsewhere; the others name one decode step (benchmarks,
# and users who want one): "layers" (recorded, decoder layers compiled), "graphs" (recorded, eager layers),
# "compile" (transformers' compiled step), "eager".
DECODE_STEPS = ("auto", "compile", "layers", "graphs", "eager")
# When the decoder layers compile (hf_cascade.tiers): by the ski rental, from the first call, never.
COMPILE_CHOICES = ("auto", "now", "never")


@dataclasses.dataclass(frozen=True)
class CascadeOptions:
    """The validated options (defaults: what a call without ``cascade_options`` does)."""

    min_shared_tokens: int = 4
    min_rows: int = 2
    max_levels: int = 4
    cost_model: Any = "auto"  # "auto", None or a CascadeCostModel
    fixed_buffers: bool | None = None
    batch_buckets: bool | None = None
    defer_stop_check: bool | None = None
    decode_step: str = "auto"
    compile_prefill: bool | None = None
    cpu_decode_threads: Any = DEFAULT_CPU_DECODE_THREADS  # "auto", None or an int >= 1
    compile: str = "auto"

    @classmethod
    def from_user(cls, cascade_options) -> "CascadeOptions":
        """Validate the user's ``cascade_options`` (None or a mapping of option name -> value).

        Raises:
            ValueError: not a mapping, an unknown name, or a value of the wrong type (the message names it).
        """
        if cascade_options is None:
            return cls()
        if not isinstance(cascade_options, Mapping):
            raise ValueError(
                f"`cascade_options` must be a dict of option name -> value, e.g. {{'min_shared_tokens': 8}}; got "
                f"{type(cascade_options).__name__} {cascade_options!r}."
            )
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = set(cascade_options) - names
        if unknown:
            raise ValueError(f"`cascade_options` takes {sorted(names)}; got unknown {sorted(unknown, key=str)}.")
        for name, value in cascade_options.items():
            _check(name, value)
        return cls(**cascade_options)

    def user_dict(self) -> dict:
        """The options that differ from the defaults, as a user's ``cascade_options`` (a background build's call)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) != field.default}

    def planning(self) -> dict:
        """The keyword arguments of :func:`~hf_cascade.inputs.plan_cascade_batch` that plan the prefix tree."""
        return {"min_shared_tokens": self.min_shared_tokens, "min_rows": self.min_rows,
                "max_levels": self.max_levels, "cost_model": self.cost_model}


def _check(name: str, value) -> None:
    from hf_cascade.cost_model import CascadeCostModel

    where = f"`cascade_options['{name}']`"
    if name in ("min_shared_tokens", "min_rows", "max_levels"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an int; got {type(value).__name__} {value!r}.")
    elif name in ("fixed_buffers", "batch_buckets", "defer_stop_check", "compile_prefill"):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{where} must be None, True or False; got {type(value).__name__} {value!r}.")
    elif name == "cost_model":
        auto = isinstance(value, str) and value == "auto"
        if value is not None and not auto and not isinstance(value, CascadeCostModel):
            raise ValueError(f"{where} must be 'auto', None or a CascadeCostModel; got {value!r}.")
    elif name == "decode_step" and (not isinstance(value, str) or value not in DECODE_STEPS):
        raise ValueError(f"{where} must be one of {list(DECODE_STEPS)}; got {value!r}.")
    elif name == "compile" and (not isinstance(value, str) or value not in COMPILE_CHOICES):
        raise ValueError(f"{where} must be one of {list(COMPILE_CHOICES)}; got {value!r}.")
    elif name == "cpu_decode_threads":
        check_threads(value)
