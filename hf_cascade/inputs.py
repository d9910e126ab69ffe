"""``shared_prefix_inputs``: the one-call path from a tokenized batch to cascade ``generate()``."""

from __future__ import annotations

import torch

from hf_cascade.attention import check_model_uses_cascade
from hf_cascade.cache import CascadeCache
from hf_cascade.cost_model import CascadeCostModel
from hf_cascade.prefill import prefill_levels, validate_token_ids
from hf_cascade.prefix_tree import find_shared_prefixes


def _real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens without padding (left or right), checking that padding sits only at the ends."""
    rows = []
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    for r, (row_ids, row_mask) in enumerate(zip(ids, mask)):
        kept = [i for i, m in enumerate(row_mask) if m]
        if not kept:
            raise ValueError(
                f"Row {r} of `attention_mask` is all zeros: every row needs at least one real token to generate from."
            )
        if kept[-1] - kept[0] + 1 != len(kept):
            raise ValueError(
                f"Row {r} of `attention_mask` has padding between real tokens; pass a left- or right-padded batch "
                "as a tokenizer returns it (padding only at one end)."
            )
        rows.append(row_ids[kept[0] : kept[-1] + 1])
    return rows


def shared_prefix_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    min_shared_tokens: int = 4,
    min_rows: int = 2,
    max_levels: int = 4,
    layout: str = "full",
    pad_token_id: int | None = None,
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
        layout: ``"full"``: returned rows are ``[prefix | pads | suffix]`` (generate() output starts with the
            prompt); ``"suffix"``: returned ``input_ids`` hold only ``[pads | suffix]`` while ``attention_mask``
            still spans the prefix columns (generate() output starts with the suffix).
        pad_token_id: id written in padding columns (default: the model's pad/eos id, else 0; never attended).
        prefix_cache: a cache from :meth:`CascadeCache.from_prefix`: every row must start with its prefix, which
            is reused (not prefilled again); sharing found below it is added as deeper levels.
        cost_model: "auto" (the H100-measured :class:`CascadeCostModel` on CUDA, share everything on CPU), None
            (share everything) or a ``CascadeCostModel``.
        max_new_tokens: None: suffixes grow as generate() appends tokens. An int: the cache keeps each row's suffix
            in fixed buffers with room for this many new tokens, so generate() compiles the decode step with CUDA
            graphs on a GPU (transformers' auto-compile for static caches; pass ``disable_compile=True`` to
            generate() to opt out). Pass at least generate()'s ``max_new_tokens``.
    Returns:
        ``{"input_ids", "attention_mask", "past_key_values"}`` for ``model.generate(**inputs, ...)``; rows keep
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
    rows = _real_tokens(input_ids, attention_mask)

    base_levels, base_parents, base_tokens = [], [], ()
    if prefix_cache is not None:
        base_levels, base_parents, base_tokens = _base_chain(prefix_cache, model)
        for r, row in enumerate(rows):
            if tuple(row[: len(base_tokens)]) != base_tokens or len(row) <= len(base_tokens):
                raise ValueError(
                    f"Row {r} does not start with the prefix stored in `prefix_cache` ({len(base_tokens)} tokens) "
                    "followed by at least one more token. Prepend the same prefix_ids to every prompt, or build "
                    "the cache from the prefix these rows share."
                )
    offset = len(base_tokens)
    if cost_model == "auto":
        cost_model = CascadeCostModel() if input_ids.device.type == "cuda" else None
    elif cost_model is not None and not isinstance(cost_model, CascadeCostModel):
        raise ValueError(f"`cost_model` must be 'auto', None or a CascadeCostModel; got {cost_model!r}.")
    tree = find_shared_prefixes(
        [row[offset:] for row in rows],
        min_shared_tokens=min_shared_tokens,
        min_rows=min_rows,
        max_levels=max_levels,
        keep_node=cost_model.share if cost_model is not None else None,
    )
    node_levels = [
        [(node.tokens, node.parent if level else (0 if base_levels else None), offset + node.start) for node in nodes]
        for level, nodes in enumerate(tree.levels)
    ]
    levels = prefill_levels(model, node_levels, base_levels, base_parents)

    batch = len(rows)
    num_base = len(base_levels)
    row_nodes = torch.full((len(levels), batch), -1, dtype=torch.int64)
    row_nodes[:num_base] = 0
    for level, nodes in enumerate(tree.row_nodes):
        row_nodes[num_base + level] = torch.tensor(nodes, dtype=torch.int64)
    row_prefix = [offset + n for n in tree.row_prefix_len]
    prefix_length = max(row_prefix)
    suffix_width = max(len(row) - p for row, p in zip(rows, row_prefix))

    if pad_token_id is None:
        pad_token_id = _default_pad_id(model)
    new_ids = torch.full((batch, prefix_length + suffix_width), pad_token_id, dtype=torch.int64)
    new_mask = torch.zeros((batch, prefix_length + suffix_width), dtype=attention_mask.dtype)
    for r, (row, p) in enumerate(zip(rows, row_prefix)):
        suffix = row[p:]
        new_ids[r, :p] = torch.tensor(row[:p], dtype=torch.int64)
        new_mask[r, :p] = 1
        new_ids[r, new_ids.shape[1] - len(suffix) :] = torch.tensor(suffix, dtype=torch.int64)
        new_mask[r, new_mask.shape[1] - len(suffix) :] = 1
    device = input_ids.device
    cache = CascadeCache(
        model, levels, row_nodes=row_nodes.to(device), prefix_length=prefix_length,
        max_suffix_length=None if max_new_tokens is None else suffix_width + max_new_tokens,
    )
    cache.prefix_tree = tree
    if layout == "suffix":
        new_ids = new_ids[:, prefix_length:]
    inputs = {
        "input_ids": new_ids.to(device),
        "attention_mask": new_mask.to(device),
        "past_key_values": cache,
    }
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


def _default_pad_id(model) -> int:
    for source in (getattr(model, "generation_config", None), model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
    return 0

