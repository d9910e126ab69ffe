"""hf_cascade.engine: one Engine per model, one attribute of it, its parts created once; copies start their own."""

import copy
import gc
import pickle
import threading
import weakref

import pytest

from hf_cascade.engine import Engine, engine_of
from hf_cascade.tiers import tier_state
from hf_cascade.model_zoo import tiny_model


def test_one_engine_per_model_with_parts_created_once():
    """Every part made once (by its owner's class, the first time it is read), forget drops parts, unknown names
    raise; nothing of it in the state dict."""
    model = tiny_model("llama", "cascade", seed=0)
    engines = []
    threads = [threading.Thread(target=lambda: engines.append(engine_of(model))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = engine_of(model)
    assert all(e is engine for e in engines)
    assert [k for k, v in vars(model).items() if isinstance(v, Engine)] == ["_hf_cascade_engine"]
    parts = {name: engine.part(name, object) for name in Engine.PARTS}
    assert all(engine.part(name, dict) is part for name, part in parts.items())  # made once: the class is not used
    engine.forget("tiers", "graphs")
    assert engine.part("tiers", object) is not parts["tiers"] and engine.part("graphs", object) is not parts["graphs"]
    assert engine.part("scan", object) is parts["scan"]
    with pytest.raises(ValueError):
        engine.forget("nothing")
    with pytest.raises(ValueError):
        engine.part("nothing", object)
    assert not any("engine" in key for key in model.state_dict())
    assert tier_state(model) is engine.part("tiers", object)  # the owner's accessor reads the same part


def test_copies_start_their_own_engine_and_the_engine_goes_with_the_model():
    model = tiny_model("llama", "cascade", seed=0)
    engine = engine_of(model)
    tier_state(model).calls.append(("builtin", 1.0))
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.copy(model)):
        assert engine_of(other) is not engine and tier_state(other).calls == []
    assert engine_of(model) is engine
    ref = weakref.ref(engine)
    del model, engine
    gc.collect()
    assert ref() is None
