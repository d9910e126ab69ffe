"""When does storing a shared segment once (a cascade level) beat folding it into every row's suffix?

Per decode step and layer, a node of ``n`` tokens shared by ``r`` rows costs

* **as a cascade level:** ``t_level + n * kv_bytes_per_token / bandwidth`` — one prefix pass that reads the node
  once, plus a fixed cost (an extra launch and the merge of its state),
* **folded into the suffixes (flat):** ``r * n * kv_bytes_per_token / bandwidth`` — every row reads its own copy,

and sharing also saves the prefill of ``(r - 1) * n`` tokens once. Over ``new_tokens`` decode steps sharing wins
when ``prefill_saving + new_tokens * ((r - 1) * n * kv_bytes / bandwidth - t_level) > 0``. This is why cascade
loses at short prefixes, small batches and one KV head (few bytes per token), as FlashInfer and vLLM observed.

The constants are H100 measurements (benchmarks/results/kernels.jsonl, copy bandwidth and the decode-step time of
a prefix pass over a tiny node, CUDA-graph replays); see the README's benchmark section.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CascadeCostModel:
    """Decides per shared node whether it becomes a cascade level (see the module docstring).

    Attributes:
        bandwidth_gbs: device memory bandwidth (copy, bytes read + written per second / 1e9).
        level_overhead_us: fixed decode cost of one more cascade level per layer, microseconds.
        prefill_us_per_token_layer: prefill time saved per token and layer not recomputed, microseconds.
        new_tokens: decode steps the decision is amortised over.
    """

    bandwidth_gbs: float = 2900.0  # H100 80GB HBM3, device-to-device copy measured in benchmarks/bench_kernels.py
    level_overhead_us: float = 12.0  # H100: prefix pass + merge on a 1-token node, B=1 (graph replay)
    prefill_us_per_token_layer: float = 0.0  # conservative: count only decode (prefill savings are extra)
    new_tokens: int = 64

    def share(self, rows: int, tokens: int, *, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> bool:
        """True if a node of ``tokens`` shared by ``rows`` rows should be stored once as a cascade level."""
        if rows < 2 or tokens < 1:
            return False
        kv_bytes = 2 * num_kv_heads * head_dim * dtype_bytes * tokens  # K and V of the node, one layer
        flat_extra_us = (rows - 1) * kv_bytes / (self.bandwidth_gbs * 1e3)  # bytes / (GB/s) -> us
        saving = self.new_tokens * (flat_extra_us - self.level_overhead_us)
        saving += (rows - 1) * tokens * self.prefill_us_per_token_layer
        return saving > 0

    def for_model(self, model):
        """A ``(rows, tokens) -> bool`` predicate for ``model``'s KV layout (heads, head_dim, dtype)."""
        config = model.config.get_text_config()
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype_bytes = next(model.parameters()).element_size()

        def keep(rows: int, tokens: int) -> bool:
            return self.share(rows, tokens, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)

        return keep
