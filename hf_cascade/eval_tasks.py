"""A local multiple-choice task for lm-evaluation-harness (no downloads): tests, the example and the benchmark.

:func:`write_arithmetic_task` writes ``questions`` arithmetic questions with 4 numeric choices each, and a dev split
of few-shot examples, as JSON-lines files plus an lm-eval task YAML over them. The few-shot block is the same for
every question (``sampler: first_n``, as MMLU's tasks do), so it is the prefix every request shares.
"""

from __future__ import annotations

import json
import os
import random

TASK_NAME = "hf_cascade_arithmetic"


def arithmetic_questions(count: int, seed: int = 0) -> list[dict]:
    """``count`` dicts ``{"question": str, "choices": [4 str], "answer": int}`` (sums and differences of numbers up
    to 50; the wrong choices are near the right one)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        op = rng.choice("+-")
        right = a + b if op == "+" else a - b
        wrong = set()
        while len(wrong) < 3:
            candidate = right + rng.choice([-10, -2, -1, 1, 2, 10, 11])
            if candidate != right:
                wrong.add(candidate)
        choices = [right, *sorted(wrong)]
        rng.shuffle(choices)
        docs.append({"question": f"What is {a} {op} {b}?", "choices": [str(c) for c in choices],
                     "answer": choices.index(right)})
    return docs


def write_arithmetic_task(folder: str, questions: int = 200, shots: int = 5, seed: int = 0,
                          name: str = TASK_NAME, generate: bool = False) -> str:
    """Write ``{name}_test.jsonl`` (``questions`` docs), ``{name}_dev.jsonl`` (``shots`` docs) and ``{name}.yaml``
    into ``folder``; return the task name. Run it with ``TaskManager(include_path=folder)`` (or ``--include_path
    folder``). ``generate``: a ``generate_until`` task (greedy, up to 6 tokens, stop at a newline; exact match with
    the right number) instead of multiple choice (``acc``)."""
    os.makedirs(folder, exist_ok=True)
    docs = arithmetic_questions(questions + shots, seed)
    paths = {}
    for split, part in (("test", docs[shots:]), ("dev", docs[:shots])):
        paths[split] = os.path.abspath(os.path.join(folder, f"{name}_{split}.jsonl"))
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in part)
    yaml = f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(paths["test"])}
    dev: {json.dumps(paths["dev"])}
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
num_fewshot: {shots}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
{_GENERATE if generate else _MULTIPLE_CHOICE}metadata:
  version: 1.0
"""
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(yaml)
    return name


_MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

_GENERATE = """output_type: generate_until
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: [" "]
"""
