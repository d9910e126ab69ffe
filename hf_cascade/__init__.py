"""hf_cascade: cascade (shared-prefix) attention and context parallelism inside transformers ``generate()``.

``import hf_cascade`` registers the attention implementation ``"cascade"`` (as soon as transformers' attention
registry is loaded: see :mod:`hf_cascade._registration`); load models with
``AutoModelForCausalLM.from_pretrained(..., attn_implementation="cascade")``. Nothing else is imported until used:
the names below load their modules on first access.
"""

from hf_cascade._registration import register, register_when_loaded

ATTENTION_NAME = "cascade"

register_when_loaded()

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access, PEP 562)
_LAZY = {
    "CACHE_KWARG": "hf_cascade.transformers_compat",
    "CascadeCache": "hf_cascade.cache",
    "ContextParallelCache": "hf_cascade.parallel",
    "context_parallel_inputs": "hf_cascade.parallel",
    "GenerationInterrupted": "hf_cascade.dataset_generation",
    "GenerationStats": "hf_cascade.dataset_generation",
    "generate_dataset": "hf_cascade.dataset_generation",
    "generate": "hf_cascade.generation",
    "write_custom_generate": "hf_cascade.checkpoint",
    "shared_prefix_inputs": "hf_cascade.inputs",
    "PrefixTree": "hf_cascade.prefix_tree",
    "find_shared_prefixes": "hf_cascade.prefix_tree",
    "score": "hf_cascade.scoring",
    "ScoreOutput": "hf_cascade.scoring",
}

__all__ = ["ATTENTION_NAME", "register", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_cascade' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
