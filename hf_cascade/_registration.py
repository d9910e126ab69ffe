"""``import hf_cascade`` registers ``"cascade"`` without importing transformers' model machinery.

transformers keeps its attention registry (``AttentionInterface``) in ``transformers.modeling_utils``, whose import
costs 2-4 s (it pulls in torch.distributed, dynamo, the quantizers). Every model load imports it anyway, so
``import hf_cascade`` does not: if that module is loaded already, ``"cascade"`` is registered at once; otherwise a
post-import hook on ``sys.meta_path`` registers it the moment the module has finished loading, before any model
can be built. Nothing else happens at import (the public names of :mod:`hf_cascade` are imported on first use).

Models whose constructor looks ``attn_implementation`` up in a table of their own (:data:`OWN_ATTENTION_TABLES`)
get a ``"cascade"`` entry that refuses clearly; such a module imports transformers' registry itself, so it is still
half-built when the registration runs: a post-import hook of its own adds the entry once it has finished loading.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings

from hf_cascade._own_attention_tables import OWN_ATTENTION_TABLES

TARGET = "transformers.modeling_utils"

_lock = threading.RLock()
_busy = False  # register() is running (its imports can come back to it on the same thread)


def register() -> None:
    """Register ``"cascade"`` with transformers' attention and mask registries now (idempotent; imports
    ``transformers.modeling_utils``). ``import hf_cascade`` does this by itself, as soon as transformers' registry
    is loaded: call it only to register again (after something removed the entry). It starts nothing and sets
    nothing else (Triton is prepared at the first use: :func:`hf_cascade.ops._backend.prepare_triton`)."""
    global _busy
    with _lock:
        if _busy:
            return
        _busy = True
        try:
            from hf_cascade import attention

            attention.register()
        finally:
            _busy = False


def _register_after_load() -> None:
    attention = sys.modules.get("hf_cascade.attention")
    if attention is not None and not hasattr(attention, "register"):
        return  # transformers' registry was loaded by hf_cascade.attention's own imports: it registers at its end
    try:
        register()
    except Exception as err:  # never break transformers' own import; the model load then names the missing impl
        warnings.warn(f"hf_cascade could not register attn_implementation='cascade': {err!r}", stacklevel=2)


def _refuse_in_table_after_load(module) -> None:
    """A model module with its own attention table has finished loading: give the table its refusing entry."""
    try:
        from hf_cascade import attention

        refuse = getattr(attention, "refuse_in_own_tables", None)
        if refuse is not None:  # else hf_cascade.attention is half-built: its register() at its end does it
            refuse()
    except Exception as err:  # never break transformers' own import; the load then fails with transformers' error
        warnings.warn(f"hf_cascade could not refuse attn_implementation='cascade' for {module.__name__}: {err!r}",
                      stacklevel=2)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then ``after_load(module)``."""

    def __init__(self, loader, after_load):
        self._loader = loader
        self._after_load = after_load

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # leave no trace on the loaded module
        self._after_load(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tools that ask the loader
        return getattr(self._loader, name)


_PENDING: dict = {}  # module name -> what to run once it has loaded (one shot each)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        after_load = _PENDING.pop(fullname, None)  # (no lock: an import may run under another thread's lock)
        if after_load is None:
            return None
        if not _PENDING:
            _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, after_load)
        return spec


_FINDER = _Finder()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def _when_loaded(name: str, after_load) -> None:
    """Run ``after_load(module)`` once the module ``name`` (not imported yet) has finished loading."""
    _PENDING[name] = after_load
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def register_when_loaded() -> None:
    """Register ``"cascade"`` now if transformers' registry is loaded, else as soon as it is (on its import)."""
    with _lock:
        for name, _, _ in OWN_ATTENTION_TABLES:
            if name not in sys.modules:  # (a loaded one is given its entry by register())
                _when_loaded(name, _refuse_in_table_after_load)
        module = sys.modules.get(TARGET)
        interface = getattr(module, "AttentionInterface", None)
        if interface is not None and "cascade" in interface():
            return  # registered already
        if interface is not None:
            register()
        else:
            _when_loaded(TARGET, lambda module: _register_after_load())
