"""The README's Python snippets run as written (CPU, tiny model): the README cannot drift from the code."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_use_snippet_runs_and_matches_sdpa():
    namespace = {}
    exec(compile(python_blocks()[0], "README.md", "exec"), namespace)
    model, tok, batch, completions = (namespace[k] for k in ("model", "tok", "batch", "completions"))
    assert len(completions) == 3
    # The same prompts through plain sdpa generate() give the same completions.
    model.set_attn_implementation("sdpa")
    try:
        ref = model.generate(**batch, max_new_tokens=8, do_sample=False)
    finally:
        model.set_attn_implementation("cascade")
    assert tok.batch_decode(ref[:, batch["input_ids"].shape[1] :], skip_special_tokens=True) == completions
    assert namespace["caches"][0].num_levels == 1


def test_from_prefix_snippet_runs():
    namespace = {}
    exec(compile(python_blocks()[0], "README.md", "exec"), namespace)
    prefix_ids = namespace["tok"](namespace["system"], return_tensors="pt")["input_ids"][0]
    suffix = namespace["tok"](["Q: 1 + 1 = ?\nA:", "Q: 5 + 2 = ?\nA:"], add_special_tokens=False)["input_ids"]
    width = max(len(x) for x in suffix)
    input_ids = torch.zeros((2, len(prefix_ids) + width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    input_ids[:, : len(prefix_ids)], mask[:, : len(prefix_ids)] = prefix_ids, 1
    for i, s in enumerate(suffix):
        input_ids[i, input_ids.shape[1] - len(s) :], mask[i, input_ids.shape[1] - len(s) :] = torch.tensor(s), 1
    namespace.update(prefix_ids=prefix_ids, input_ids=input_ids, mask=mask, input_ids2=input_ids[:1], mask2=mask[:1])
    exec(compile(python_blocks()[2], "README.md", "exec"), namespace)
    assert namespace["out"].shape[0] == 2 and namespace["out2"].shape[0] == 1


def test_samples_and_pipeline_snippet_runs():
    namespace = {}
    exec(compile(python_blocks()[0], "README.md", "exec"), namespace)
    exec(compile(python_blocks()[1], "README.md", "exec"), namespace)
    assert namespace["out"].shape == (3 * 8, namespace["batch"]["input_ids"].shape[1] + 64)
    assert len(namespace["answers"]) == 3
