"""Context parallelism: one long prompt's KV sharded over the ranks of a process group, inside ``generate()``.

Prefill runs the prompt in rounds (:mod:`~hf_cascade.parallel.prefill_plan`) of zigzag ring attention
(:mod:`~hf_cascade.parallel.ring`), after a capacity check on every rank (:mod:`~hf_cascade.parallel.capacity`); decode combines per-rank partial
attention exactly (:mod:`~hf_cascade.parallel.combine`: ``"all_gather"``, the default, ``"tree"`` or
``"all_to_all"``); the KV lives in a :class:`~hf_cascade.parallel.cache.ContextParallelCache`. Start with
:func:`context_parallel_inputs`; with ``max_new_tokens=N`` the decode KV lives in fixed buffers
(:mod:`~hf_cascade.parallel.fixed`) and generate() can compile the decode step.
"""

from hf_cascade.parallel.cache import ContextParallelCache
from hf_cascade.parallel.combine import (
    COMBINES,
    combine_all_gather,
    combine_all_to_all,
    combine_local,
    combine_tree,
)
from hf_cascade.parallel.inputs import context_parallel_inputs
from hf_cascade.parallel.layout import ZigzagLayout
from hf_cascade.parallel.ring import ring_attention

__all__ = [
    "COMBINES",
    "ContextParallelCache",
    "ZigzagLayout",
    "combine_all_gather",
    "combine_all_to_all",
    "combine_local",
    "combine_tree",
    "context_parallel_inputs",
    "ring_attention",
]
