"""Which Triton kernel variants a process builds, and how a variant a call built differs from those built before.

Diagnostics for ``bench_stall.py``: a call of a new layout that builds a Triton kernel stalls (1-3 s a kernel on an
H100), although the background grid (``hf_cascade/build_grid.py``) ran layouts meant to build them ahead. To see
which specialisation the grid missed, every process of the run (the bench and, through ``variant_hook/``'s
``sitecustomize``, the grid's child processes) appends one JSON line per kernel it compiles or loads to the file
named by ``$HF_CASCADE_VARIANT_LOG``: its pid, the kernel's name and argument names, Triton's cache key (the
specialisation of every argument, constexprs included, and the launch options), the hash the variant has on disk
and the disk cache's folder. :func:`closest_difference` then
names the arguments in which a call's variant differs from the nearest variant another process built.

Nothing here runs unless the variable is set; the hooks wrap ``JITFunction._do_compile`` (Triton's build-or-load of
a variant missing from its in-memory cache).
"""

from __future__ import annotations

import json
import os
import re
import time

ENV = "HF_CASCADE_VARIANT_LOG"
_ELEMENT = re.compile(r"\((?:[^()]|\([^()]*\))*\)")  # one top-level "(...)" of the key's specialisation list


def install(path: str | None = None) -> bool:
    """Log every variant this process compiles or loads to ``path`` (default ``$HF_CASCADE_VARIANT_LOG``); returns
    whether the hook is in place (False: no path, or no Triton)."""
    path = path or os.environ.get(ENV)
    if not path:
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    original = JITFunction._do_compile
    if getattr(original, "_variant_log", None) == path:
        return True

    def logged(self, key, *args, **kwargs):
        started, kernel = time.perf_counter(), None
        try:
            kernel = original(self, key, *args, **kwargs)
            return kernel
        finally:
            entry = {"pid": os.getpid(), "name": getattr(self, "__name__", "?"),
                     "arg_names": list(getattr(self, "arg_names", []) or []), "key": str(key),
                     "s": round(time.perf_counter() - started, 3), "t": time.time(),
                     "disk_hash": getattr(kernel, "hash", None), "cache_dir": _cache_dir(),
                     "launched_from": _launch_path(), **_disk_key_parts(self, kernel)}
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    logged._variant_log = path
    JITFunction._do_compile = logged
    return True


def _launch_path(depth: int = 8) -> list[str]:
    """The hf_cascade frames of the launch that built a variant, innermost first (``file:line function``): which
    forward (a shared node's, the rows') and which path (compiled layers, eager layers, recorded step) asked for it.
    Not compared between variants (:func:`difference`); read beside them."""
    import traceback

    frames = [f for f in traceback.extract_stack()[::-1] if "hf_cascade" in f.filename and "/ops/_" not in f.filename]
    return [f"{f.filename.split('hf_cascade/')[-1]}:{f.lineno} {f.name}" for f in frames[:depth]]


def _cache_dir() -> str | None:
    """The folder Triton's disk cache uses in this process now."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except Exception:  # noqa: BLE001 (an older Triton: the environment)
        return os.environ.get("TRITON_CACHE_DIR")


def _disk_key_parts(fn, kernel) -> dict:
    """What Triton hashes into a variant's key on disk besides its JIT key: the source's hash (``fn_key``, with the
    sources of what it calls), the cache-invalidating environment (``env_vars``) and the compiled options and target
    (``metadata``, e.g. ``extern_libs``, ``debug``, the PTX version), the backend's hash (the ``ptxas`` version) and
    the ``ptxas`` in use. Empty parts where this Triton has none."""
    parts = {}
    try:
        parts["fn_key"] = str(fn.cache_key)[-24:]
    except Exception:  # noqa: BLE001
        pass
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        parts["env_vars"] = dict(sorted(get_cache_invalidating_env_vars().items()))
    except Exception:  # noqa: BLE001
        pass
    try:  # the ptxas version (Triton reads it once per process, at its first build) and its path
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        parts["backend_hash"] = make_backend(driver.active.get_current_target()).hash()
        from triton import knobs

        parts["ptxas"] = str(getattr(knobs.nvidia.ptxas, "path", knobs.nvidia.ptxas))
    except Exception:  # noqa: BLE001
        pass
    metadata = getattr(kernel, "metadata", None)
    if metadata is not None and hasattr(metadata, "_asdict"):
        skip = {"hash", "name", "shared", "tmem_size", "global_scratch_size", "profile_scratch_size", "num_ctas"}
        parts["metadata"] = {k: str(v)[:160] for k, v in metadata._asdict().items() if k not in skip}
    return parts


def read(path: str) -> list[dict]:
    """The entries of a variant log (none where it does not exist)."""
    return LogReader(path).new_entries()


class LogReader:
    """Reads a variant log as it grows: each :meth:`new_entries` returns the complete lines written since the last
    (a line another process is still writing waits for the next read)."""

    def __init__(self, path: str):
        self.path, self._offset, self.entries = path, 0, []

    def new_entries(self) -> list[dict]:
        """The entries added since the last call (also appended to :attr:`entries`)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.entries += new
        return new


def key_elements(key: str) -> tuple[list[str], str]:
    """Triton's cache key split into its per-argument specialisations (in argument order) and the rest (the launch
    options)."""
    end = key.find("]")
    head = key[: end + 1] if key.startswith("[") and end >= 0 else ""
    return _ELEMENT.findall(head), key[len(head):]


def difference(new: dict, old: dict) -> dict:
    """``{argument name: [old, new]}`` where two entries of one kernel specialise an argument differently, plus
    ``"options"`` where the launch options differ."""
    new_args, new_options = key_elements(new["key"])
    old_args, old_options = key_elements(old["key"])
    names = new.get("arg_names") or []
    out = {}
    for i in range(max(len(new_args), len(old_args))):
        a = old_args[i] if i < len(old_args) else None
        b = new_args[i] if i < len(new_args) else None
        if a != b:
            out[names[i] if i < len(names) else f"arg{i}"] = [a, b]
    if new_options != old_options:
        out["options"] = [old_options[:300], new_options[:300]]
    for field in ("disk_hash", "cache_dir", "fn_key", "env_vars", "backend_hash", "ptxas"):  # the same variant, keyed or kept elsewhere
        if new.get(field) and old.get(field) and new[field] != old[field]:
            out[field] = [old[field], new[field]]
    if new.get("metadata") and old.get("metadata"):
        for key in sorted(set(new["metadata"]) | set(old["metadata"])):
            if new["metadata"].get(key) != old["metadata"].get(key):
                out[f"metadata.{key}"] = [old["metadata"].get(key), new["metadata"].get(key)]
    return out


def nearest_differences(new: dict, others: list[dict], count: int = 2) -> list[dict]:
    """How ``new`` differs from the ``count`` entries of the same kernel in ``others`` closest to it (fewest
    differing arguments first), each with the call paths that launched the two (``launched_from``) where either
    entry records one; [] where ``others`` holds none of that kernel."""
    ranked = sorted(((difference(new, old), old) for old in others if old["name"] == new["name"]),
                    key=lambda pair: len(pair[0]))
    out = []
    for diff, old in ranked[:count]:
        if diff and (old.get("launched_from") or new.get("launched_from")):
            diff = {**diff, "launched_from": [old.get("launched_from"), new.get("launched_from")]}
        out.append(diff)
    return out


def closest_difference(new: dict, others: list[dict]) -> dict | None:
    """How ``new`` differs from the entry of the same kernel in ``others`` closest to it (:func:`nearest_differences`),
    or None where ``others`` holds none of that kernel."""
    nearest = nearest_differences(new, others, 1)
    return nearest[0] if nearest else None
