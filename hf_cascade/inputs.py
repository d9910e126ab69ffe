"""``shared_prefix_inputs``: the one-call path from a tokenized batch to cascade ``generate()``."""

from __future__ import annotations

import torch

from hf_cascade.attention import check_model_uses_cascade
from hf_cascade.cache import CascadeCache
from hf_cascade.cost_model import CascadeCostModel
from hf_cascade.prefill import prefill_levels, validate_token_ids
from hf_cascade.prefix_tree import find_shared_prefixes
from hf_cascade.transformers_compat import CACHE_KWARG


def _left_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The batch with each row's trailing padding moved to its front (same width), its real tokens (lists of ints),
    and the column of each real token (a list, or a range for a row without padding). Padding anywhere else (left
    padding, masked tokens inside a row) stays where it is and is honoured exactly: a masked column is never
    attended, and positions count only real tokens, as in sdpa."""
    mask_bool = attention_mask.bool()
    if not bool(mask_bool.any(dim=1).all()):
        row = int((~mask_bool.any(dim=1)).nonzero()[0])
        raise ValueError(
            f"Row {row} of `attention_mask` is all zeros: every row needs at least one real token to generate from."
        )
    width = input_ids.shape[1]
    columns = torch.arange(width, device=input_ids.device)
    last_real = torch.where(mask_bool, columns, -1).max(dim=1).values
    shift = (width - 1 - last_real).tolist()
    if any(shift):  # right padding: generate() appends after the last column, so move the pads to the front
        input_ids = torch.stack([row.roll(k) for row, k in zip(input_ids, shift)])
        attention_mask = torch.stack([row.roll(k) for row, k in zip(attention_mask, shift)])
        mask_bool = attention_mask.bool()
    ids, full = input_ids.tolist(), mask_bool.all(dim=1).tolist()
    rows, row_columns = [], []
    for r, row_ids in enumerate(ids):
        if full[r]:  # no padding (the common case): the row as it is
            row_columns.append(range(width))
            rows.append(row_ids)
        else:
            kept = mask_bool[r].nonzero().flatten().tolist()
            row_columns.append(kept)
            rows.append([row_ids[c] for c in kept])
    return input_ids, attention_mask, rows, row_columns


def _ranges(columns: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'`` (``'none'`` if empty)."""
    if not columns:
        return "none"
    parts, start = [], columns[0]
    for prev, cur in zip(columns, columns[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def plan_cascade_batch(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    min_shared_tokens: int = 4,
    min_rows: int = 2,
    max_levels: int = 4,
    prefix_cache: CascadeCache | None = None,
    cost_model: CascadeCostModel | str | None = "auto",
    max_new_tokens: int | None = None,
    fixed_buffers: bool = False,
    bucket_buffers: bool = False,
) -> tuple[CascadeCache | None, torch.Tensor, torch.Tensor]:
    """Find what the rows share, prefill each shared segment once, and build the cache for the user's own rows.

    The rows keep their width ``L`` and their columns: row ``r`` (real tokens ``prompt_r``, padding where the mask
    is 0) is served by its chain of shared nodes (``c_r`` leading real tokens) and its own suffix (the rest).
    The cache reports ``prefix_length = L - sw`` (``sw``: the widest own suffix, counted from its first column),
    so generate() feeds every row's last ``sw`` columns; columns of that window that a row's chain already covers
    are masked for that row (``suffix_start``). Outputs are exactly as wide as the input plus the new tokens.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"``.
        input_ids: ``[B, L]`` int64 on the model's device; attention_mask: ``[B, L]`` (1 real, 0 padding).
        prefix_cache: a :meth:`CascadeCache.from_prefix` cache every row must start with (reused, not prefilled).
        max_new_tokens: the new tokens generate() will add (sizes fixed buffers; informs the cost model).
        fixed_buffers: keep suffixes in fixed buffers of ``sw + max_new_tokens`` columns (compileable).
        bucket_buffers: round that up (:func:`suffix_capacity`), so that calls of one bucket reuse buffers.
    Returns:
        ``(cache, input_ids, attention_mask)``: ``cache`` is None when no segment is worth sharing (the caller then
        runs plain attention); the ids and mask are the user's, right padding moved to the front of each row.
    """
    input_ids, attention_mask, rows, row_columns = _left_aligned(input_ids, attention_mask)
    attention_mask_host = attention_mask.cpu()  # now, before the prefill is queued (later it would wait for it)
    base_levels, base_parents, base_tokens = [], [], ()
    if prefix_cache is not None:
        base_levels, base_parents, base_tokens = _base_chain(prefix_cache, model)
        for r, row in enumerate(rows):
            if tuple(row[: len(base_tokens)]) != base_tokens or len(row) <= len(base_tokens):
                first = next((i for i, (a, b) in enumerate(zip(row, base_tokens)) if a != b), len(row) - 1)
                column = row_columns[r][min(first, len(row) - 1)]
                real = set(row_columns[r])
                masked = [c for c in range(column) if c not in real]
                raise ValueError(
                    f"Row {r}'s real tokens do not start with the {len(base_tokens)}-token prefix stored in the cache "
                    f"followed by at least one more token: the first difference is its real token {first} (column "
                    f"{column}; masked columns before it: {_ranges(masked)}). Prepend the same prefix_ids to every "
                    "prompt with attention_mask 1 over all of it, or build the cache from the prefix these rows share."
                )
    offset = len(base_tokens)
    if cost_model == "auto":
        cost_model = (
            CascadeCostModel.for_model(model, new_tokens=max_new_tokens, batch_rows=len(rows))
            if input_ids.device.type == "cuda" else None
        )
    elif cost_model is not None and not isinstance(cost_model, CascadeCostModel):
        raise ValueError(f"`cost_model` must be 'auto', None or a CascadeCostModel; got {cost_model!r}.")
    tree = find_shared_prefixes(
        [row[offset:] for row in rows],
        min_shared_tokens=min_shared_tokens,
        min_rows=min_rows,
        max_levels=max_levels,
        keep_node=cost_model.share if cost_model is not None else None,
    )
    if not tree.levels and prefix_cache is None:
        return None, input_ids, attention_mask
    node_levels = [
        [(node.tokens, node.parent if level else (0 if base_levels else None), offset + node.start) for node in nodes]
        for level, nodes in enumerate(tree.levels)
    ]
    levels = prefill_levels(model, node_levels, base_levels, base_parents, cache_class=CascadeCache)

    batch, width = input_ids.shape
    num_base = len(base_levels)
    row_nodes = torch.full((len(levels), batch), -1, dtype=torch.int64)
    row_nodes[:num_base] = 0
    for level, nodes in enumerate(tree.row_nodes):
        row_nodes[num_base + level] = torch.tensor(nodes, dtype=torch.int64)
    # Column of each row's first own token (the last real token is never shared, so there always is one).
    own_start = [columns[offset + n] for columns, n in zip(row_columns, tree.row_prefix_len)]
    suffix_width = width - min(own_start)
    prefix_length = width - suffix_width
    suffix_start = torch.tensor([c - prefix_length for c in own_start], dtype=torch.int64)
    if fixed_buffers and max_new_tokens is None:
        raise ValueError("`fixed_buffers=True` needs `max_new_tokens` to size the buffers.")
    cache = CascadeCache(
        model, levels, row_nodes=row_nodes, prefix_length=prefix_length,
        max_suffix_length=None if not fixed_buffers else (
            # The last new token is sampled and never fed back: sw + max_new_tokens - 1 columns are written.
            suffix_capacity(suffix_width + max_new_tokens - 1) if bucket_buffers else suffix_width + max_new_tokens
        ),
        suffix_start=suffix_start, prefix_tree=tree, window_mask=attention_mask_host[:, prefix_length:],
    )
    return cache, input_ids, attention_mask


def batch_bucket(rows: int) -> int:
    """The batch size a compiled decode step runs ``rows`` rows at (``hf_cascade.generate``'s ``batch_buckets``):
    1, 2, 4, 8, 16, then 24, 32, 48, 64, 96, 128, ... (powers of two and 1.5 x them): fewer than 8 rows added up to
    16, at most a third of the rows above, and a stream of batch sizes compiles a handful of steps, not one per
    size."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    power = 1 << (rows - 1).bit_length()  # the next power of two >= rows
    return power * 3 // 4 if rows <= power * 3 // 4 else power


def suffix_capacity(tokens: int) -> int:
    """Columns of bucketed fixed suffix buffers: 64 x a power of two up to 1024, then a multiple of 512. The
    compiled step takes any capacity (a dynamic size); batches of one bucket also reuse the model's kept buffers
    (``StepBuffers``) and their recorded CUDA graphs. 64 and 128 (prompt column + 64 or 128 new tokens) fit
    exactly."""
    if tokens <= 1024:
        return max(64, 1 << (max(tokens, 1) - 1).bit_length())
    return -(-tokens // 512) * 512


def shared_prefix_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    min_shared_tokens: int = 4,
    min_rows: int = 2,
    max_levels: int = 4,
    layout: str = "full",
    prefix_cache: CascadeCache | None = None,
    cost_model: CascadeCostModel | str | None = "auto",
    max_new_tokens: int | None = None,
) -> dict:
    """Find what the rows share, prefill each shared segment once, and return ``generate()`` inputs.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"``.
        input_ids: ``[batch, seq]`` int64 token ids on the model's device, left- or right-padded.
        attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding (None: no padding).
        min_shared_tokens: shortest shared segment stored as its own node.
        min_rows: fewest rows that must share a segment.
        max_levels: deepest nesting of shared segments (system prompt -> few-shot block -> ...).
        layout: ``"full"``: the returned rows are the user's rows, as wide as ``input_ids`` (a right-padded row has
            its padding moved to the front), so ``out[:, input_ids.shape[1]:]`` are the new tokens; ``"suffix"``:
            returned ``input_ids`` hold only the last ``L - prefix_length`` columns (the widest own suffix) while
            ``attention_mask`` still spans all columns (generate() output starts with those columns).
        prefix_cache: a cache from :meth:`CascadeCache.from_prefix`: every row must start with its prefix, which
            is reused (not prefilled again); sharing found below it is added as deeper levels.
        cost_model: "auto" (the H100-measured :class:`CascadeCostModel` on CUDA, share everything on CPU), None
            (share everything) or a ``CascadeCostModel``.
        max_new_tokens: None: suffixes grow as generate() appends tokens. An int: the cache keeps each row's suffix
            in fixed buffers with room for this many new tokens, so generate() compiles the decode step with CUDA
            graphs on a GPU (transformers' auto-compile for static caches; pass ``disable_compile=True`` to
            generate() to opt out). Pass at least generate()'s ``max_new_tokens``.
    Returns:
        ``{"input_ids", "attention_mask", <cache>}`` for ``model.generate(**inputs, ...)`` (the cache under
        ``"past_key_values"``, or ``"cache"`` from transformers 5.24: ``CACHE_KWARG``); rows keep
        their order. When the model's generation config sets ``cache_implementation``, the dict also holds
        ``cache_implementation=None`` so generate() accepts the cache.

    Example::

        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
        inputs = hf_cascade.shared_prefix_inputs(model, batch["input_ids"], batch["attention_mask"])
        out = model.generate(**inputs, max_new_tokens=64)
        completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    """
    check_model_uses_cascade(model)
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise ValueError(f"`max_new_tokens` must be None or a positive int; got {max_new_tokens!r}.")
    if layout not in ("full", "suffix"):
        raise ValueError(f"`layout` must be 'full' or 'suffix'; got {layout!r}.")
    input_ids = validate_token_ids(input_ids, "input_ids", model)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"`input_ids` must be a [batch, seq] batch of token ids (seq > 0); got shape {tuple(input_ids.shape)}. "
            "For a single prompt use `input_ids[None]`."
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; got {shape}. Pass the "
            "tokenizer's `attention_mask` for the same batch."
        )
    elif attention_mask.device != input_ids.device:
        raise ValueError(
            f"`attention_mask` is on {attention_mask.device} but `input_ids` on {input_ids.device}; move it with "
            "`attention_mask.to(model.device)`."
        )
    cache, input_ids, attention_mask = plan_cascade_batch(
        model, input_ids, attention_mask, min_shared_tokens=min_shared_tokens, min_rows=min_rows,
        max_levels=max_levels, prefix_cache=prefix_cache, cost_model=cost_model, max_new_tokens=max_new_tokens,
        fixed_buffers=max_new_tokens is not None,
    )
    if cache is None:  # nothing worth sharing: a cache with no prefix level (plain attention, same interface)
        cache = CascadeCache(
            model, [], prefix_length=0, max_suffix_length=None if max_new_tokens is None else
            input_ids.shape[1] + max_new_tokens, prefix_tree=find_shared_prefixes([]),
        )
        cache.rows_verified = True
    prefix_length = cache.prefix_length
    new_ids, new_mask = input_ids, attention_mask
    if layout == "suffix":
        new_ids = new_ids[:, prefix_length:]
    inputs = {"input_ids": new_ids, "attention_mask": new_mask, CACHE_KWARG: cache}
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) is not None:
        inputs["cache_implementation"] = None
    return inputs


def _base_chain(prefix_cache: CascadeCache, model) -> tuple[list, list, tuple[int, ...]]:
    if not isinstance(prefix_cache, CascadeCache):
        raise ValueError(f"`prefix_cache` must be a CascadeCache; got {type(prefix_cache).__name__}.")
    if prefix_cache.row_nodes is not None or prefix_cache._planned_row_nodes is not None:
        raise ValueError(
            "`prefix_cache` must hold a single prefix shared by every row (built with CascadeCache.from_prefix)."
        )
    served = prefix_cache._modules.get(0, ())
    if not any(getattr(m, "layer_idx", None) == 0 and m in served for m in model.modules()):
        raise ValueError(
            "`prefix_cache` was built with a different model; build it with CascadeCache.from_prefix(model, ...)."
        )
    tokens: tuple[int, ...] = ()
    for level in prefix_cache.levels:
        tokens += level.node_tokens[0]
    parents = [[None]] + [[0] for _ in prefix_cache.levels[1:]]
    return list(prefix_cache.levels), parents, tokens
