"""When does storing a shared segment once (a cascade level) beat folding it into every row's suffix?

Two costs decide it, per segment of ``n`` tokens shared by ``r`` rows:

* **The prefill.** Folded, the segment goes through the model once per row: ``(r - 1)·n`` more prompt tokens,
  and as many more tokens of KV kept. For a generate() call of a few dozen new tokens this is usually the larger
  cost: on an H100, Llama-3-8B shape, a prompt token costs ~36–40 µs of prefill, and one more prefix level costs a
  decode step ~0.54 ms (``benchmarks/results/profile_stream.jsonl``, a16b170: 2-level trees 10.9–11.0 ms per step
  against 10.4 ms for 1 level; one-token calls of 6,144 and 9,216 prompt tokens 0.22 and 0.37 s). A level's cost
  is shared by all of its nodes, so a node is charged for its share of the batch's rows. Without this term the
  layout stream's levels of 8 nodes of 512 tokens (4 rows each) and 16 nodes of 256 (2 rows each) were folded into
  the rows, and those calls took 0.59–1.0 s of planning and prefill (a16b170); stored once, 0.29–0.39 s (4a8d3af,
  same file). A segment whose copies would hold at least ``min_saved_tokens`` tokens is stored once in any case
  (memory).
* **The decode kernel.** Per decode step the attention reads ``n + r·s`` tokens of KV as a cascade level against
  ``r·(n + s)`` flat (``s``: each row's own tokens). Measured on an H100 80GB HBM3 (96-point decode-step grid of
  ``benchmarks/bench_kernels.py``, GQA 32/8 and MHA 32/32, d=128, bf16, B in {1, 8, 32, 64, 128, 256}, P in {1K,
  4K, 16K, 32K}, S in {128, 1K}; ``benchmarks/results/kernels.jsonl``): with ``B >= 8`` and
  ``B·(P+S)/(P+B·S) >= 1.9`` cascade beat SDPA on per-row KV at every measured point; at B=1 it never did
  (0.39–0.99x), and at B=8, P=1K, S=1K it broke even (0.99x).

**The first tier where it attends node by node** (``builtin=True``: PyTorch's own kernels,
:mod:`hf_cascade.ops.builtin_cascade`, the tier a process's first calls run on, where a level cannot be one
variable-length flash call: fp32, soft-capping, other head sizes,
:func:`~hf_cascade.ops.builtin_cascade.levels_in_one_call`; where it can, a level is charged as on the other
tiers): every node of a level is one more attention call per layer and step, so a node is charged the whole of
``builtin_node_us_per_step``, not a share of its level's cost. Measured (H200,
a TRL GRPO rollout: Qwen2.5-1.5B shape, 28 layers, 16 prompts of ~250 tokens x 8 samples x 256 new tokens, a profile
of one call, ``benchmarks/results/probe_trl_step.jsonl``, ``e734fe7``): PyTorch's flash-decoding and its combines
took 0.54 s of GPU time over 256 steps x 252 node calls, ~8.4 µs a call: ~235 µs per node and step for 28 layers,
~270 µs for 32. With it that rollout's prompts are folded into their rows on the first tier (the system prompt stays
shared; 8 rows x 250 tokens save 11 ms of prefill against 60 ms of node calls): three first-tier calls took 4.59,
3.41 and 3.40 s with 2 of its 16 prompts still shared, against 3.59-3.65 s with all shared (one H200,
``benchmarks/results/trl_rollout.jsonl``, ``111fb41`` against ``fae54ca``).

A segment becomes a level when either view says so. :meth:`CascadeCostModel.for_model` scales the two prefill
constants to a model (prefill cost with its non-embedding parameters, the level's cost with its layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_cascade.model_scan import non_embedding_parameters

# Measured for the reference model: Llama-3-8B shape (7.50e9 parameters besides the input embedding, as
# transformers' ``num_parameters(exclude_embeddings=True)`` counts them; 32 layers), bf16, H100.
_REFERENCE_PARAMETERS = 7.50e9
_REFERENCE_LAYERS = 32


@dataclass(frozen=True)
class CascadeCostModel:
    """Decides per shared segment whether it becomes a cascade level (see the module docstring).

    Attributes:
        min_rows: fewest rows for which a shared pass pays in the decode kernel (H100: 8).
        min_byte_ratio: smallest ``rows·(n+s) / (n + rows·s)`` (flat bytes over cascade bytes) that pays (H100: 1.9).
        new_tokens: decode steps expected; the rows' suffixes grow by this many tokens.
        min_saved_tokens: store a segment once anyway when its per-row copies would hold this many tokens.
        prefill_us_per_token: prefill time of one prompt token through the model (µs; H100, Llama-3-8B: 36).
        level_us_per_step: decode time one more prefix level adds to a step (µs; H100, Llama-3-8B: 540).
        batch_rows: rows of the batch (a node is charged ``rows / batch_rows`` of its level's cost); None: the
            whole cost.
        builtin: the call attends on the first tier's built-in kernels, node by node (see the module docstring).
        builtin_node_us_per_step: decode time one more node adds to a step on the first tier (µs; H200, 32
            layers: 270).
    """

    min_rows: int = 8
    min_byte_ratio: float = 1.9
    new_tokens: int = 64
    min_saved_tokens: int = 2048
    prefill_us_per_token: float = 36.0
    level_us_per_step: float = 540.0
    batch_rows: int | None = None
    builtin: bool = False
    builtin_node_us_per_step: float = 270.0

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, new_tokens: int | None = None, batch_rows: int | None = None,
                  **overrides) -> CascadeCostModel:
        """The H100-measured model with its prefill constants scaled to ``model``: prefill time with the
        non-embedding parameters (its FLOPs per token), a level's time with the number of layers."""
        config = model.config.get_text_config()
        layers = getattr(config, "num_hidden_layers", None) or _REFERENCE_LAYERS
        parameters = non_embedding_parameters(model)
        scaled = dict(
            prefill_us_per_token=cls.prefill_us_per_token * parameters / _REFERENCE_PARAMETERS,
            level_us_per_step=cls.level_us_per_step * layers / _REFERENCE_LAYERS,
            builtin_node_us_per_step=cls.builtin_node_us_per_step * layers / _REFERENCE_LAYERS,
        )
        if new_tokens:
            scaled["new_tokens"] = new_tokens
        return cls(**{**scaled, "batch_rows": batch_rows, **overrides})

    def share(self, rows: int, tokens: int, suffix_tokens: float = 0.0) -> bool:
        """True if ``tokens`` shared by ``rows`` rows, each followed by ``suffix_tokens`` of its own, should be a level."""
        if rows < 2 or tokens < 1:
            return False
        saved = (rows - 1) * tokens  # prompt tokens prefilled and stored once instead of once per row
        if saved >= self.min_saved_tokens:
            return True
        if self.builtin:  # node by node: the node's own attention calls
            step_cost = self.builtin_node_us_per_step
        else:  # one launch per level: the node's share of it
            step_cost = self.level_us_per_step * (1.0 if not self.batch_rows else min(1.0, rows / self.batch_rows))
        if saved * self.prefill_us_per_token >= self.new_tokens * step_cost:
            return True
        if rows < self.min_rows:
            return False
        s = suffix_tokens + self.new_tokens
        return rows * (tokens + s) / (tokens + rows * s) >= self.min_byte_ratio
