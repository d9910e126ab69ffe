"""The Python snippets of docs/*.md run as written (CPU, tiny models) and warn nothing: no Python warning (a
FutureWarning / DeprecationWarning, such as transformers 5.24's for `past_key_values=`, raises where it is issued;
any other fails the test) and no transformers / hf_cascade log record of level WARNING+.

Snippets continue the README's (``model``, ``tok``, ``batch``, ``prompts``, ``system``: its tiny model and batch), as
docs/usage.md says; each runs on its own copy of that namespace, in a temporary working directory. A snippet that
cannot run here (a GPU, a network, several processes, a real checkpoint) has, on the line just before its opening
fence, ``<!-- not run: REASON -->``; it is still compiled, so its syntax is checked."""

import re
from pathlib import Path

import pytest

from test_readme import block, run_warning_free

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["usage.md", "scoring.md", "internals.md", "context_parallel.md"]
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\n$")


def doc_blocks(doc: str) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, code, the not-run reason or None) of each python block of docs/``doc``."""
    text = (ROOT / "docs" / doc).read_text()
    found = []
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M):
        indent, body = m.groups()
        code = "\n".join(line[len(indent):] for line in body.splitlines())
        before = text[: m.start()].splitlines(keepends=True)
        reason = NOT_RUN.search(before[-1]) if before else None
        found.append((text.count("\n", 0, m.start()) + 1, code, reason and reason.group(1)))
    return found


SNIPPETS = [(doc, line, code, reason) for doc in DOCS for line, code, reason in doc_blocks(doc)]


run_doc_snippet = run_warning_free  # README.md's runner (tests/test_readme.py)


@pytest.fixture(scope="module")
def readme_namespace():
    namespace = {}
    run_doc_snippet(block("the one extra argument"), namespace, "README.md")
    return namespace


@pytest.mark.parametrize("doc, line, code, reason", SNIPPETS, ids=[f"{d}:{n}" for d, n, _, _ in SNIPPETS])
def test_doc_snippet_runs_warning_free(doc, line, code, reason, readme_namespace, tmp_path, monkeypatch):
    compile(code, f"docs/{doc}:{line}", "exec")
    if reason:
        pytest.skip(f"not run: {reason}")
    if "datasets" in code:
        pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)  # files a snippet writes (generate_dataset's checkpoint) go there
    namespace = dict(readme_namespace)
    run_doc_snippet(code, namespace, f"docs/{doc}:{line}")


def test_every_doc_with_python_is_covered():
    with_python = {p.name for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text()}
    assert with_python <= set(DOCS), with_python - set(DOCS)


def test_not_run_snippets_say_why():
    skipped = {(doc, reason) for doc, _, _, reason in SNIPPETS if reason}
    assert {doc for doc, _ in skipped} <= {"scoring.md", "context_parallel.md"}, skipped  # the rest all run


def _usage(word: str) -> str:
    (code,) = [code for doc, _, code, _ in SNIPPETS if doc == "usage.md" and word in code]
    return code


def test_usage_prefix_cache_snippet_gives_sdpa_tokens(readme_namespace):
    """The explicit-control snippet: both batches served from one prefilled prefix give plain sdpa's tokens."""
    namespace = dict(readme_namespace)
    run_doc_snippet(_usage("from_prefix"), namespace, "docs/usage.md")
    model = namespace["model"]
    model.set_attn_implementation("sdpa")
    try:
        for inputs, out in ((namespace["batch"], namespace["out"]), (namespace["batch2"], namespace["out2"])):
            ref = model.generate(**inputs, max_new_tokens=16, do_sample=False)
            assert out.tolist() == ref.tolist()
    finally:
        model.set_attn_implementation("cascade")


def test_usage_generate_dataset_snippet_writes_its_checkpoint(readme_namespace, tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    namespace = dict(readme_namespace)
    run_doc_snippet(_usage("generate_dataset("), namespace, "docs/usage.md")
    assert len(namespace["out"]["completion"]) == 4
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) >= 1


def test_scoring_snippet_values():
    (code,) = [code for doc, _, code, reason in SNIPPETS if doc == "scoring.md" and not reason]
    namespace = {}
    run_doc_snippet(code, namespace, "docs/scoring.md")
    out = namespace["out"]
    assert out.logprobs.shape == (4,) and bool((out.logprobs < 0).all())
    assert len(out.as_tuples()) == 4


def test_the_runner_catches_the_old_cache_keyword(readme_namespace):
    """Where transformers renamed generate()'s `past_key_values` to `cache`, a doc using the old name fails."""
    from hf_cascade.transformers_compat import CACHE_KWARG

    if CACHE_KWARG != "cache":
        pytest.skip("transformers < 5.24: `past_key_values=` is the current name")
    code = ("inputs = hf_cascade.shared_prefix_inputs(model, batch['input_ids'], batch['attention_mask'])\n"
            "model.generate(input_ids=inputs['input_ids'], attention_mask=inputs['attention_mask'],\n"
            "               past_key_values=inputs['cache'], max_new_tokens=2, do_sample=False)\n")
    with pytest.raises(FutureWarning, match="past_key_values"):
        run_doc_snippet(code, dict(readme_namespace), "old-keyword")
