"""Tiny random-init models built from real transformers configs (no downloads), for tests, examples and demos.

The sizes are tiny so everything runs on a CPU in seconds; the comments give the real model's value.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# family -> (config class name, reference attention implementation, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "sdpa", {}),
    "mistral": ("MistralConfig", "sdpa", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "sdpa", {"num_key_value_heads": 4}),  # MHA variant
    "qwen3": ("Qwen3Config", "sdpa", {"head_dim": 16}),
    "phi3": ("Phi3Config", "sdpa", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "mixtral": ("MixtralConfig", "sdpa", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "gemma": ("GemmaConfig", "sdpa", {"head_dim": 16}),
    "olmo2": ("Olmo2Config", "sdpa", {}),
    "granite": ("GraniteConfig", "sdpa", {}),
    "gemma2": (
        "Gemma2Config",
        "eager",  # transformers has no sdpa path with attention-logit softcapping
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "sliding_window": 4096,
        },
    ),
    # Families of issue 33 (each guarded: a transformers without the config class leaves it out).
    "gpt_oss": (
        "GptOssConfig",
        "eager",  # transformers' sdpa path has no attention sinks
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,  # 64, 128, 4 in gpt-oss-20b
         "num_hidden_layers": 4, "sliding_window": 8},  # 24 layers, window 128: alternate sliding/full as the real one
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "sdpa",
        {"head_dim": 16, "query_pre_attn_scalar": 16,  # 256 in Gemma-3-4B
         "num_hidden_layers": 6, "sliding_window": 8},  # 34 layers, window 1024: five sliding layers, then a full one
    ),
    "smollm3": ("SmolLM3Config", "sdpa", {"num_hidden_layers": 4}),  # 36 layers; every 4th layer without rotary (NoPE)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "sdpa",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},  # 128, 128, 8, 768
    ),
    "llama4": (
        "Llama4TextConfig",
        "sdpa",
        {"num_local_experts": 2, "intermediate_size_mlp": 128, "head_dim": 16,  # 16, 16384, 128 in Llama-4-Scout
         "num_hidden_layers": 4, "attention_chunk_size": 8},  # 48 layers, chunks of 8192; every 4th layer NoPE, full
    ),
}


def available_families() -> list[str]:
    """The :data:`FAMILIES` whose config class this transformers has (Gemma 3, GPT-OSS, SmolLM3, Qwen3-MoE and Llama 4
    need newer releases than the oldest supported one)."""
    import transformers

    return sorted(f for f, (name, _, _) in FAMILIES.items() if hasattr(transformers, name))


# The sizes every tiny config shares (Llama-3-8B's in the comments); families add their own overrides.
TINY_SIZES = dict(
    vocab_size=128,  # 128256 in Llama-3-8B
    hidden_size=64,  # 4096
    intermediate_size=128,  # 14336
    num_hidden_layers=2,  # 32
    num_attention_heads=4,  # 32
    num_key_value_heads=2,  # 8 (GQA)
    max_position_embeddings=512,  # 8192
    initializer_range=0.1,  # 0.02; larger so that random models make varied, tie-free predictions
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(family: str = "llama", **overrides):
    """A real transformers config of ``family`` shrunk to test size (fp32 CPU friendly)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {sorted(FAMILIES)}; got {family!r}.")
    class_name, _, family_overrides = FAMILIES[family]
    if not hasattr(transformers, class_name):
        raise ValueError(
            f"The tiny {family!r} model needs transformers.{class_name}, which transformers {transformers.__version__} "
            f"does not have; upgrade transformers, or pick one of {available_families()}."
        )
    kwargs = dict(TINY_SIZES)
    kwargs.update(family_overrides)
    kwargs.update(overrides)
    return getattr(transformers, class_name)(**kwargs)


def reference_attention(family: str) -> str:
    """The transformers attention implementation a cascade model of ``family`` must match."""
    return FAMILIES[family][1]


def tiny_model(
    family: str = "llama",
    attn_implementation: str = "cascade",
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config=None,
    **overrides,
):
    """A random-init causal LM of ``family`` (weights fixed by ``seed``), in eval mode; ``dtype`` default float32.

    Two calls with the same ``family``/``seed``/``overrides`` give identical weights, whatever
    ``attn_implementation`` is; each gets its own deep copy of the config (a shared config object would make a
    "reference" model silently run another attention implementation).
    """
    import torch
    from transformers import AutoModelForCausalLM

    import hf_cascade  # noqa: F401  (registers "cascade")

    dtype = torch.float32 if dtype is None else dtype
    config = copy.deepcopy(config) if config is not None else tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(
            f"model loaded with {model.config._attn_implementation!r}, expected {attn_implementation!r}"
        )
    return model.to(device).eval()
