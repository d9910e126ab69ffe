"""The checkpoint file of :func:`~hf_cascade.dataset_generation.generate_dataset`: finished rows kept on disk, so that
a job stopped by a crash or Ctrl-C resumes where it was, and a file written by another job is refused.

JSON lines: a header naming the job (a fingerprint of the prompts and the generation settings, the model and the
tokenizer), then one ``{"index": i, "completion": ...}`` per finished row, appended and flushed after every batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import numpy as np
import torch

__all__ = ["CHECKPOINT_VERSION", "Checkpoint"]

CHECKPOINT_VERSION = 2  # 2: the header records the model and the tokenizer (1 did not)


# generate() arguments that do not change the completions: left out of the fingerprint.
_NO_EFFECT_KWARGS = frozenset({"streamer"})


class _Unverifiable(Exception):
    """A setting whose value cannot be written down to be compared with another run's (an object)."""


def _describe_setting(value):
    """``value`` as JSON-able data that two runs compare by value: tensors and arrays by dtype, shape and values, a
    ``GenerationConfig`` by its fields, containers item by item. Raise :class:`_Unverifiable` for anything else
    (logits processors, stopping criteria, functions: objects whose behaviour their attributes need not show)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        array = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        return {"tensor": str(array.dtype).removeprefix("torch."), "shape": list(array.shape),
                "values": array.flatten().tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_describe_setting(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _describe_setting(v) for k, v in value.items()}
        return {"items": [[_describe_setting(k), _describe_setting(v)] for k, v in value.items()]}
    from transformers import GenerationConfig

    if isinstance(value, GenerationConfig):
        fields = {k: v for k, v in value.to_dict().items() if k != "transformers_version"}
        return {"generation_config": _describe_setting(fields)}
    raise _Unverifiable


def _job_settings(gen_kwargs: dict) -> tuple[dict, list[str]]:
    """``(settings, unverifiable)``: the generation kwargs as JSON-able data compared by value, and the names of
    those that cannot be (recorded by their type only: a rerun cannot tell whether they are the same)."""
    settings, unverifiable = {}, []
    for key, value in sorted(gen_kwargs.items()):
        if key in _NO_EFFECT_KWARGS:
            continue
        try:
            json.dumps(value)
            settings[key] = value  # plain JSON: as written by earlier versions (their fingerprints still match)
            continue
        except (TypeError, ValueError):
            pass
        try:
            settings[key] = _describe_setting(value)
        except _Unverifiable:
            settings[key] = {"unverifiable": f"{type(value).__module__}.{type(value).__qualname__}"}
            unverifiable.append(key)
    return settings, unverifiable


def _fingerprint(rows, settings: dict, skip_special_tokens, output_column) -> str:
    """A hash of the prompts' token ids and the job's settings (from :func:`_job_settings`)."""
    digest = hashlib.sha256()
    for ids in rows:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    settings = dict(settings)
    settings["skip_special_tokens"] = skip_special_tokens
    settings["output_column"] = output_column
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()[:32]


# Config fields that do not change what the model computes, or that are recorded on their own (the dtype, the
# name): left out of the config hash, so that the same model loaded another way still resumes its checkpoint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
_WEIGHT_SAMPLES_PER_TENSOR = 16


def _short_hash(payload: bytes | str) -> str:
    if isinstance(payload, str):
        payload = payload.encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def _stable_config(value):
    """A config dict (nested sub-configs included) without its volatile fields, as plain JSON-able data."""
    if isinstance(value, dict):
        return {
            str(k): _stable_config(v)
            for k, v in value.items()
            if k not in _VOLATILE_CONFIG_KEYS and not str(k).startswith("_attn_implementation")
        }
    if isinstance(value, (list, tuple)):
        return [_stable_config(v) for v in value]
    return value


def _dtype_name(dtype) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


@torch.no_grad()
def _weights_hash(model) -> str | None:
    """A hash of a few values of every parameter (evenly spaced through each tensor), with their names and
    shapes: cheap (one small gather per tensor, no full copy), and enough to tell two random inits or two
    fine-tunes of one config apart. Tensors that cannot be read here (meta / offloaded, exotic subclasses) are
    skipped; None when none could be read."""
    digest = hashlib.sha256()
    read = 0
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}|".encode())
        numel = param.numel()
        if numel == 0 or param.device.type == "meta":
            continue
        try:
            k = min(_WEIGHT_SAMPLES_PER_TENSOR, numel)
            flat_index = torch.arange(k, dtype=torch.int64) * (numel - 1) // max(k - 1, 1)
            coords = torch.unravel_index(flat_index.to(param.device), tuple(param.shape))
            values = param.detach()[coords].to(torch.float64).cpu()
        except (RuntimeError, TypeError, NotImplementedError, IndexError):
            continue
        digest.update(values.numpy().tobytes())
        read += 1
    return digest.hexdigest()[:16] if read else None


def _describe_model(model) -> dict:
    """What the checkpoint header records about the model: name (for messages), class, parameter dtype, a hash of
    its config (volatile fields excluded) and a hash of a sample of its weights."""
    config = model.config
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None) or ""
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    config_json = json.dumps(_stable_config(config.to_dict()), sort_keys=True, default=str)
    return {
        "name": str(name),
        "class": type(model).__name__,
        "dtype": _dtype_name(dtype),
        "config_sha256": _short_hash(config_json),
        "weights_sha256": _weights_hash(model),
    }


def _describe_tokenizer(tokenizer) -> dict:
    """What the checkpoint header records about the tokenizer: name (for messages), vocabulary size (added tokens
    included) and a hash of its vocabulary (``get_vocab()`` items, sorted)."""
    name = getattr(tokenizer, "name_or_path", None) or ""
    try:
        vocab = tokenizer.get_vocab()
        vocab_hash = _short_hash(json.dumps(sorted((str(t), int(i)) for t, i in vocab.items()), ensure_ascii=False))
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        vocab, vocab_hash = None, None
    try:
        vocab_size = len(tokenizer)
    except TypeError:
        vocab_size = len(vocab) if vocab is not None else getattr(tokenizer, "vocab_size", None)
    return {"name": str(name), "class": type(tokenizer).__name__, "vocab_size": vocab_size, "vocab_sha256": vocab_hash}


def _model_difference(old: dict, new: dict) -> str | None:
    """None if ``old`` and ``new`` (from :func:`_describe_model`) describe the same model, else a line naming
    what differs. The name is not compared (the same weights may be loaded from another directory), except when
    the weights could not be hashed."""
    what = []
    if old.get("class") != new.get("class"):
        what.append(f"class {old.get('class')} vs {new.get('class')}")
    if old.get("dtype") != new.get("dtype"):
        what.append(f"dtype {old.get('dtype')} vs {new.get('dtype')}")
    if old.get("config_sha256") != new.get("config_sha256"):
        what.append("config")
    # Another dtype changes every weight: name only the dtype then.
    if old.get("dtype") == new.get("dtype"):
        if old.get("weights_sha256") != new.get("weights_sha256"):
            what.append(f"weights (sample hash {old.get('weights_sha256')} vs {new.get('weights_sha256')})")
        elif old.get("weights_sha256") is None and old.get("name") != new.get("name"):
            what.append("name (weights could not be hashed)")
    if not what:
        return None

    def label(info):
        return f"{info.get('name') or '<unnamed>'!r} ({info.get('class')}, {info.get('dtype')})"

    return f"model: checkpoint written by {label(old)}, this call uses {label(new)}; they differ in " + ", ".join(
        what
    )


def _tokenizer_difference(old: dict, new: dict) -> str | None:
    """None if ``old`` and ``new`` (from :func:`_describe_tokenizer`) describe the same vocabulary, else a line
    naming what differs (the name is not compared)."""
    what = []
    if old.get("vocab_size") != new.get("vocab_size"):
        what.append(f"vocabulary size {old.get('vocab_size')} vs {new.get('vocab_size')}")
    elif old.get("vocab_sha256") != new.get("vocab_sha256"):
        what.append("vocabulary")
    if not what:
        return None

    def label(info):
        return f"{info.get('name') or '<unnamed>'!r} ({info.get('class')})"

    return f"tokenizer: checkpoint written with {label(old)}, this call uses {label(new)}; they differ in " + (
        ", ".join(what)
    )


def _is_row_index(value, rows: int) -> bool:
    """Whether ``value`` is a row number of a job of ``rows`` rows (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < rows


def _is_completion(value, num_return: int) -> bool:
    """Whether ``value`` is what generate_dataset writes for one row: a string, or a list of ``num_return``."""
    if num_return == 1:
        return isinstance(value, str)
    return isinstance(value, list) and len(value) == num_return and all(isinstance(v, str) for v in value)


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Checkpoint:
    """JSON lines: a header ``{"hf_cascade_checkpoint": 2, "fingerprint": ..., "rows": N, "output_column": ...,
    "model": {...}, "tokenizer": {...}}`` then one ``{"index": i, "completion": ...}`` per finished row, appended
    and flushed after every batch. ``model`` and ``tokenizer`` are :func:`_describe_model` and
    :func:`_describe_tokenizer`: kept as readable fields so that a refusal can name what differs."""

    @classmethod
    def for_job(cls, path, rows, gen_kwargs: dict, skip_special_tokens: bool, output_column: str, model,
                tokenizer) -> "Checkpoint":
        """The checkpoint at ``path`` of the job that generates for ``rows`` (token ids) with these settings, this
        model and this tokenizer (call :meth:`load` to read what it finished)."""
        settings, unverifiable = _job_settings(gen_kwargs)
        checkpoint = cls(path, _fingerprint(rows, settings, skip_special_tokens, output_column), len(rows),
                         output_column, _describe_model(model), _describe_tokenizer(tokenizer))
        checkpoint.unverifiable = unverifiable
        checkpoint.num_return = int(gen_kwargs.get("num_return_sequences") or 1)
        return checkpoint

    def __init__(self, path, fingerprint: str, num_rows: int, output_column: str, model: dict, tokenizer: dict):
        self.path = os.fspath(path)
        self.header = {
            "hf_cascade_checkpoint": CHECKPOINT_VERSION,
            "fingerprint": fingerprint,
            "rows": num_rows,
            "output_column": output_column,
            "model": model,
            "tokenizer": tokenizer,
        }
        # generation kwargs that cannot be compared with the run that wrote the file (see _job_settings)
        self.unverifiable: list[str] = []
        self.num_return = 1  # completions per row: a string each, or a list of this many strings

    def load(self) -> dict[int, object]:
        """Finished rows from an existing file (creating it with its header if absent). Raises a ValueError, the
        file untouched, for a file of another job, a line edited into another shape, or finished rows this call's
        settings cannot be checked against (:attr:`unverifiable`)."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            done, rewrite = {}, True
        else:
            done, rewrite = self._read()
        if done and self.unverifiable:
            self._refuse_unverifiable(len(done))
        if self.unverifiable:
            warnings.warn(
                f"generate_dataset: generation_kwargs {', '.join(self.unverifiable)} cannot be compared between runs "
                f"(objects, not values): if this job stops, {self.path} cannot be resumed.", stacklevel=3,
            )
        if rewrite:
            self._rewrite(done)
        return done

    def _read(self) -> tuple[dict[int, object], bool]:
        """``(finished rows, whether the file must be rewritten)`` from the existing file."""
        done: dict[int, object] = {}
        clean = True
        # Read as bytes and decode line by line: a crash (or a full disk) while appending can cut the last line
        # inside a multi-byte UTF-8 character; that line is dropped (its rows generated again), not the file.
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        try:
            header = json.loads(lines[0].decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict) or header.get("hf_cascade_checkpoint") is None:
            raise ValueError(
                f"{self.path} exists but is not a generate_dataset checkpoint. Pass another `checkpoint_path=` or "
                "delete the file."
            )
        self._check_header(header)
        for number, line in enumerate(lines[1:], start=2):
            if not line:
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                clean = False  # a line cut short by a crash: that row is generated again
                continue
            index, completion = self._check_record(record, number)
            done[index] = completion
        return done, not clean or lines[-1] != b""

    def _check_record(self, record, number: int) -> tuple[int, object]:
        """``(index, completion)`` of a decoded line, or a ValueError naming the file and the line: a whole line
        of another shape was not cut by a crash but edited (its completion would fail, or be wrong, later)."""
        if not isinstance(record, dict):
            problem = f'it must be an object {{"index": row, "completion": ...}}; got {_short_repr(record)}'
        elif not _is_row_index(record.get("index"), self.header["rows"]):
            problem = f"its index must be a row number in [0, {self.header['rows']}); got {record.get('index')!r}"
        elif not _is_completion(record.get("completion"), self.num_return):
            want = "a string" if self.num_return == 1 else f"a list of {self.num_return} strings"
            problem = f"its completion must be {want}; got {_short_repr(record.get('completion'))}"
        else:
            return record["index"], record["completion"]
        raise ValueError(
            f"The checkpoint {self.path}, line {number}, is not a finished row: {problem}. Fix or delete that line "
            "(its row is then generated again), or delete the file to start over."
        )

    def _refuse_unverifiable(self, finished: int) -> None:
        """Refuse to resume rows generated with settings that cannot be compared with this call's."""
        names = ", ".join(f"`{name}`" for name in self.unverifiable)
        raise ValueError(
            f"The checkpoint {self.path} holds {finished} finished rows, but this call's generation_kwargs {names} "
            "cannot be compared with the run that wrote them (objects, not values), so they may not be this call's "
            "completions and are not resumed. Delete the file to generate every row again (a job with such "
            "settings cannot be resumed), or pass another `checkpoint_path=`."
        )

    def _check_header(self, header: dict) -> None:
        """Refuse (ValueError) a checkpoint written by another job, naming what differs."""
        fresh = "Pass another `checkpoint_path=`, or delete the file to start over."
        version = header.get("hf_cascade_checkpoint")
        model, tokenizer = header.get("model"), header.get("tokenizer")
        if version != CHECKPOINT_VERSION or not isinstance(model, dict) or not isinstance(tokenizer, dict):
            age = "an older" if isinstance(version, int) and version < CHECKPOINT_VERSION else "another"
            raise ValueError(
                f"The checkpoint {self.path} was written by {age} version of hf_cascade (checkpoint format "
                f"{version!r}; this one writes format {CHECKPOINT_VERSION}, which records the model and the "
                "tokenizer), so it cannot be checked against this call's model and tokenizer and is not resumed. "
                + fresh
            )
        differences = [
            _model_difference(model, self.header["model"]),
            _tokenizer_difference(tokenizer, self.header["tokenizer"]),
        ]
        if header.get("fingerprint") != self.header["fingerprint"] or header.get("rows") != self.header["rows"]:
            differences.append(
                f"other prompts or generation settings: {header.get('rows')} rows, fingerprint "
                f"{header.get('fingerprint')}; this call: {self.header['rows']} rows, fingerprint "
                f"{self.header['fingerprint']}"
            )
        differences = [d for d in differences if d]
        if differences:
            raise ValueError(
                f"The checkpoint {self.path} was written by another job; its completions are not this call's:\n"
                + "".join(f"  - {d}\n" for d in differences)
                + fresh
            )

    def _rewrite(self, done: dict[int, object]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.header) + "\n")
            for index, completion in sorted(done.items()):
                f.write(json.dumps({"index": index, "completion": completion}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, finished: dict[int, object]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            for index, completion in finished.items():
                f.write(json.dumps({"index": index, "completion": completion}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
