"""hf_cascade: cascade (shared-prefix) attention and context parallelism inside transformers ``generate()``.

``import hf_cascade`` registers the attention implementation ``"cascade"``; load models with
``AutoModelForCausalLM.from_pretrained(..., attn_implementation="cascade")``.
"""

from hf_cascade.attention import ATTENTION_NAME, register

register()

from hf_cascade.ops._backend import warm_triton_key  # noqa: E402

warm_triton_key()  # CUDA only: Triton's cache key hashed while the model loads (see its docstring)

from hf_cascade.cache import CascadeCache  # noqa: E402
from hf_cascade.generation import generate  # noqa: E402
from hf_cascade.checkpoint import write_custom_generate  # noqa: E402
from hf_cascade.dataset_generation import GenerationInterrupted, GenerationStats, generate_dataset  # noqa: E402
from hf_cascade.inputs import shared_prefix_inputs  # noqa: E402
from hf_cascade.prefix_tree import PrefixTree, find_shared_prefixes  # noqa: E402
from hf_cascade.transformers_compat import CACHE_KWARG  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_NAME",
    "CACHE_KWARG",
    "CascadeCache",
    "ContextParallelCache",
    "context_parallel_inputs",
    "PrefixTree",
    "find_shared_prefixes",
    "generate",
    "generate_dataset",
    "GenerationInterrupted",
    "GenerationStats",
    "register",
    "score",
    "ScoreOutput",
    "shared_prefix_inputs",
    "write_custom_generate",
]


def __getattr__(name):
    # Context parallelism pulls in torch.distributed machinery; import it on first use.
    if name in ("context_parallel_inputs", "ContextParallelCache"):
        import hf_cascade.parallel

        return getattr(hf_cascade.parallel, name)
    if name in ("score", "ScoreOutput"):  # shared-prefix scoring (log-likelihoods), imported on first use
        import hf_cascade.scoring

        return getattr(hf_cascade.scoring, name)
    raise AttributeError(f"module 'hf_cascade' has no attribute {name!r}")
