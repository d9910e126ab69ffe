"""``import hf_cascade`` is cheap (nothing but the registration hook) and "cascade" is registered before any model
can be built: at once when transformers' registry is loaded already, else when it loads. Neither the import nor the
registration starts a thread or changes ``os.environ``."""

import json
import os
import subprocess
import sys
import textwrap


def run(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# A process seen as on a CUDA machine (``torch.cuda.is_available()`` True: where a Triton warm-up would start), with
# hf_cascade imported or not (HF_CASCADE in the environment), then transformers' attention registry loaded (where the
# registration runs): the new threads and the changed environment variables after each step, as JSON.
_SIDE_EFFECTS = """
    import json, os, sys, threading
    import torch
    torch.cuda.is_available = lambda: True
    env, threads = dict(os.environ), set(threading.enumerate())

    def changes():
        return {"threads": sorted(t.name for t in set(threading.enumerate()) - threads),
                "environ": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))}

    steps = {}
    if os.environ.get("HF_CASCADE") == "1":
        import hf_cascade
        steps["import hf_cascade"] = changes()
    import transformers.modeling_utils
    from transformers import AttentionInterface
    steps["transformers' registry loaded"] = changes()
    steps["registered"] = "cascade" in AttentionInterface._global_mapping
    print(json.dumps(steps))
"""


def test_import_and_registration_start_no_thread_and_leave_the_environment():
    """``python -c "import hf_cascade"`` starts no thread and leaves ``os.environ`` as it was, and so does the
    registration when transformers' registry loads (Triton is prepared at the first use instead,
    ``ops._backend.prepare_triton``): whatever changes then is transformers' own doing, as without hf_cascade."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_CASCADE_WARM_TRITON_KEY")}
    with_cascade = json.loads(run(_SIDE_EFFECTS, {**env, "HF_CASCADE": "1"}))
    without = json.loads(run(_SIDE_EFFECTS, {**env, "HF_CASCADE": "0"}))
    assert with_cascade["import hf_cascade"] == {"threads": [], "environ": []}
    assert with_cascade["registered"] and not without["registered"]
    loaded = "transformers' registry loaded"
    assert with_cascade[loaded] == without[loaded]
    assert not any(name.startswith("hf_cascade") for name in with_cascade[loaded]["threads"])


def test_import_loads_no_model_machinery_and_registers_when_transformers_does():
    print_state = """
        import sys
        import hf_cascade
        heavy = [m for m in ("torch", "transformers.modeling_utils", "hf_cascade.attention", "hf_cascade.generation")
                 if m in sys.modules]
        print(heavy)
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        print("cascade" in AttentionInterface._global_mapping, "cascade" in AttentionMaskInterface._global_mapping)
        import transformers.modeling_utils as mu
        print(type(mu.__loader__).__module__ != "hf_cascade._registration", hf_cascade.generate.__module__)
    """
    assert run(print_state).splitlines() == ["[]", "True True", "True hf_cascade.generation"]


def test_registers_at_once_when_transformers_registry_is_loaded_first():
    assert run("""
        import transformers.modeling_utils
        from transformers import AttentionInterface
        import hf_cascade
        print("cascade" in AttentionInterface._global_mapping)
    """) == "True"


def test_public_names_resolve():
    import hf_cascade

    for name in hf_cascade.__all__:
        assert getattr(hf_cascade, name) is not None, name
    assert set(hf_cascade.__all__) <= set(dir(hf_cascade))


def test_registers_when_a_submodule_is_imported_first():
    # hf_cascade.attention imports transformers' registry itself: the post-import hook then finds it half-built,
    # and it registers at its own end (a test module importing an hf_cascade submodule first hit this).
    assert run("""
        import hf_cascade.parallel.ring
        from transformers import AttentionInterface
        print("cascade" in AttentionInterface._global_mapping)
    """) == "True"
