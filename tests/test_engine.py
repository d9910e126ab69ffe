"""hf_cascade.engine: one Engine per model, one attribute of it, its parts created once; copies start their own."""

import copy
import gc
import pickle
import threading
import weakref

import pytest

from hf_cascade.engine import Engine, engine_of
from hf_cascade.model_zoo import tiny_model


def test_one_engine_per_model_with_parts_created_once():
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
    parts = {name: getattr(engine, name) for name in Engine.PARTS}
    assert all(getattr(engine, name) is part for name, part in parts.items())
    engine.forget("tiers", "graphs")
    assert engine.tiers is not parts["tiers"] and engine.graphs is not parts["graphs"]
    assert engine.scan is parts["scan"]
    with pytest.raises(ValueError):
        engine.forget("nothing")
    assert not any("engine" in key for key in model.state_dict())


def test_copies_start_their_own_engine_and_the_engine_goes_with_the_model():
    model = tiny_model("llama", "cascade", seed=0)
    engine = engine_of(model)
    engine.tiers.calls.append(("builtin", 1.0))
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.copy(model)):
        assert engine_of(other) is not engine and engine_of(other).tiers.calls == []
    assert engine_of(model) is engine
    ref = weakref.ref(engine)
    del model, engine
    gc.collect()
    assert ref() is None
