"""``import hf_cascade`` is cheap (nothing but the registration hook) and "cascade" is registered before any model
can be built: at once when transformers' registry is loaded already, else when it loads."""

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


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
