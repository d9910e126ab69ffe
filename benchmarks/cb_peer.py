"""transformers' continuous batching, ``model.generate_batch``, as a benchmark peer (issue 51).

``generate_batch(inputs=[token lists], generation_config=...)`` keeps the KV in pages of a pool allocated up front,
hashes every full page of a prompt and, with prefix sharing (``ContinuousBatchingConfig.allow_block_sharing``, on by
default), lets a later request reference a page another request completed instead of prefilling it again. Each decode
step still reads every row's pages.

Two configurations (:data:`CB_CONFIGS`), read from transformers' own sources (5.17 and 5.24) and its guide
``docs/source/en/continuous_batching.md``:

* ``defaults``: the call as a user first makes it, ``generate_batch(inputs, generation_config)`` on a model loaded the
  way ``from_pretrained`` loads it (``sdpa``). With sdpa the manager switches the model to ``"paged|sdpa"`` (5.17;
  5.24 keeps ``"sdpa"``), or to flash attention where flash-attn is installed
  (``ContinuousBatchingManager.switch_to_cb_friendly_attn``). CUDA graphs and async batching are then off
  (``initialization.decide_use_cuda_graphs`` / ``decide_use_async_batching``: off where an attention mask is
  needed), no torch.compile (``default_compile_level=0``), ``max_batch_tokens`` 8192, pages of 256 tokens, a pool of
  90% of the free GPU memory (``max_memory_percent``; 80% with logits processors).
* ``best``: the guide's fast settings a user can apply without other packages: flash attention where it is
  installed (``attn_implementation="flash_attention_2"``, which also enables the ``flash_attn_with_kvcache`` decode
  fast path), else sdpa; ``use_cuda_graph=True`` ("CUDA graphs eliminate CPU dispatch overhead"); and
  ``use_async_batching=True`` ("overlaps CPU scheduling of the next batch with GPU computation", needs CUDA graphs).
  Not in it: ``default_compile_level`` (1-3: torch.compile, minutes of warm-up on an 8B model; pass it with
  ``settings=``), a larger ``max_batch_tokens`` (more prompts per prefill step, but prompts prefilled in the same step
  cannot share pages not yet complete).
* ``best_persistent`` (not run by default): ``best`` + ``generate_batch(..., persistent_manager=True)`` (its
  docstring; the guide: "cache the manager on the model for the next session"): a later call skips the manager's
  set-up and CUDA-graph warm-up, and finds the pages of prompts an earlier call completed (a prompt cache across
  calls, which the other peers do not have). The cached manager is destroyed after the configuration's calls.

A setting the installed ``ContinuousBatchingConfig`` lacks is recorded in ``settings_unsupported``, not passed.
:class:`PagedCacheObserver` reads (never changes) the paged cache while a call runs: the pool's bytes, the pages in
use at the peak, the prompt tokens served from shared pages, and the resolved configuration.

    python benchmarks/cb_peer.py --tiny                 # fp32 tokens check on CPU (about 10 s)
    python benchmarks/cb_peer.py --tiny --device cuda   # the same check on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time

import torch

CB_CONFIGS = {
    "defaults": {"attn": "sdpa", "settings": {},
                 "call": "generate_batch(inputs, generation_config) on an sdpa model"},
    "best": {"attn": "flash", "settings": {"use_cuda_graph": True, "use_async_batching": True},
             "call": "flash attention where installed (else sdpa) + ContinuousBatchingConfig(use_cuda_graph=True, "
                     "use_async_batching=True)"},
    "best_persistent": {"attn": "flash", "settings": {"use_cuda_graph": True, "use_async_batching": True,
                                                      "persistent_manager": True},
                        "call": "best + generate_batch(..., persistent_manager=True): the next call reuses the "
                                "manager, its CUDA graphs and the pages its prompts left in the pool"},
}

# A small pool for tiny models (the default pool is 90% of free memory) and pages small enough that short prompts
# fill some: one prompt's pages per prefill step, so that later requests find them complete and share them.
TINY_POOL = {"page_size": 16, "num_blocks": 256, "max_batch_tokens": 256}


def _cuda() -> bool:
    return torch.cuda.is_available()


def _reset_memory() -> None:
    gc.collect()
    if _cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed(fn):
    if _cuda():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if _cuda():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def resolve_attention(attn: str) -> tuple[str, str]:
    """``(implementation to set on the model, note)``; ``"flash"``: flash attention 3 or 2 where importable (the
    packages only: transformers' hub-kernel fallback needs the network), else sdpa."""
    if attn != "flash":
        return attn, ""
    from transformers.utils import import_utils

    for version in (3, 2):
        check = getattr(import_utils, f"is_flash_attn_{version}_available", None)
        try:
            if check is not None and check():
                return f"flash_attention_{version}", ""
        except Exception:  # noqa: BLE001 (a broken flash install is "not available")
            pass
    return "sdpa", "flash attention not installed (flash-attn / flash_attn_interface): sdpa"


def make_cb_config(settings: dict):
    """``(ContinuousBatchingConfig or None, applied, unsupported)`` for ``settings``; ``page_size`` and ``block_size``
    (its name in 5.17) are one setting, passed under the name the installed class has."""
    if not settings:
        return None, {}, {}
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        return None, {}, {key: "no ContinuousBatchingConfig in this transformers" for key in settings}
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_name = "page_size" if "page_size" in fields else "block_size"
    applied, unsupported = {}, {}
    for key, value in settings.items():
        name = page_name if key in ("page_size", "block_size") else key
        if name in fields:
            applied[name] = value
        else:
            unsupported[key] = "not a ContinuousBatchingConfig field in this transformers"
    return ContinuousBatchingConfig(**applied), applied, unsupported


def _storage_bytes(obj) -> int:
    """Bytes of the distinct tensor storages held by ``obj``'s attributes (tensors, lists of tensors)."""
    seen, total = set(), 0
    for value in vars(obj).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for t in items:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _free_units(cache):
    """``(free units, total units)`` of the pool: blocks (5.17: ``_block_manager``) or sectors (5.24: ``pool``)."""
    manager = getattr(cache, "_block_manager", None)
    if manager is not None and hasattr(manager, "num_free_blocks"):
        return manager.num_free_blocks, cache.num_blocks
    pool = getattr(cache, "pool", None)
    if pool is not None and hasattr(pool, "num_free_sectors"):
        return pool.num_free_sectors, cache.num_sectors
    return None


_RESOLVED = ("use_cuda_graph", "use_async_batching", "max_batch_tokens", "num_blocks", "page_size", "block_size",
             "max_blocks_per_request", "max_requests_per_batch", "max_memory_percent", "default_compile_level",
             "varlen_compile_config", "decode_compile_config", "allow_block_sharing", "scheduler_type",
             "auto_switch_to_flash")


class PagedCacheObserver:
    """While a ``generate_batch`` call runs: read-only wrappers around ``PagedAttentionCache`` methods (removed on
    exit) that record the pool's bytes, the resolved config, the attention implementation in use, the fewest free
    pool units seen (pages in use at the peak) and the prompt tokens served from shared pages."""

    _ALLOCATIONS = ("allocate_blocks", "can_store_request_tokens", "fork_request")

    def __init__(self, model):
        self.model, self.saved, self.errors = model, [], []
        self.pool_bytes = self.pool_bytes_delta = 0
        self.min_free = self.total_units = None
        self.prefix_tokens_reused = 0
        self.resolved, self.attention = {}, None

    def __enter__(self):
        from transformers.generation.continuous_batching import cache as cache_module

        cls = cache_module.PagedAttentionCache
        self._wrap(cls, "__init__", self._after_init, before=self._before_init)
        for name in self._ALLOCATIONS:
            self._wrap(cls, name, self._after_allocation)
        self._wrap(cls, "search_prefix_match", self._after_match)
        return self

    def __exit__(self, *exc):
        for cls, name, original in reversed(self.saved):
            setattr(cls, name, original)
        self.saved.clear()

    def _wrap(self, cls, name, after, before=None):
        original = cls.__dict__.get(name)
        if original is None:
            return

        @functools.wraps(original)
        def wrapper(cache, *args, **kwargs):
            state = before() if before is not None else None
            result = original(cache, *args, **kwargs)
            try:
                after(cache, result, state, kwargs)
            except Exception as err:  # noqa: BLE001 (an observer never breaks the call)
                self.errors.append(f"{name}: {err!r}"[:200])
            return result

        setattr(cls, name, wrapper)
        self.saved.append((cls, name, original))

    def new_call(self) -> None:
        """The counts of the next call only (a persistent manager keeps its pool: no new ``__init__``, the pool's
        bytes stay as recorded). The observer keeps no reference to a cache: its pool goes with its manager."""
        self.prefix_tokens_reused, self.min_free = 0, None

    def _before_init(self):
        return torch.cuda.memory_allocated() if _cuda() else 0

    def _after_init(self, cache, result, allocated_before, kwargs):
        self.pool_bytes = _storage_bytes(cache)
        self.pool_bytes_delta = (torch.cuda.memory_allocated() - allocated_before) if _cuda() else None
        config = kwargs.get("continuous_batching_config")
        self.resolved = {k: _plain(getattr(config, k)) for k in _RESOLVED if hasattr(config, k)}
        self.resolved.update({k: _plain(getattr(cache, k)) for k in ("max_batch_tokens", "num_blocks")
                              if hasattr(cache, k)})
        self.resolved["use_prefix_sharing"] = getattr(cache, "use_prefix_sharing", None)
        self.attention = self.model.config._attn_implementation
        units = _free_units(cache)
        if units is not None:
            self.min_free, self.total_units = units

    def _after_allocation(self, cache, result, state, kwargs):
        units = _free_units(cache)
        if units is not None:
            self.min_free = units[0] if self.min_free is None else min(self.min_free, units[0])

    def _after_match(self, cache, result, state, kwargs):
        """``search_prefix_match`` returns the prompt tokens found in complete shared pages (both versions)."""
        if isinstance(result, int):
            self.prefix_tokens_reused += result
        self._after_allocation(cache, result, state, kwargs)

    def summary(self) -> dict:
        used = None
        if self.min_free is not None and self.total_units:
            # pool bytes less the trash units (2 blocks in 5.17, 2 sectors in 5.24)
            unit = self.pool_bytes / (self.total_units + 2)
            used = (self.total_units - self.min_free) * unit
        return {"kv_pool_gib": self.pool_bytes / 2**30,
                "kv_pool_alloc_gib": None if self.pool_bytes_delta is None else self.pool_bytes_delta / 2**30,
                "kv_used_peak_gib": None if used is None else used / 2**30,
                "prefix_tokens_reused": self.prefix_tokens_reused,
                "attention_in_call": self.attention, "resolved": self.resolved,
                **({"observer_errors": self.errors} if self.errors else {})}


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _outputs(out: dict, rows: list[list[int]]) -> tuple[list[list[int]], str | None]:
    """The generated tokens in the order of ``rows`` (generate_batch returns its dict in input order) and a problem
    (missing or failed requests, another prompt order), or None."""
    outputs = list(out.values())
    tokens = [list(o.generated_tokens) for o in outputs]
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    if errors:
        return tokens, f"error: {len(errors)} requests failed: {str(errors[0])[:300]}"
    if len(outputs) != len(rows):
        return tokens, f"error: {len(outputs)} of {len(rows)} requests came back"
    if any(list(o.prompt_ids) != list(r) for o, r in zip(outputs, rows) if getattr(o, "prompt_ids", None)):
        return tokens, "error: the outputs do not follow the inputs' order"
    return tokens, None


_CUDA_ONLY = ("use_cuda_graph", "use_async_batching")
# A configuration other than the defaults that runs out of memory is tried once more with a smaller pool (the guide's
# ``max_memory_percent``): CUDA graphs' warm-up reads the whole pool, beyond what the pool's sizing accounts for.
OOM_RETRY_MEMORY_PERCENT = 0.7


def run_generate_batch(model, rows: list[list[int]], generation_config, config: str = "defaults", *, calls: int = 1,
                       settings: dict | None = None, attn: str | None = None) -> dict:
    """``model.generate_batch(inputs=rows, generation_config=...)`` in configuration ``config`` of
    :data:`CB_CONFIGS`, ``calls`` times (each call builds its own manager and pool, as generate_batch does).

    ``settings`` add to / override the configuration's ContinuousBatchingConfig settings; ``attn`` its attention
    (``"flash"``: flash where installed, else sdpa). The model's attention implementation is restored after.
    Returns the record: ``calls_s`` (each call), ``first_call_s``, ``total_s`` (the last call), ``peak_gib`` (the last
    call), the observer's pool / in-use KV and reuse (:meth:`PagedCacheObserver.summary`), what was requested,
    applied and unsupported, ``status``, and ``new_tokens`` (lists, the last call's) for the caller to pop. Out of
    memory outside the defaults: once more with ``max_memory_percent`` :data:`OOM_RETRY_MEMORY_PERCENT`
    (``retried_after`` says so)."""
    record = _run_config(model, rows, generation_config, config, calls, settings, attn)
    if config != "defaults" and "out of memory" in record["status"] and "max_memory_percent" not in (settings or {}):
        first = record["status"]
        record = _run_config(model, rows, generation_config, config, calls,
                             {**(settings or {}), "max_memory_percent": OOM_RETRY_MEMORY_PERCENT}, attn)
        record["retried_after"] = first
    return record


# generate_batch's own keyword arguments (its docstring) that a configuration may set, beside the config's fields.
CALL_KWARGS = ("warmup", "persistent_manager")


def _call_kwargs(model, settings: dict) -> tuple[dict, dict]:
    """``(generate_batch keyword arguments, unsupported)`` taken out of ``settings``."""
    import inspect

    params = inspect.signature(model.generate_batch).parameters
    kwargs, unsupported = {}, {}
    for key in [k for k in settings if k in CALL_KWARGS]:
        value = settings.pop(key)
        if key in params:
            kwargs[key] = value
        else:
            unsupported[key] = "not a generate_batch argument in this transformers"
    return kwargs, unsupported


def _run_config(model, rows, generation_config, config: str, calls: int, settings: dict | None, attn) -> dict:
    spec = CB_CONFIGS[config]
    settings = {**spec["settings"], **(settings or {})}
    impl, attn_note = resolve_attention(attn or spec["attn"])
    record = {"peer": f"generate_batch_{config}", "cb_config": config, "cb_call": spec["call"],
              "attn_requested": attn or spec["attn"], "attn_set": impl, "settings_requested": dict(settings),
              "rows": len(rows), "calls": calls}
    if model.device.type != "cuda":  # async batching refuses other devices; CUDA graphs are turned off there
        record["settings_not_on_this_device"] = {k: settings.pop(k) for k in _CUDA_ONLY if k in settings}
    if attn_note:
        record["attn_note"] = attn_note
    call_kwargs, call_unsupported = _call_kwargs(model, settings)
    previous = model.config._attn_implementation
    calls_s, tokens, seen = [], None, PagedCacheObserver(model)
    try:
        model.set_attn_implementation(impl)
        with seen:
            for _ in range(calls):
                cb_config, applied, unsupported = make_cb_config(settings)
                record.update(settings_applied={**applied, **call_kwargs},
                              settings_unsupported={**unsupported, **call_unsupported})
                kwargs = {**call_kwargs, **({} if cb_config is None else {"continuous_batching_config": cb_config})}
                _reset_memory()
                seen.new_call()
                seconds, out = _timed(lambda: model.generate_batch(
                    inputs=rows, generation_config=generation_config, **kwargs))
                calls_s.append(seconds)
                record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if _cuda() else None
                tokens, problem = _outputs(out, rows)
                del out
                if problem:
                    record["status"] = problem
                    break
        record.setdefault("status", "ok")
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    except Exception as err:  # noqa: BLE001 (a peer failing must not hide the others' numbers)
        record["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
    finally:
        if call_kwargs.get("persistent_manager"):  # its pool goes with it, before the next peer
            model.destroy_cached_continuous_batching_manager()
        model.set_attn_implementation(previous)
        _reset_memory()
    record.update(seen.summary())
    record["kv_gib"] = record["kv_used_peak_gib"]  # the pages it used; the pool it held: kv_pool_gib
    if calls_s:
        record.update(calls_s=[round(s, 4) for s in calls_s], first_call_s=calls_s[0], total_s=calls_s[-1])
    record["new_tokens"] = tokens
    return record


def greedy_config(new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def sampling_config(new_tokens: int, top_k: int = 50):
    """bench_generate's sampling peers' settings (``do_sample=True, top_k=50``), never stopping early."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=True, top_k=top_k, eos_token_id=None, pad_token_id=0)


def _check_batches(vocab: int) -> dict:
    """Equal-length rows (generate() needs no padding): a shared prompt, a two-level tree, samples of one prompt."""
    g = torch.Generator().manual_seed(51)
    tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = tok(200)
    top, docs = tok(48), [tok(64), tok(64)]
    prompt = tok(150)
    return {"shared": [shared + tok(6) for _ in range(6)],
            "tree": [top + docs[r // 4] + tok(4) for r in range(8)],
            "samples": [list(prompt) for _ in range(4)]}


def tokens_check(device: str = "cpu", configs=("defaults", "best"), new_tokens: int = 8, layers: int = 2) -> dict:
    """fp32, greedy, a tiny random Llama: generate()'s tokens (sdpa), hf_cascade's (``custom_generate``, sharing
    forced: ``cost_model=None``) and generate_batch's in each of ``configs`` (with :data:`TINY_POOL`); ``passed``
    when all are equal. Records the prompt tokens generate_batch served from shared pages per batch."""
    import hf_cascade
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", attn_implementation="sdpa", seed=0, device=device, num_hidden_layers=layers)
    model.generation_config.eos_token_id = None
    record = {"bench": "cb_tokens_check", "device": device, "dtype": "float32", "layers": layers,
              "new_tokens": new_tokens, "pool_settings": TINY_POOL, "batches": {}}
    passed = True
    for name, rows in _check_batches(model.config.vocab_size).items():
        ids = torch.tensor(rows, device=device)
        gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
        model.set_attn_implementation("sdpa")
        want = model.generate(ids, **gen)[:, ids.shape[1]:].tolist()
        model.set_attn_implementation("cascade")
        caches = []
        got = model.generate(ids, **gen, custom_generate=hf_cascade.generate, cascade_caches=caches,
                             cascade_options=dict(cost_model=None))[:, ids.shape[1]:].tolist()
        model.set_attn_implementation("sdpa")
        entry = {"rows": len(rows), "prompt_tokens": ids.shape[1], "hf_cascade_equal": got == want,
                 "hf_cascade_levels": caches[-1].num_levels if caches else None}
        for config in configs:
            result = run_generate_batch(model, rows, greedy_config(new_tokens), config, settings=TINY_POOL)
            entry[f"generate_batch_{config}_equal"] = result["new_tokens"] == want
            entry[f"generate_batch_{config}_status"] = result["status"]
            entry[f"generate_batch_{config}_prefix_tokens_reused"] = result.get("prefix_tokens_reused")
            entry[f"generate_batch_{config}_attention"] = result.get("attention_in_call")
        passed &= all(v for k, v in entry.items() if k.endswith("_equal"))
        record["batches"][name] = entry
    record["passed"] = bool(passed)
    return record


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the fp32 tokens check on a tiny model (the only mode)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", nargs="+", default=list(CB_CONFIGS), choices=list(CB_CONFIGS))
    parser.add_argument("--output", default=None, help="append the record (JSON lines) to this file")
    args = parser.parse_args(argv)
    record = tokens_check(args.device, tuple(args.configs))
    print(json.dumps(record, indent=1))
    if args.output:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import ResultWriter

        ResultWriter(os.path.basename(args.output), args.output).write(record)
    return record


if __name__ == "__main__":
    main()
