"""When does storing a shared segment once (a cascade level) beat folding it into every row's suffix?

Per decode step, a segment of ``n`` tokens shared by ``r`` rows, each with ``s`` more tokens of its own, makes the
attention read ``n + r·s`` tokens of KV as a cascade level (the segment once) against ``r·(n + s)`` flat (every row
its own copy). Cascade wins when that byte ratio is large enough to pay for its extra launch and for the prefix
pass's arithmetic, and when the batch is wide enough to fill the GPU through the shared pass.

The thresholds were measured on an H100 80GB HBM3 (96-point decode-step grid of ``benchmarks/bench_kernels.py``,
GQA 32/8 and MHA 32/32, d=128, bf16, B in {1, 8, 32, 64, 128, 256}, P in {1K, 4K, 16K, 32K}, S in {128, 1K};
``benchmarks/results/kernels.jsonl``): with ``B >= 8`` and ``B·(P+S)/(P+B·S) >= 1.9`` cascade beat SDPA on per-row
KV at every measured point; at B=1 it never did (0.39–0.99x), and at B=8, P=1K, S=1K it broke even (0.99x).
This is the decode-kernel view. Sharing also saves the segment's prefill and its memory: a segment whose copies
would hold at least ``min_saved_tokens`` tokens (``(rows - 1) * tokens``) is stored once even when the byte ratio is
below the threshold (H100, Llama-3-8B shape, 16 prompts sharing a 256-token system prompt with 512 own tokens x 8
samples: the level adds one launch per layer, ~1 µs of bytes saved per step, and saves 0.47 GiB of KV and 3,840
tokens of prefill).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CascadeCostModel:
    """Decides per shared segment whether it becomes a cascade level (see the module docstring).

    Attributes:
        min_rows: fewest rows for which a shared pass pays (H100: 8).
        min_byte_ratio: smallest ``rows·(n+s) / (n + rows·s)`` (flat bytes over cascade bytes) that pays (H100: 1.9).
        new_tokens: decode steps expected; the rows' suffixes grow by this many tokens.
        min_saved_tokens: store a segment once anyway when its per-row copies would hold this many tokens.
    """

    min_rows: int = 8
    min_byte_ratio: float = 1.9
    new_tokens: int = 64
    min_saved_tokens: int = 2048

    def share(self, rows: int, tokens: int, suffix_tokens: float = 0.0) -> bool:
        """True if ``tokens`` shared by ``rows`` rows, each followed by ``suffix_tokens`` of its own, should be a level."""
        if rows < max(self.min_rows, 2) or tokens < 1:
            return False
        if (rows - 1) * tokens >= self.min_saved_tokens:
            return True
        s = suffix_tokens + self.new_tokens
        return rows * (tokens + s) / (tokens + rows * s) >= self.min_byte_ratio

