"""A checkpoint whose plain ``model.generate(...)`` shares prompt prefixes: :func:`write_custom_generate`.

transformers binds a checkpoint's ``custom_generate/generate.py`` as ``model.generate`` when the folder is loaded
with ``from_pretrained(..., trust_remote_code=True)``. The file written here is a thin call to
:func:`checkpoint_generate`, so what it does follows the installed hf_cascade.

What transformers' ``custom_generate`` hook cannot pass to :func:`hf_cascade.generate` (a tokenizer, so
``stop_strings``; an assistant model; ``synced_gpus``) sends the call to transformers' own generate() with a
one-line warning: exact, without sharing. A ``streamer`` reaches the hook (see
:func:`hf_cascade.generation._arguments_the_hook_drops`) and streams with sharing.
"""

from __future__ import annotations

import os
import warnings

from transformers import GenerationMixin

from hf_cascade.attention import ATTENTION_NAME

_MARK = '"""Written by hf_cascade.write_custom_generate'
_CUSTOM_GENERATE_PY = _MARK + ''': this checkpoint's plain ``model.generate(...)`` (and a pipeline's)
share prompt prefixes through hf_cascade. transformers binds this function as ``model.generate`` when the folder
is loaded with ``from_pretrained(..., trust_remote_code=True)``; delete this folder to undo."""

try:
    from hf_cascade.checkpoint import checkpoint_generate
except ImportError as err:
    raise ImportError(
        "This checkpoint's custom_generate/generate.py (written by hf_cascade.write_custom_generate) needs "
        "hf_cascade: install it from its checkout (`pip install -e /path/to/hf_cascade`; it is not on PyPI), or load "
        "the checkpoint without trust_remote_code=True for transformers' own generate()."
    ) from err


def generate(*args, model, **kwargs):
    return checkpoint_generate(model, *args, **kwargs)
'''
# No requirement line: transformers checks it against installed distributions, which refuses an hf_cascade that is
# importable but not pip-installed; generate.py's import says what is missing instead.
_REQUIREMENTS_TXT = "# hf-cascade: imported by generate.py (written by hf_cascade.write_custom_generate)\n"
_OUR_REQUIREMENTS = {_REQUIREMENTS_TXT, "hf-cascade\n"}  # ("hf-cascade\n": written by earlier versions)

# generate() arguments transformers' custom_generate hook does not pass on (or needs a tokenizer for).
_HOOK_DROPS = ("stop_strings", "tokenizer", "assistant_model", "assistant_tokenizer", "prompt_lookup_num_tokens")


def checkpoint_generate(model, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` of a checkpoint written by :func:`write_custom_generate`: transformers'
    generate() with ``custom_generate=hf_cascade.generate``, or without it (a one-line warning) when the call passes
    what the hook cannot receive (``stop_strings``, ``tokenizer``, an assistant, ``synced_gpus=True``)."""
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)  # without an hf_cascade cache: exactly sdpa
    if "custom_generate" not in kwargs:
        given = [name for name in _HOOK_DROPS if kwargs.get(name) is not None]
        if kwargs.get("synced_gpus"):
            given.append("synced_gpus")
        for config in (kwargs.get("generation_config"), model.generation_config):
            if getattr(config, "stop_strings", None) and "stop_strings" not in given:
                given.append("stop_strings (generation config)")
        if given:
            warnings.warn(
                f"hf_cascade: transformers' custom_generate hook cannot receive {', '.join(given)}; this call runs "
                "transformers' own generate() (exact, no prefix sharing).", stacklevel=2,
            )
        else:
            from hf_cascade.generation import generate

            kwargs["custom_generate"] = generate
    return GenerationMixin.generate(model, *args, **kwargs)


_UNREADABLE = object()  # a file that exists but cannot be read as text


def _read_text(file: str):
    """The text of ``file``, None where there is none, or ``_UNREADABLE``."""
    if not os.path.lexists(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return _UNREADABLE


def _keep_copy(file: str, text: str) -> str:
    """Copy ``text`` (``file``'s content, about to be rewritten) to a new ``file.bak`` (``.bak.1``, ... where taken)
    and warn, naming it."""
    backup, n = f"{file}.bak", 0
    while os.path.lexists(backup):
        n += 1
        backup = f"{file}.bak.{n}"
    with open(backup, "x", encoding="utf-8") as f:
        f.write(text)
    warnings.warn(
        f"hf_cascade: {file} differs from what write_custom_generate writes (edited, or written by another "
        f"version); it is rewritten, and its content kept in {backup}.", stacklevel=3,
    )
    return backup


def write_custom_generate(checkpoint_dir: str) -> str:
    """Make a local checkpoint's plain ``generate()`` use cascade decoding, with no argument at the call.

    Writes ``checkpoint_dir/custom_generate/generate.py`` (+ ``requirements.txt``), transformers' own format for a
    checkpoint's custom decoding. A model loaded with ``AutoModelForCausalLM.from_pretrained(checkpoint_dir,
    trust_remote_code=True)`` then runs ``model.generate(**batch, ...)`` — and ``pipeline("text-generation",
    model=model, ...)`` — through :func:`hf_cascade.generate` (:func:`checkpoint_generate`). Without
    ``trust_remote_code=True`` transformers ignores the file and generate() is the stock one (no sharing).
    Files written by hf_cascade are rewritten; a ``generate.py`` of hf_cascade's that differs from what this
    version writes (edited by hand, or written by another version) is first copied to ``generate.py.bak`` (or
    ``generate.py.bak.1``, ... : no copy is overwritten), with a warning naming the copy. Any other file at those
    paths is never overwritten (a ValueError naming it, before anything is written).

    Args:
        checkpoint_dir: a folder holding a checkpoint (``config.json``), e.g. written by ``save_pretrained``.
    Returns:
        The path of the written ``generate.py``.
    """
    if not os.path.isfile(os.path.join(checkpoint_dir, "config.json")):
        raise ValueError(
            f"`checkpoint_dir` must be a local checkpoint folder with a config.json; {checkpoint_dir!r} has none. "
            "Write one with `model.save_pretrained(checkpoint_dir)` first."
        )
    folder = os.path.join(checkpoint_dir, "custom_generate")
    path = os.path.join(folder, "generate.py")
    requirements = os.path.join(folder, "requirements.txt")
    existing = {}
    for file, ours in ((path, lambda text: text.startswith(_MARK)), (requirements, _OUR_REQUIREMENTS.__contains__)):
        text = _read_text(file)
        if text is not None and (text is _UNREADABLE or not ours(text)):
            raise ValueError(
                f"{file} exists and was not written by hf_cascade: write_custom_generate does not overwrite it. "
                "Move it elsewhere (the checkpoint's own custom generate code), then call write_custom_generate "
                "again."
            )
        existing[file] = text
    if existing[path] not in (None, _CUSTOM_GENERATE_PY):
        _keep_copy(path, existing[path])
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(_CUSTOM_GENERATE_PY)
    with open(requirements, "w", encoding="utf-8") as f:
        f.write(_REQUIREMENTS_TXT)
    return path
