"""``import hf_cascade`` registers ``"cascade"`` without importing transformers' model machinery.

transformers keeps its attention registry (``AttentionInterface``) in ``transformers.modeling_utils``, whose import
costs 2-4 s (it pulls in torch.distributed, dynamo, the quantizers). Every model load imports it anyway, so
``import hf_cascade`` does not: if that module is loaded already, ``"cascade"`` is registered at once; otherwise a
post-import hook on ``sys.meta_path`` registers it the moment the module has finished loading, before any model
can be built. Nothing else happens at import (the public names of :mod:`hf_cascade` are imported on first use).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings

TARGET = "transformers.modeling_utils"

_lock = threading.RLock()
_registered = False
_busy = False


def register() -> None:
    """Register ``"cascade"`` with transformers' attention and mask registries now (idempotent; imports
    ``transformers.modeling_utils``). ``import hf_cascade`` does this by itself, as soon as transformers' registry
    is loaded: call it only to register again (after something removed the entry). It starts nothing and sets
    nothing else (Triton is prepared at the first use: :func:`hf_cascade.ops._backend.prepare_triton`)."""
    global _registered, _busy
    with _lock:
        if _busy:
            return
        _busy = True
        try:
            from hf_cascade import attention

            attention.register()
            _registered = True
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


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the registration."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # leave no trace on the loaded module
        _register_after_load()

    def __getattr__(self, name):  # get_source, get_code, ... for tools that ask the loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        _remove_hook()  # one shot; the rest of the finders locate the module
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def register_when_loaded() -> None:
    """Register ``"cascade"`` now if transformers' registry is loaded, else as soon as it is (on its import)."""
    with _lock:
        if _registered:
            return
        module = sys.modules.get(TARGET)
        if module is not None and getattr(module, "AttentionInterface", None) is not None:
            register()
        elif _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
