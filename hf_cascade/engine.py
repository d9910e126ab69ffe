"""One :class:`Engine` per model: everything hf_cascade keeps for a model between generate() calls, in one object.

:func:`engine_of` creates it on a model's first use and keeps it as one attribute of the model (``model.__dict__``,
not a submodule: it is in no ``state_dict``, ``children()`` or ``repr``). It is tied to the model weakly: it holds no
reference to the model (only a weak one, to tell a copy from the original), so it is freed with the model. A copy of
the model gets an engine of its own on first use: ``copy.deepcopy`` and pickling (``torch.save``) carry ``None`` in
its place (nothing of this process's state travels, and unpickling needs no hf_cascade), and a shallow
``copy.copy``, which shares the attribute, finds the engine belongs to another model and replaces it.

Each part is created when first read, by the module that owns it (``engine_of(model).part("graphs", _ModelGraphs)``):
the classes stay in the modules that use them, and this module imports nothing from hf_cascade (they import it).
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["Engine", "PARTS", "engine_of"]

_ATTRIBUTE = "_hf_cascade_engine"
_CREATE_LOCK = threading.Lock()


# The parts, by name; each is created by the module that owns it, which passes its class to Engine.part.
PARTS = ("tiers", "scan", "step_buffers", "layer_calls", "graphs")


class Engine:
    """What hf_cascade keeps for one model in this process (each part created when first read):

    ``tiers``
        :class:`hf_cascade.tiers._ModelTiers`: which tiers are ready, the regret of the tiers above, the
        markers on disk, the calls so far, the background build (:mod:`hf_cascade.tier_build`) and the per-shape regret.
    ``scan``
        :class:`hf_cascade.model_scan._ModelScan`: the model's attention modules by layer index and its parameter
        count, walked once (again after a module is registered).
    ``step_buffers``
        :class:`hf_cascade.step_buffers.StepBuffers`: the device buffers the latest call gave back, for the
        next call's compiled step to read at the same addresses.
    ``layer_calls``
        :class:`hf_cascade.compiled_layers._LayerCalls`: the decoder layers' compiled calls (decode step and
        prefill) and their counters.
    ``graphs``
        :class:`hf_cascade.decode.captured_step._ModelGraphs`: the decode steps recorded into CUDA graphs, by key.

    :meth:`forget` drops parts (the next read creates them anew).
    """

    PARTS = PARTS

    def __init__(self, model=None):
        self._owner = None if model is None else weakref.ref(model)
        self._lock = threading.Lock()
        self._parts: dict = {}

    def part(self, name: str, create):
        """The part ``name`` (of :data:`PARTS`), made by ``create()`` (its owner's class) when first read."""
        part = self._parts.get(name)
        if part is None:
            with self._lock:
                part = self._parts.get(name)
                if part is None:
                    if name not in PARTS:
                        raise ValueError(f"Engine.part: unknown part {name!r}; the parts are {list(PARTS)}.")
                    part = self._parts[name] = create()
        return part

    def forget(self, *names: str) -> None:
        """Drop the parts named (of :attr:`PARTS`): the next read of each creates it anew (as in a new process)."""
        unknown = set(names) - set(PARTS)
        if unknown:
            raise ValueError(f"Engine.forget: unknown parts {sorted(unknown)}; the parts are {list(PARTS)}.")
        with self._lock:
            for name in names:
                self._parts.pop(name, None)

    def belongs_to(self, model) -> bool:
        return self._owner is not None and self._owner() is model

    def __reduce__(self):
        return (type(None), ())  # a pickled or deep-copied model carries None: its copy starts an engine of its own

    def __deepcopy__(self, memo):
        return None


def engine_of(model) -> Engine:
    """``model``'s :class:`Engine` (created on first use, kept as one attribute of the model, freed with it).

    Raises:
        TypeError: ``model`` keeps no attributes or cannot be weakly referenced.
    """
    engine = vars(model).get(_ATTRIBUTE)
    if engine is not None and engine.belongs_to(model):
        return engine
    with _CREATE_LOCK:
        engine = vars(model).get(_ATTRIBUTE)
        if engine is None or not engine.belongs_to(model):
            engine = Engine(model)
            object.__setattr__(model, _ATTRIBUTE, engine)
        return engine
