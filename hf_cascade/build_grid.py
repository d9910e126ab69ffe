"""The grid of batch layouts the background build runs after a call's rows (:mod:`hf_cascade.tier_build`): batches
that together launch the Triton kernel variants a stream of calls of other layouts brings, so that a later call of a
new layout loads its kernels from the cache instead of building them (1-3 s each on an H100: 3-10 s on a new
layout's first call, Llama-3-8B shape, ``benchmarks/results/stall.jsonl``).
"""

from __future__ import annotations

import torch

from hf_cascade.inputs import left_padded
from hf_cascade.transformers_compat import text_config

__all__ = ["GRID_DOCUMENT_TOKENS", "GRID_OPTIONS", "GRID_PREFIX_TOKENS", "GRID_ROWS", "variant_grid"]

# The grid's batch sizes, most common first. With the layers compiled, a decode step's kernel variants follow the
# batch (its tiles cover rows x query heads per KV head, 16-128; the state merge's blocks follow rows x KV heads
# against the SMs), whether the suffix pass shares the last level's launch (suffix traffic against the prefix's),
# one level or several, a padding mask or none, and the prefill's new tokens per row (tiles of 16-64 rows of
# tokens x query heads per KV head); with the layers eager (the Triton tier, and layers the compiled graphs do not
# fit) the tiles follow each level's rows per node instead.
GRID_ROWS = (24, 48, 96, 12, 160, 6, 3)
GRID_PREFIX_TOKENS = (96, 1536)
# A second level of long nodes (retrieved documents under a short shared prompt): the rows' forward then runs the
# suffix pass apart from the prefix passes (the cost model fuses a short suffix only with a short prefix). The suffix
# variant a 64-row tree of 2,048-token documents still built in its first call (results/stall.jsonl, 5df3df4) came
# from an eager forward on fixed buffers; those now read the buffers cut at the written count
# (CascadeCache._written_suffix), and with both that tree's first call built nothing (361882d). What these batches
# add alone is not measured.
GRID_DOCUMENT_TOKENS = 1536
# The child runs each grid batch on both paths: the compiled layers, and the eager layers (Triton kernels, recorded
# steps), whose launches pick their tiles from the tree's nodes rather than from the batch.
GRID_OPTIONS = ({"compile": "now"}, {"decode_step": "graphs"})


def _own_widths(model) -> list[int]:
    """New tokens per row in the grid's prefills: one width in each tile class of ``width x query heads per KV
    head`` (16, 32, 64 rows; more for a long suffix)."""
    text = text_config(model.config)
    heads = getattr(text, "num_attention_heads", 1) or 1
    groups = max(1, heads // (getattr(text, "num_key_value_heads", None) or heads))
    return sorted({max(2, tile // groups) for tile in (16, 32, 64)} | {64})


def variant_grid(model, input_ids: torch.Tensor, generation_config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches ``(input_ids [B, L] int64, attention_mask [B, L] int64)``, left-padded, on CPU, that together launch
    the Triton kernel variants of the layouts a stream of calls brings (see :data:`GRID_ROWS`): every batch size of
    :data:`GRID_ROWS` x own tokens of each width of :func:`_own_widths`, the same for every row or ragged (1 to that
    width) x one shared level or two (a short or long shared prefix) or three (the short one), or two under the short
    one with long second-level nodes (:data:`GRID_DOCUMENT_TOKENS`). Random tokens below the model's vocabulary size
    (or the call's largest id)."""
    text = text_config(model.config)
    vocab = int(getattr(text, "vocab_size", 0) or int(input_ids.max()) + 1)
    g = torch.Generator().manual_seed(48)
    short = min(GRID_PREFIX_TOKENS)
    trees = ([(prefix, levels, 32) for prefix in GRID_PREFIX_TOKENS for levels in (1, 2)] + [(short, 3, 32)]
             + [(short, 2, GRID_DOCUMENT_TOKENS)])
    batches = []
    for rows in GRID_ROWS:
        for width in _own_widths(model):
            for prefix, levels, node_tokens in trees:
                for ragged in (False, True):
                    batches.append(_grid_batch(rows, width, prefix, levels, ragged, vocab, g, node_tokens))
    return batches


def _grid_batch(rows: int, width: int, prefix: int, levels: int, ragged: bool, vocab: int, g,
                node_tokens: int = 32) -> tuple:
    """One left-padded batch of :func:`variant_grid`: ``rows`` rows sharing ``prefix`` tokens; below it, level
    ``k >= 2`` splits the rows into ``2 ** (k - 1)`` groups sharing ``node_tokens`` more tokens each (a stream's
    three-level trees launch variants two levels do not, ``results/stall.jsonl``); then
    each row's own tokens (``width``, or 1 to ``width`` where ``ragged``)."""
    shared = [torch.randint(3, vocab, (prefix,), generator=g)]
    shared += [torch.randint(3, vocab, (2 ** (k - 1), node_tokens), generator=g) for k in range(2, levels + 1)]
    own = torch.randint(1, width + 1, (rows,), generator=g) if ragged else torch.full((rows,), width)
    parts = [torch.cat([shared[0]] + [level[r * level.shape[0] // rows] for level in shared[1:]]
                       + [torch.randint(3, vocab, (int(own[r]),), generator=g)]) for r in range(rows)]
    return left_padded(parts)
