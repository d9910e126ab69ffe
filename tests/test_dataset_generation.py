"""generate_dataset on a tiny random-init Llama (fp32, CPU) with the local byte-level tokenizer.

The dataset mimics few-shot evaluation: a system line shared by every row, one of two few-shot blocks shared by
half of the rows, then a per-row question; rows are shuffled so that sharing rows are not adjacent.
"""

import json
import random

import pytest

datasets = pytest.importorskip("datasets")
import torch  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade.dataset_generation import CHECKPOINT_VERSION, GenerationInterrupted, generate_dataset  # noqa: E402
from hf_cascade.tiny import tiny_model, tiny_tokenizer  # noqa: E402

MAX_NEW = 6
SYSTEM = "You are a careful calculator. Reply with the number only.\n"
BLOCKS = {
    "+": "".join(f"Q: {a}+{b}=\nA: {a + b}\n" for a, b in [(1, 2), (13, 4), (20, 22)]),
    "*": "".join(f"Q: {a}*{b}=\nA: {a * b}\n" for a, b in [(2, 3), (4, 5)]),
}


def make_dataset(n=16, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        op = "+*"[i % 2]
        rows.append({"id": i, "op": op, "question": f"Q: {rng.randint(0, 99)}{op}{rng.randint(0, 99)}=\nA:"})
    rng.shuffle(rows)
    return datasets.Dataset.from_list(rows)


def prompt_fn(row):
    return SYSTEM + BLOCKS[row["op"]] + row["question"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference():
    ref = tiny_model("llama", attn_implementation="sdpa")
    assert ref.config._attn_implementation == "sdpa"
    return ref


def per_row_reference(reference, tokenizer, dataset):
    """Plain sdpa generate(), one unpadded row at a time: what generate_dataset must reproduce."""
    out = []
    for row in dataset:
        ids = tokenizer(prompt_fn(row), return_tensors="pt")
        seq = reference.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(seq[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def dataset():
    return make_dataset()


@pytest.fixture(scope="module")
def expected(reference, tokenizer, dataset):
    return per_row_reference(reference, tokenizer, dataset)


def test_matches_per_row_sdpa_and_keeps_order(model, tokenizer, dataset, expected):
    assert model.config._attn_implementation == "cascade"
    out, stats = generate_dataset(
        model,
        tokenizer,
        dataset,
        prompt_fn=prompt_fn,
        generation_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False),
        max_batch_size=6,  # several batches, one of them straddling the two few-shot blocks
        progress=False,
        return_stats=True,
    )
    assert out["id"] == dataset["id"]  # original order, other columns untouched
    assert len(set(expected)) > 4  # the random model's completions differ per row: order errors would show
    assert out["completion"] == expected
    assert stats.rows == stats.rows_generated == len(dataset)
    assert stats.batches == 3
    assert stats.new_tokens > 0 and stats.seconds > 0


def test_grouping_shares_prefixes(model, tokenizer, dataset):
    _, stats = generate_dataset(
        model,
        tokenizer,
        dataset,
        prompt_fn=prompt_fn,
        generation_kwargs=dict(max_new_tokens=2, do_sample=False),
        max_batch_size=4,
        progress=False,
        return_stats=True,
    )
    lengths = [len(tokenizer(prompt_fn(row))["input_ids"]) for row in dataset]
    system_len = len(tokenizer(SYSTEM)["input_ids"])  # + BOS
    # Every row shares at least the system line (+ BOS) with others.
    assert stats.prompt_tokens == sum(lengths)
    assert stats.shared_prompt_tokens >= len(dataset) * system_len
    # Shared prefixes are prefilled far fewer times than once per row; sorting puts each few-shot block in whole
    # batches, and the system line is carried across batches (prefilled once for the dataset, not per batch).
    assert stats.prefix_tokens_prefilled < stats.shared_prompt_tokens / 2
    block_len = {op: len(tokenizer(SYSTEM + b)["input_ids"]) for op, b in BLOCKS.items()}
    assert stats.prefix_tokens_prefilled <= sum(block_len.values()) + 4 * 8  # a few re-prefilled short segments
    assert stats.batches == 4


def test_token_budget_and_plain_column(model, tokenizer):
    prompts = [SYSTEM + BLOCKS["+"] + f"Q: {i}+1=\nA:" for i in range(6)]
    ds = datasets.Dataset.from_dict({"text": prompts})
    budget = len(tokenizer(prompts[0])["input_ids"]) + 3 * (8 + 2)  # prefix once + about 3 rows' own tokens
    out, stats = generate_dataset(
        model,
        tokenizer,
        ds,
        prompt_column="text",
        output_column="answer",
        generation_kwargs=dict(max_new_tokens=2, do_sample=False),
        max_batch_tokens=budget,
        progress=False,
        return_stats=True,
    )
    assert out.column_names == ["text", "answer"]
    assert 2 <= stats.batches <= 3
    assert all(size <= 4 for size in stats.batch_sizes)


def test_num_return_sequences_gives_lists(model, tokenizer):
    ds = datasets.Dataset.from_dict({"prompt": [SYSTEM + "Q: 1+1=\nA:", SYSTEM + "Q: 2+2=\nA:"]})
    torch.manual_seed(0)
    out = generate_dataset(
        model,
        tokenizer,
        ds,
        generation_kwargs=dict(max_new_tokens=3, do_sample=True, num_return_sequences=3),
        progress=False,
    )
    assert [len(c) for c in out["completion"]] == [3, 3]
    assert all(isinstance(t, str) for c in out["completion"] for t in c)


def test_interrupt_keeps_finished_rows_and_resumes(model, tokenizer, dataset, expected, tmp_path, monkeypatch):
    checkpoint = tmp_path / "completions.jsonl"
    calls = {"n": 0}
    real_generate = model.generate

    def interrupted_generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # Ctrl-C during the third batch
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    kwargs = dict(
        prompt_fn=prompt_fn,
        generation_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False),
        max_batch_size=4,
        progress=False,
        checkpoint_path=checkpoint,
        return_stats=True,
    )
    monkeypatch.setattr(model, "generate", interrupted_generate)
    with pytest.raises(GenerationInterrupted) as info:
        generate_dataset(model, tokenizer, dataset, **kwargs)
    err = info.value
    assert isinstance(err, KeyboardInterrupt)
    partial = err.dataset["completion"]
    finished = [i for i, c in enumerate(partial) if c is not None]
    assert len(finished) == 8 and err.stats.interrupted  # two batches of 4 finished
    assert all(partial[i] == expected[i] for i in finished)
    lines = checkpoint.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["hf_cascade_checkpoint"] == CHECKPOINT_VERSION
    assert header["model"]["class"] == "LlamaForCausalLM" and header["model"]["dtype"] == "float32"
    assert header["tokenizer"]["vocab_size"] == len(tokenizer)
    assert sorted(json.loads(line)["index"] for line in lines[1:]) == finished

    # A crash mid-write leaves a cut line: it is ignored (that row is generated again).
    with open(checkpoint, "a") as f:
        f.write('{"index": 3, "compl')

    monkeypatch.setattr(model, "generate", real_generate)
    calls["n"] = 0
    out, stats = generate_dataset(model, tokenizer, dataset, **kwargs)
    assert stats.rows_resumed == 8 and stats.rows_generated == len(dataset) - 8
    assert out["completion"] == expected
    assert out["id"] == dataset["id"]

    # A finished checkpoint: nothing left to generate.
    out, stats = generate_dataset(model, tokenizer, dataset, **kwargs)
    assert stats.rows_generated == 0 and stats.batches == 0 and out["completion"] == expected


def test_foreign_checkpoint_is_refused(model, tokenizer, dataset, tmp_path):
    checkpoint = tmp_path / "c.jsonl"
    common = dict(prompt_fn=prompt_fn, progress=False, checkpoint_path=checkpoint)
    small = dataset.select(range(2))
    generate_dataset(model, tokenizer, small, generation_kwargs=dict(max_new_tokens=1), **common)
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        generate_dataset(model, tokenizer, small, generation_kwargs=dict(max_new_tokens=2), **common)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="not a generate_dataset checkpoint"):
        generate_dataset(
            model, tokenizer, small, prompt_fn=prompt_fn, progress=False, checkpoint_path=tmp_path / "notes.txt"
        )


def _checkpoint_job(tmp_path, dataset):
    """A small checkpointed job: 2 rows, 1 new token each."""
    common = dict(
        prompt_fn=prompt_fn,
        generation_kwargs=dict(max_new_tokens=1, do_sample=False),
        progress=False,
        checkpoint_path=tmp_path / "c.jsonl",
        return_stats=True,
    )
    return dataset.select(range(2)), common


def test_checkpoint_of_another_model_is_refused(model, tokenizer, dataset, tmp_path):
    small, common = _checkpoint_job(tmp_path, dataset)
    generate_dataset(model, tokenizer, small, **common)
    written = common["checkpoint_path"].read_text()

    # Same family, config, dataset, prompts and kwargs; another seed: other weights, other completions.
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match=r"(?s)model: checkpoint written by .*differ in weights") as info:
        generate_dataset(other, tokenizer, small, **common)
    message = str(info.value)
    assert "other prompts" not in message  # only what differs is named
    assert "checkpoint_path=" in message and "delete the file" in message
    assert common["checkpoint_path"].read_text() == written  # the refused checkpoint is left untouched

    # Another config (a third layer): named as such.
    deeper = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"model: .*differ in config"):
        generate_dataset(deeper, tokenizer, small, **common)


def test_checkpoint_of_another_dtype_is_refused(model, tokenizer, dataset, tmp_path):
    small, common = _checkpoint_job(tmp_path, dataset)
    generate_dataset(model, tokenizer, small, **common)
    half = tiny_model("llama", dtype=torch.bfloat16)  # same seed: the same model, in bf16
    half.config._name_or_path = "llama-b"
    pattern = r"model: .*'llama-b' \(LlamaForCausalLM, bfloat16\).*dtype float32 vs bfloat16"
    with pytest.raises(ValueError, match=pattern):
        generate_dataset(half, tokenizer, small, **common)


def test_checkpoint_of_another_tokenizer_is_refused(model, tokenizer, dataset, tmp_path):
    small, common = _checkpoint_job(tmp_path, dataset)
    generate_dataset(model, tokenizer, small, **common)
    extended = tiny_tokenizer()
    extended.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"tokenizer: .*vocabulary size 260 vs 261"):
        generate_dataset(model, extended, small, **common)


def test_same_model_resumes_whatever_its_instance_or_path(model, tokenizer, dataset, tmp_path):
    small, common = _checkpoint_job(tmp_path, dataset)
    first, _ = generate_dataset(model, tokenizer, small, **common)
    # Another instance with the same weights, under another name/path, with a fresh tokenizer: the same job,
    # resumed (the model is identified by its class, dtype, config and weights, not by the object or its path).
    again = tiny_model("llama")
    again.config._name_or_path = "/elsewhere/llama"
    out, stats = generate_dataset(again, tiny_tokenizer(), small, **common)
    assert stats.rows_resumed == 2 and stats.rows_generated == 0
    assert out["completion"] == first["completion"]


def test_checkpoint_without_model_record_is_refused(model, tokenizer, dataset, tmp_path):
    small, common = _checkpoint_job(tmp_path, dataset)
    # A format-1 checkpoint (hf_cascade before the model was recorded): it cannot be checked, so it is refused.
    common["checkpoint_path"].write_text(
        json.dumps({"hf_cascade_checkpoint": 1, "fingerprint": "0" * 32, "rows": 2, "output_column": "completion"})
        + "\n"
        + json.dumps({"index": 0, "completion": "x"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"(?s)older version of hf_cascade.*format 1.*delete the file"):
        generate_dataset(model, tokenizer, small, **common)


def test_bad_inputs_name_the_fix(model, tokenizer, reference):
    ds = datasets.Dataset.from_dict({"text": ["Q: 1+1=\nA:"]})
    with pytest.raises(ValueError, match=r"no column 'prompt'.*prompt_column="):
        generate_dataset(model, tokenizer, ds, progress=False)
    with pytest.raises(ValueError, match="empty"):
        generate_dataset(model, tokenizer, ds.select([]), prompt_column="text", progress=False)
    no_pad = tiny_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"pad_token = tokenizer.eos_token"):
        generate_dataset(model, no_pad, ds, prompt_column="text", progress=False)
    with pytest.raises(ValueError, match="attn_implementation='cascade'"):
        generate_dataset(reference, tokenizer, ds, prompt_column="text", progress=False)
    with pytest.raises(ValueError, match="already has a column 'text'"):
        generate_dataset(model, tokenizer, ds, prompt_column="text", output_column="text", progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_dataset(
            model, tokenizer, ds, prompt_column="text", generation_kwargs=dict(max_length=50), progress=False
        )
    with pytest.raises(ValueError, match="pass one split"):
        generate_dataset(model, tokenizer, datasets.DatasetDict(train=ds), prompt_column="text", progress=False)
    with pytest.raises(ValueError, match="string or a list of token ids"):
        generate_dataset(model, tokenizer, datasets.Dataset.from_dict({"prompt": [3.5]}), progress=False)
    assert hf_cascade.ATTENTION_NAME == "cascade"


def test_pretokenized_prompts(model, tokenizer):
    ids = [tokenizer(SYSTEM + f"Q: {i}+{i}=\nA:")["input_ids"] for i in range(3)]
    ds = datasets.Dataset.from_dict({"prompt": ids})
    out = generate_dataset(model, tokenizer, ds, generation_kwargs=dict(max_new_tokens=2), progress=False)
    texts = generate_dataset(
        model,
        tokenizer,
        datasets.Dataset.from_dict({"prompt": [SYSTEM + f"Q: {i}+{i}=\nA:" for i in range(3)]}),
        generation_kwargs=dict(max_new_tokens=2),
        progress=False,
    )
    assert out["completion"] == texts["completion"]
