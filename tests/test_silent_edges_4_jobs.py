"""Fourth sweep (issue 49): jobs, files and settings that gave another run's answers, lost work or broke later runs
without a word. Each is now exact, or a clear error naming the setting, the file or the line and the fix.

* generate_dataset resumed another job's checkpoint (a logits processor, an ``eos_token_id`` tensor: settings JSON
  cannot write were left out of the fingerprint);
* a resumed generate_dataset prefilled the dataset-wide preamble again for each group of batches;
* a hand-edited checkpoint line failed in pyarrow after the whole job;
* a compile record of the wrong shape broke every default CUDA generate() of its model (records are markers now);
* ``HF_CASCADE_CACHE=OFF`` was a folder named ``OFF``;
* Falcon / GPT-Neo with "cascade" in a fresh process: a bare ``KeyError: 'cascade'``;
* write_custom_generate overwrote a user's edits of the file it had written.
"""

import json
import os
import random
import re
import subprocess
import sys
import warnings

import pytest

datasets = pytest.importorskip("datasets")
import torch  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

import hf_cascade  # noqa: E402
from hf_cascade import tiers  # noqa: E402
from hf_cascade.dataset_generation import generate_dataset  # noqa: E402
from hf_cascade.real_model import gguf_cache_root  # noqa: E402
from hf_cascade.tiny import tiny_model, tiny_tokenizer  # noqa: E402

SYSTEM = "You are a careful calculator. Reply with the number only.\n"
BLOCKS = {
    "+": "".join(f"Q: {a}+{b}=\nA: {a + b}\n" for a, b in [(1, 2), (13, 4), (20, 22)]),
    "*": "".join(f"Q: {a}*{b}=\nA: {a * b}\n" for a, b in [(2, 3), (4, 5)]),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _few_shot(n: int, seed: int = 0):
    """``n`` rows: the system line, one of two few-shot blocks, a question; shuffled."""
    rng = random.Random(seed)
    rows = [{"op": "+*"[i % 2], "q": f"Q: {rng.randint(0, 99)}{'+*'[i % 2]}{rng.randint(0, 99)}=\nA:"}
            for i in range(n)]
    rng.shuffle(rows)
    return datasets.Dataset.from_list(rows)


def _prompt(row):
    return SYSTEM + BLOCKS[row["op"]] + row["q"]


def _job(path, **gen):
    return dict(prompt_fn=_prompt, progress=False, checkpoint_path=path, return_stats=True,
                generation_kwargs=dict(dict(max_new_tokens=3, do_sample=False), **gen))


class _Ban(LogitsProcessor):
    """Never pick ``token``."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


# ------------------------------------------------------------------ 4: another job's checkpoint resumed
def test_rerun_with_another_logits_processor_is_refused_not_resumed(model, tokenizer, tmp_path):
    """A rerun with another logits processor returned the first run's completions; a processor is an object that
    cannot be compared between runs, so a checkpoint with finished rows is refused, naming the setting."""
    data, plain_path, path = _few_shot(4), tmp_path / "plain.jsonl", tmp_path / "c.jsonl"
    plain, _ = generate_dataset(model, tokenizer, data, **_job(plain_path))
    ban = plain["completion"][0][0]  # the first row's first character, banned: other completions
    ban_id = tokenizer(ban, add_special_tokens=False)["input_ids"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, _ = generate_dataset(model, tokenizer, data,
                                    **_job(path, logits_processor=LogitsProcessorList([_Ban(ban_id)])))
    assert first["completion"] != plain["completion"]

    written = path.read_bytes()
    for processors in ([_Ban(ban_id + 1)], [_Ban(ban_id)]):  # another one, or maybe the same: not checkable
        with pytest.raises(ValueError, match=rf"(?s){re.escape(str(path))} holds 4 finished rows.*`logits_processor`"
                                             r".*Delete the file"):
            generate_dataset(model, tokenizer, data, **_job(path, logits_processor=LogitsProcessorList(processors)))
    assert path.read_bytes() == written  # the refused file is left as it was
    # The first run said so when it started.
    said = [str(w.message) for w in caught]
    assert any(re.search(rf"logits_processor cannot be compared between runs.*{re.escape(str(path))}", m) for m in said)
    # A job without a processor is another job than one with (the fingerprint names the processor's type).
    with pytest.raises(ValueError, match="other prompts or generation settings"):
        generate_dataset(model, tokenizer, data, **_job(path))
    # An empty list holds no object: compared as a value, resumed.
    empty = _job(tmp_path / "empty.jsonl", logits_processor=LogitsProcessorList())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_dataset(model, tokenizer, data, **empty)
        out, stats = generate_dataset(model, tokenizer, data, **empty)
    assert stats.rows_resumed == 4 and out["completion"] == plain["completion"]


def test_eos_token_id_tensor_is_fingerprinted_by_value(model, tokenizer, tmp_path):
    """``eos_token_id`` given as a tensor was left out of the fingerprint: a rerun with another EOS resumed the first
    run's completions. Tensors are now compared by value (the same ids in a new tensor resume)."""
    data, path = _few_shot(4), tmp_path / "c.jsonl"
    plain, _ = generate_dataset(model, tokenizer, data, **_job(None))
    stop = tokenizer(plain["completion"][0][1], add_special_tokens=False)["input_ids"][0]
    first, _ = generate_dataset(model, tokenizer, data, **_job(path, eos_token_id=torch.tensor(stop)))
    assert first["completion"] != plain["completion"]  # the EOS cut some rows short
    with pytest.raises(ValueError, match=r"(?s)another job.*other prompts or generation settings"):
        generate_dataset(model, tokenizer, data, **_job(path, eos_token_id=torch.tensor(stop + 1)))
    out, stats = generate_dataset(model, tokenizer, data, **_job(path, eos_token_id=torch.tensor(stop)))
    assert stats.rows_resumed == 4 and out["completion"] == first["completion"]
    # A tensor of several EOS ids (generate() takes one) failed in int(); each row is cut at its first.
    both, _ = generate_dataset(model, tokenizer, data, **_job(None, eos_token_id=torch.tensor([stop + 1, stop])))
    assert both["completion"] == generate_dataset(model, tokenizer, data,
                                                  **_job(None, eos_token_id=[stop + 1, stop]))[0]["completion"]


# ------------------------------------------------------------------ 13: the preamble prefilled once on resume
def _count_preamble_prefills(model, preamble: list[int]):
    """Rows run through the model that hold ``preamble`` at positions 0.. (the preamble prefilled once each)."""
    seen = []

    def hook(module, args, kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or positions is None:
            seen.append("unknown")
            return
        positions = positions.expand(ids.shape[0], -1)
        for row, pos in zip(ids.tolist(), positions.tolist()):
            start = pos.index(0) if 0 in pos else None
            if start is not None and row[start:start + len(preamble)] == preamble:
                seen.append("preamble")

    return seen, model.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_resumed_job_prefills_the_dataset_wide_preamble_once(model, tokenizer, tmp_path):
    """Resumed rows fall into other batches than a fresh run's; the carried prefix was then re-prefilled from its
    first token whenever the next batches shared another part of it (the preamble again for each group: 347
    shared-prefix tokens prefilled for 40 resumed rows against 199 for all 48 fresh). The carried prefix now grows and
    shrinks along the sorted rows: only tokens not carried yet are prefilled."""
    data, path = _few_shot(48), tmp_path / "c.jsonl"
    job = dict(_job(path), max_batch_size=4)
    preamble = tokenizer(SYSTEM)["input_ids"]
    seen, handle = _count_preamble_prefills(model, preamble)
    try:
        full, fresh = generate_dataset(model, tokenizer, data, **job)
        assert seen.count("preamble") == 1 and "unknown" not in seen
        lines = path.read_text().splitlines()
        keep = set(random.Random(0).sample(range(48), 8))  # finished rows scattered over the sorted order
        path.write_text("\n".join([lines[0]] + [x for x in lines[1:] if json.loads(x)["index"] in keep]) + "\n")
        seen.clear()
        out, resumed = generate_dataset(model, tokenizer, data, **job)
    finally:
        handle.remove()
    assert resumed.rows_resumed == 8 and resumed.rows_generated == 40
    assert out["completion"] == full["completion"]
    assert seen.count("preamble") == 1 and "unknown" not in seen
    # Shared-prefix tokens prefilled: the preamble and each block once; at most one batch that straddles the two
    # blocks prefills each block's part again below the preamble; a few short segments.
    length = {op: len(tokenizer(SYSTEM + block)["input_ids"]) for op, block in BLOCKS.items()}
    blocks = sum(length.values()) - 2 * len(preamble)
    bound = len(preamble) + 2 * blocks + 8
    assert fresh.prefix_tokens_prefilled <= bound and resumed.prefix_tokens_prefilled <= bound


# ------------------------------------------------------------------ 9c: a hand-edited checkpoint line
@pytest.mark.parametrize("num_return, completion", [(1, 42), (1, None), (1, ["a"]), (2, ["a"]), (2, "a")])
def test_checkpoint_line_of_another_shape_is_refused_naming_file_and_line(model, tokenizer, tmp_path, num_return,
                                                                          completion):
    """A line edited to a completion that is not a string (or not num_return_sequences strings) failed in pyarrow
    after the whole job had run."""
    data, path = _few_shot(3), tmp_path / "c.jsonl"
    gen = dict(num_return_sequences=num_return, do_sample=num_return > 1)
    torch.manual_seed(0)
    generate_dataset(model, tokenizer, data, **_job(path, **gen))
    lines = path.read_text().splitlines()
    record = json.loads(lines[2])
    lines[2] = json.dumps({"index": record["index"], "completion": completion})
    path.write_text("\n".join(lines) + "\n")
    written = path.read_bytes()
    want = "a string" if num_return == 1 else "a list of 2 strings"
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 3, .*completion must be {want}.*"
                                         r"Fix or delete that line"):
        generate_dataset(model, tokenizer, data, **_job(path, **gen))
    assert path.read_bytes() == written
    lines[2] = json.dumps({"index": 7, "completion": "x"})  # a row this job does not have
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 3, .*index must be a row number in \[0, 3\); got 7"):
        generate_dataset(model, tokenizer, data, **_job(path, **gen))


# ------------------------------------------------------------------ 7: a compile record of the wrong shape
# (records are markers now, read by their existence only: tests/test_builtin_kernels.py)


# ------------------------------------------------------------------ 9b: HF_CASCADE_CACHE=OFF
@pytest.mark.parametrize("off", ["off", "OFF", "Off", "0", "false", "FALSE", "no", "No"])
def test_cache_variables_turned_off_in_any_case(off, monkeypatch, tmp_path):
    """``HF_CASCADE_CACHE=OFF`` was taken as a folder named ``OFF`` (weights and compile records written there)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_CASCADE_RECORDS", raising=False)
    monkeypatch.setenv("HF_CASCADE_CACHE", off)
    assert gguf_cache_root() is None and tiers.records_folder() is None
    monkeypatch.setenv("HF_CASCADE_RECORDS", off)
    assert tiers.records_folder() is None
    monkeypatch.setenv("HF_CASCADE_CACHE", str(tmp_path / "cache"))
    assert gguf_cache_root() == str(tmp_path / "cache") and tiers.records_folder() is None
    monkeypatch.delenv("HF_CASCADE_RECORDS")
    assert tiers.records_folder() == os.path.join(str(tmp_path / "cache"), "compile_records")
    assert gguf_cache_root(off) is None  # load_gguf's cache_dir= too


# ------------------------------------------------------------------ 10: Falcon in a fresh process
_FRESH_PROCESS = """
{first}
import hf_cascade
from transformers import AutoModelForCausalLM, FalconConfig, GPTNeoConfig

configs = {{"Falcon": FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
           "GPT-Neo": GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                   attention_types=[[["global", "local"], 1]])}}
for name, config in configs.items():
    try:
        AutoModelForCausalLM.from_config(config, attn_implementation="cascade")
        print(name, "LOADED")
    except Exception as err:
        print(name, type(err).__name__, str(err).replace(chr(10), " "))
    AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # other implementations untouched
"""


@pytest.mark.parametrize("first", ["", "import transformers.modeling_utils",
                                   "import transformers.models.falcon.modeling_falcon"])
def test_models_with_their_own_attention_table_refused_in_a_fresh_process(first):
    """In a fresh process that imported hf_cascade, the registration ran while Falcon's module (whose import loads
    transformers' attention registry) was still half-built: its table got no "cascade" entry, and loading the model
    raised a bare ``KeyError: 'cascade'``. Whatever was imported first, the refusal is now the clear one."""
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS.format(first=first)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("Falcon", "GPT-Neo")))
    for name in ("Falcon", "GPT-Neo"):
        assert lines[name].startswith(f"NotImplementedError {name} does not route attention through transformers' "
                                      "AttentionInterface"), lines[name]
        assert "attn_implementation='sdpa'" in lines[name]


# ------------------------------------------------------------------ 11: write_custom_generate keeps edits
def test_write_custom_generate_keeps_a_copy_of_an_edited_file(tmp_path):
    """A user's edits of the generate.py hf_cascade had written were overwritten without a word."""
    (tmp_path / "config.json").write_text("{}")
    path = hf_cascade.write_custom_generate(str(tmp_path))
    written = open(path).read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf_cascade.write_custom_generate(str(tmp_path)) == path  # unchanged: rewritten, no copy
    assert sorted(os.listdir(os.path.dirname(path))) == ["generate.py", "requirements.txt"]
    edits = []
    for n, backup in enumerate([path + ".bak", path + ".bak.1"]):
        edited = written + f"\n# my change {n}\n"
        edits.append(edited)
        with open(path, "w") as f:
            f.write(edited)
        with pytest.warns(UserWarning, match=rf"{re.escape(path)} differs .* kept in {re.escape(backup)}"):
            hf_cascade.write_custom_generate(str(tmp_path))
        assert open(path).read() == written
    assert [open(path + suffix).read() for suffix in (".bak", ".bak.1")] == edits  # no copy overwritten
