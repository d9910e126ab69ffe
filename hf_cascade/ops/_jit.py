"""How hf_cascade's Triton kernels are specialised: the ``triton.jit`` options they share."""

from __future__ import annotations

import ast
import inspect

import triton

__all__ = ["jit_options", "settle_cache_keys"]

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


def _called_names(fn) -> set[str]:
    """The names a JIT function's source refers to (its callees among them)."""
    try:
        tree = ast.parse(fn.src)
    except (SyntaxError, TypeError, AttributeError):
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def settle_cache_keys(namespace: dict) -> None:
    """Compute the Triton cache key of every JIT function in ``namespace`` (a kernel module's globals), each after the
    JIT functions it calls: called at the end of every kernel module, before any launch.

    Triton (3.6 and earlier) folds into a function's key the global constants of the functions it calls as they are
    known when the key is first computed, and a callee whose key is not computed yet contributes none. A key then
    depends on which kernel a process hashed first: the background build's children (prefill kernels first) and the
    calling process (the fused decode kernel first) keyed ``_prefix_fwd_kernel``, ``_suffix_fwd_kernel`` and
    ``_cascade_fwd_kernel`` apart and the calls built again variants the children had built (``fn_key`` in
    ``benchmarks/results/stall.jsonl``, H200, ``e734fe7``; reproduced on the CPU, ``tests/test_kernel_keys.py``).
    Settling callees first gives every process the same keys. Nothing under the interpreter (no keys)."""
    from triton.runtime.jit import JITFunction

    settled: set[int] = set()

    def settle(fn, visiting: set[int]) -> None:
        if id(fn) in settled or id(fn) in visiting:
            return
        visiting.add(id(fn))
        for name in sorted(_called_names(fn)):
            callee = fn.__globals__.get(name)
            if isinstance(callee, JITFunction):
                settle(callee, visiting)
        fn.cache_key  # noqa: B018 (computed now, callees first; Triton keeps it)
        settled.add(id(fn))

    for _, fn in sorted(namespace.items()):
        if isinstance(fn, JITFunction):
            try:
                settle(fn, set())
            except Exception:  # noqa: BLE001 (another Triton's internals: its keys are computed at launch, as before)
                return
