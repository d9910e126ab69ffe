"""generate_dataset cases that used to lose or corrupt data without a word (issue 34): completions padded with the
batch's padding, negative statistics, a checkpoint cut inside a multi-byte character that could not be resumed."""

import json

import pytest

datasets = pytest.importorskip("datasets")
import torch  # noqa: E402

from hf_cascade.dataset_generation import generate_dataset  # noqa: E402
from hf_cascade.tiny import tiny_model, tiny_tokenizer  # noqa: E402

SYSTEM = "You are a careful calculator. Reply with the number only.\n"
QUESTIONS = [f"Q: {a}+{b}=\nA:" for a, b in [(1, 2), (13, 4), (20, 22), (7, 70), (3, 33), (8, 1)]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama"), tiny_model("llama", attn_implementation="sdpa")


def _dataset(n=len(QUESTIONS)):
    return datasets.Dataset.from_dict({"prompt": [SYSTEM + q for q in QUESTIONS[:n]]})


def _per_row(reference, tokenizer, prompts, skip_special_tokens=True, **gen):
    """Plain sdpa generate(), one unpadded row at a time."""
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        seq = reference.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 **gen)
        out.append(tokenizer.decode(seq[0, ids["input_ids"].shape[1]:], skip_special_tokens=skip_special_tokens))
    return out


def test_completions_cut_at_the_rows_own_end_with_special_tokens(models, tokenizer):
    """skip_special_tokens=False: rows that stopped early carried the batch's padding (`<pad>` after their EOS)."""
    model, reference = models
    dataset = _dataset()
    plain = _per_row(reference, tokenizer, dataset["prompt"])
    # An EOS that some rows reach early and others not: the second character of the first row's completion.
    stop = tokenizer(plain[0][1], add_special_tokens=False)["input_ids"][0]
    gen = dict(eos_token_id=stop)
    want = _per_row(reference, tokenizer, dataset["prompt"], skip_special_tokens=False, **gen)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in want]
    assert min(lengths) < MAX_NEW == max(lengths)  # some rows stop early, in one batch with rows that do not
    out = generate_dataset(model, tokenizer, dataset, generation_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False,
                                                                             **gen),
                           skip_special_tokens=False, progress=False)
    assert out["completion"] == want
    assert not any("<pad>" in text for text in out["completion"])


@pytest.mark.parametrize("num_return", [1, 3])
def test_statistics_consistent_with_num_return_sequences(models, tokenizer, num_return):
    """With num_return_sequences the shared tokens were counted per sample and the prompt tokens per prompt:
    "prefill tokens: -102"."""
    model, _ = models
    dataset = _dataset()
    torch.manual_seed(0)
    _, stats = generate_dataset(model, tokenizer, dataset, return_stats=True, progress=False, max_batch_size=4,
                                generation_kwargs=dict(max_new_tokens=3, do_sample=True,
                                                       num_return_sequences=num_return))
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in dataset["prompt"])
    assert stats.prompt_tokens == prompt_tokens * num_return
    assert 0 < stats.prefix_tokens_prefilled <= stats.shared_prompt_tokens <= stats.prompt_tokens
    assert 0 < stats.prefill_tokens <= stats.prompt_tokens and stats.prefill_tokens_saved >= 0
    assert stats.new_tokens <= len(dataset) * num_return * 3
    assert not any(word.startswith("-") for word in stats.summary().split())


def test_checkpoint_cut_at_every_byte_of_a_multibyte_last_line_resumes(models, tokenizer, tmp_path):
    """A crash (or a full disk) while appending non-ASCII text cut the last line inside a UTF-8 character: every
    later run failed with UnicodeDecodeError. Now the cut line is dropped and its row generated again."""
    model, reference = models
    dataset = _dataset(3)
    expected = _per_row(reference, tokenizer, dataset["prompt"])
    path = tmp_path / "run.jsonl"
    kwargs = dict(generation_kwargs=dict(max_new_tokens=MAX_NEW, do_sample=False), progress=False,
                  checkpoint_path=path, return_stats=True)
    out, _ = generate_dataset(model, tokenizer, dataset, **kwargs)
    assert out["completion"] == expected
    *head, last, end = path.read_bytes().split(b"\n")
    assert end == b""
    index = json.loads(last)["index"]
    text = "réponse: ünïcode ✓ 答案"  # 2-, 3-byte characters
    line = json.dumps({"index": index, "completion": text}, ensure_ascii=False).encode("utf-8")
    kept = b"\n".join(head) + b"\n"
    for cut in range(len(line) + 1):
        path.write_bytes(kept + line[:cut])
        out, stats = generate_dataset(model, tokenizer, dataset, **kwargs)
        if cut == len(line):  # the whole record, only its newline missing: resumed
            assert stats.rows_generated == 0 and out["completion"][index] == text, cut
        else:
            assert stats.rows_generated == 1 and out["completion"] == expected, cut
        assert path.read_bytes().endswith(b"\n")  # rewritten whole: later appends start on a line of their own
