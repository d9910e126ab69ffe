"""Cascade attention ops: shared-prefix pass, per-row suffix pass, exact LSE merge, and
``cascade_attention`` (all of them in one call: one launch per prefix level + one), ``CascadeWrapper`` (a cache's one
door to it: plan once per batch layout, run per layer), and ``write_suffix_kv`` (a decode step's new KV into fixed
buffers).

Every op has a Triton kernel (CUDA, or CPU with ``TRITON_INTERPRET=1``) and an fp32 PyTorch path
(``backend="torch"``, the CPU path). LSE is the natural log, float32, everywhere; an attention
state over no keys has ``lse = -inf``. Importing this package never imports Triton.
"""

from ._backend import triton_available
from .cascade_attention import cascade_attention
from .cascade_wrapper import CascadeWrapper
from .kv_write import write_suffix_kv
from .merge import merge_attention_states
from .plan import CascadePlan, PrefixPlan, plan_cascade, plan_shared_prefix
from .prefix_attention import shared_prefix_attention
from .reference import (
    merge_attention_states_ref,
    shared_prefix_attention_ref,
    suffix_attention_ref,
    write_suffix_kv_ref,
)
from .suffix_attention import suffix_attention

__all__ = [
    "CascadePlan",
    "CascadeWrapper",
    "PrefixPlan",
    "plan_cascade",
    "cascade_attention",
    "merge_attention_states",
    "merge_attention_states_ref",
    "plan_shared_prefix",
    "shared_prefix_attention",
    "shared_prefix_attention_ref",
    "suffix_attention",
    "suffix_attention_ref",
    "triton_available",
    "write_suffix_kv",
    "write_suffix_kv_ref",
]
