"""How hf_cascade's Triton kernels are specialised: the ``triton.jit`` options they share."""

from __future__ import annotations

import inspect

import triton

__all__ = ["jit_options"]

_ALIGNMENT_OPTION = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def jit_options(*, not_specialised=(), not_aligned=()) -> dict:
    """``triton.jit`` keyword arguments of a kernel.

    Triton builds a variant of a kernel for each pattern of its int arguments (== 1, divisible by 16), a second or so
    each with an empty cache, and a warm cache only holds the patterns some earlier call launched.

    Args:
        not_specialised: ints with no variant at all (sizes of the batch layout that never help the code).
        not_aligned: ints that keep their == 1 variant (a decode step's one query) but get none for "divisible by
            16": the query length and the batch rows, and the strides that carry them (an LSE or state array's
            strides). Otherwise a warm cache filled by 64-token suffixes misses 40-token ones, and 32 rows miss 7
            (``benchmarks/NOTES.md``). A Triton without the option keeps them specialised.
    """
    options = {"do_not_specialize": list(not_specialised)}
    if _ALIGNMENT_OPTION and not_aligned:
        options["do_not_specialize_on_alignment"] = list(not_aligned)
    return options
