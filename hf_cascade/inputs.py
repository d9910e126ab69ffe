"""``shared_prefix_inputs``: the one-call path from a tokenized batch to cascade ``generate()``."""

from __future__ import annotations

import numpy as np
import torch
from transformers.utils import logging

from hf_cascade.attention import check_model_uses_cascade
from hf_cascade.cache import CascadeCache, window_sizes
from hf_cascade.cost_model import CascadeCostModel
from hf_cascade.model_scan import attention_modules, rope_limit
from hf_cascade.ops.builtin_cascade import levels_in_one_call
from hf_cascade.prefill import prefill_levels, validate_token_ids
from hf_cascade.prefix_tree import find_shared_prefixes
from hf_cascade.transformers_compat import CACHE_KWARG

logger = logging.get_logger(__name__)


def _real_tokens_on_host(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Each row's real tokens, left-aligned, on the host (the rows on the device stay as they are). Padding (left padding,
    masked tokens inside a row) is honoured exactly: a masked column is never attended, and positions count only
    real tokens, as in sdpa. Right padding is refused once rows share a segment (:func:`_refuse_right_padding`).

    The host side is numpy, single-threaded: torch's CPU kernels split a [32, 4K] batch over their thread pool, and
    on a GPU host busy with other threads (after torch.compile, say) waking it took 16 ms per op instead of 0.3 (H100
    machine, 16 cores).

    Args:
        input_ids, attention_mask: ``[B, L]`` on the model's device (mask: nonzero for real tokens).
    Returns:
        ``(real_ids, real_columns, lengths, mask_host)``, numpy arrays: ``real_ids`` ``[B, L]`` int64, each row's
        real tokens first, then -1 (the form :func:`find_shared_prefixes` takes, as a tensor); ``real_columns``
        ``[B, L]`` int64, the column of each of those tokens (-1 after a row's last; a read-only broadcast view when
        no row has padding); ``lengths`` ``[B]`` int64, each row's real tokens; ``mask_host`` ``[B, L]`` bool, the
        mask.
    """
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; got "
            f"{tuple(attention_mask.shape)}. Pass the tokenizer's `attention_mask` for the same batch."
        )
    ids = input_ids.cpu().numpy().astype(np.int64, copy=False)  # one copy each, before the prefill is queued
    try:
        mask = attention_mask.cpu().numpy() != 0
    except TypeError:  # a dtype numpy lacks (bfloat16)
        mask = attention_mask.bool().cpu().numpy()
    has_real = mask.any(axis=1)
    if not has_real.all():
        raise ValueError(
            f"Row {int(np.flatnonzero(~has_real)[0])} of `attention_mask` is all zeros: every row needs at least one "
            "real token to generate from."
        )
    batch, width = ids.shape
    columns = np.arange(width, dtype=np.int64)
    lengths = mask.sum(axis=1)
    if (lengths == width).all():  # no padding (the common case): the rows as they are
        return ids, np.broadcast_to(columns, (batch, width)), lengths, mask
    first = width - lengths  # a left-padded row without masked tokens inside holds its real tokens in [first, L)
    real_columns = columns + first[:, None]
    with_holes = np.where(mask, columns, width).min(axis=1) != first
    for r in np.flatnonzero(with_holes):
        kept = np.flatnonzero(mask[r])
        real_columns[r, : kept.size] = kept
    past_end = columns >= lengths[:, None]
    real_columns[past_end] = 0
    real_ids = np.take_along_axis(ids, real_columns, 1)
    real_ids[past_end] = real_columns[past_end] = -1
    return real_ids, real_columns, lengths, mask


def left_padded(rows, pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (token-id lists or 1-D tensors of any lengths) as one left-padded batch on the CPU: ``(input_ids
    [B, L] int64, attention_mask [B, L] int64)``, ``L`` the longest row, padding ``pad_token_id`` / 0."""
    rows = [torch.as_tensor(row, dtype=torch.int64) for row in rows]
    width = max((row.numel() for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - row.numel():], mask[i, width - row.numel():] = row, 1
    return ids, mask


def _refuse_right_padding(mask_host: np.ndarray) -> None:
    """Raise a ValueError naming the right-padded rows of ``mask_host`` (``[B, L]`` bool, True = real token), if any.

    generate() takes a row's next token from the last column; for a right-padded row that is a pad (transformers
    warns: "right-padding was detected"), and sdpa's tokens follow from that pad's logits. hf_cascade does not
    reproduce this with shared segments, so such a batch is refused rather than answered differently."""
    padded = np.flatnonzero(~mask_host[:, -1])
    if not padded.size:
        return
    trailing = [int(mask_host.shape[1] - 1 - np.flatnonzero(mask_host[r]).max()) for r in padded[:4]]
    rows = ", ".join(f"row {int(r)} ({n} pad column{'s' * (n > 1)})" for r, n in zip(padded[:4], trailing))
    raise ValueError(
        f"This batch (input_ids / attention_mask {list(mask_host.shape)}) is right-padded: {len(padded)} of its "
        f"rows end with padding ({rows}{', ...' if padded.size > 4 else ''}), and its rows share a prefix. "
        "generate() takes each row's first new token from the last column, a pad for these rows (transformers warns "
        "about right padding too), and hf_cascade does not reproduce that with shared segments. Pad on the left: "
        "tokenizer.padding_side = \"left\" (or padding_side=\"left\" in the tokenizer call), as generate() needs "
        "for batched prompts."
    )


def _check_rows_start_with(
    base_tokens: tuple[int, ...], real_ids: np.ndarray, real_columns: np.ndarray, lengths: np.ndarray
) -> None:
    """Raise a ValueError naming the first row whose real tokens are not ``base_tokens`` followed by at least one
    more token (the arguments as :func:`_real_tokens_on_host` returns them)."""
    n = len(base_tokens)
    if n < real_ids.shape[1]:
        starts_right = (real_ids[:, :n] == np.fromiter(base_tokens, np.int64, n)).all(axis=1) & (lengths > n)
    else:
        starts_right = np.zeros(real_ids.shape[0], dtype=bool)
    wrong = np.flatnonzero(~starts_right)
    if not wrong.size:
        return
    r = int(wrong[0])
    row, row_columns = real_ids[r, : lengths[r]].tolist(), real_columns[r, : lengths[r]].tolist()
    first = next((i for i, (a, b) in enumerate(zip(row, base_tokens)) if a != b), len(row) - 1)
    column = row_columns[min(first, len(row) - 1)]
    real = set(row_columns)
    masked = [c for c in range(column) if c not in real]
    raise ValueError(
        f"Row {r}'s real tokens do not start with the {n}-token prefix stored in the cache "
        f"followed by at least one more token: the first difference is its real token {first} (column "
        f"{column}; masked columns before it: {_ranges(masked)}). Prepend the same prefix_ids to every "
        "prompt with attention_mask 1 over all of it, or build the cache from the prefix these rows share."
    )


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


def _rows_for_sharing(model, real_ids: np.ndarray, real_columns: np.ndarray, lengths: np.ndarray, offset: int,
                      span: int | None) -> np.ndarray:
    """The rows the prefix tree is built from: ``real_ids`` (as :func:`_real_tokens_on_host` returns it), except that
    where ``model`` has a sliding window or attention chunk shorter than ``span`` (the rows' columns plus the new
    tokens; None: unknown), a row shares nothing from its first masked column inside it on.

    Such layers count a window in columns from the row's first real column, masked columns included (transformers'
    masks), and a shared node's keys sit at the row's positions: the two agree only where no masked column lies
    inside the row's shared part. The row's tokens from that column on become a value no other row holds.

    Raises:
        ValueError: a row has a masked column inside the ``offset`` tokens of a ``prefix_cache`` (always shared).
    """
    sizes = window_sizes(model)
    if not sizes or (span is not None and min(sizes) >= span):
        return real_ids
    index = np.arange(real_ids.shape[1])
    inside = (real_columns != real_columns[:, :1] + index) & (index < lengths[:, None])  # a masked column before
    if not inside.any():
        return real_ids
    before_hole = np.where(inside.any(axis=1), inside.argmax(axis=1), lengths)
    broken = np.flatnonzero(before_hole < offset)
    if broken.size:
        r = int(broken[0])
        raise ValueError(
            f"Row {r} has masked columns inside the {offset}-token prefix of `prefix_cache` (its real token "
            f"{int(before_hole[r])} is at column {int(real_columns[r, before_hole[r]])}), and this model's sliding "
            f"windows / attention chunks ({sorted(sizes)} tokens) count masked columns, as transformers does: the "
            "stored prefix cannot stand for that row. Give the rows the prefix without padding inside it "
            "(left padding is fine)."
        )
    rows = real_ids.copy()
    unique = np.iinfo(np.int64).max - np.arange(rows.shape[0])  # a token id no other row holds
    after = (index >= before_hole[:, None]) & (index < lengths[:, None])
    rows[after] = np.broadcast_to(unique[:, None], rows.shape)[after]
    return rows


def _rope_bars_sharing(model, longest: int, base_prefix: bool) -> bool:
    """Whether rows of ``longest`` real tokens must share nothing on ``model`` (a warning once): its RoPE (dynamic /
    longrope, :func:`~hf_cascade.model_scan.rope_limit`) picks its frequencies from each forward's longest position
    past its limit, so a shared node's own forward would rotate its keys otherwise than generate()'s forward over the
    whole prompt. With a ``prefix_cache`` (``base_prefix``: always shared) that is a ValueError."""
    limit = rope_limit(model)
    if limit is None or longest <= limit:
        return False
    if base_prefix:
        raise ValueError(
            f"This model's RoPE (dynamic / longrope) picks its frequencies from each forward's longest position past "
            f"{limit} tokens, and the longest row has {longest}: the prefix stored in `prefix_cache` (its own "
            "forward) cannot stand for those rows. Pass the rows without prefix_cache."
        )
    logger.warning_once(
        f"hf_cascade: rows longer than {limit} tokens on a model whose RoPE (dynamic / longrope) depends on each "
        "forward's longest position: nothing is shared (generate()'s own attention, the reference's tokens)."
    )
    return True


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
    compile_layers: bool = False,
    builtin_kernels: bool = False,
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
        compile_layers: prefill the shared segments with the decoder layers compiled for any length (see
            :func:`~hf_cascade.compiled_layers.compiled_forward`).
        builtin_kernels: attend with PyTorch's own kernels, not Triton's (the prefill and the returned cache; see
            :attr:`CascadeCache.builtin_kernels`).
    Returns:
        ``(cache, input_ids, attention_mask)``: ``cache`` is None when no segment is worth sharing (the caller then
        runs plain attention); the ids and mask are the user's, unchanged.
    Raises:
        ValueError: a right-padded batch (a row's last column masked) whose rows share a segment
            (:func:`_refuse_right_padding`: pad on the left, ``tokenizer.padding_side = "left"``).
    """
    real_ids, real_columns, lengths, mask_host = _real_tokens_on_host(input_ids, attention_mask)
    batch, width = input_ids.shape
    if _rope_bars_sharing(model, int(lengths.max()), prefix_cache is not None):
        return None, input_ids, attention_mask
    base_levels, base_parents, base_tokens = [], [], ()
    if prefix_cache is not None:
        base_levels, base_parents, base_tokens = _base_chain(prefix_cache, model)
        _check_rows_start_with(base_tokens, real_ids, real_columns, lengths)
    offset = len(base_tokens)
    if cost_model == "auto":
        cost_model = (
            CascadeCostModel.for_model(model, new_tokens=max_new_tokens, batch_rows=batch,
                                       builtin=builtin_kernels and not levels_in_one_call(model))
            if input_ids.device.type == "cuda" else None
        )
    elif cost_model is not None and not isinstance(cost_model, CascadeCostModel):
        raise ValueError(f"`cost_model` must be 'auto', None or a CascadeCostModel; got {cost_model!r}.")
    span = None if max_new_tokens is None else width + max_new_tokens
    tree = find_shared_prefixes(
        torch.from_numpy(_rows_for_sharing(model, real_ids, real_columns, lengths, offset, span)[:, offset:]),
        min_shared_tokens=min_shared_tokens,
        min_rows=min_rows,
        max_levels=max_levels,
        keep_node=cost_model.share if cost_model is not None else None,
    )
    if not tree.levels and prefix_cache is None:
        return None, input_ids, attention_mask
    _refuse_right_padding(mask_host)
    node_levels = [
        [(node.tokens, node.parent if level else (0 if base_levels else None), offset + node.start) for node in nodes]
        for level, nodes in enumerate(tree.levels)
    ]
    levels = prefill_levels(model, node_levels, base_levels, base_parents, cache_class=CascadeCache,
                            compile_layers=compile_layers, builtin_kernels=builtin_kernels)

    num_base = len(base_levels)
    row_nodes = torch.full((len(levels), batch), -1, dtype=torch.int64)
    row_nodes[:num_base] = 0
    for level, nodes in enumerate(tree.row_nodes):
        row_nodes[num_base + level] = torch.tensor(nodes, dtype=torch.int64)
    # Each row's own columns start right after its chain's last token (masked columns after it are the suffix's, so
    # a window counts them: hf_cascade.windows), or at its first real token (no chain); the last real token is never
    # shared, so a row always has one of its own.
    chain = offset + np.asarray(tree.row_prefix_len, dtype=np.int64)
    rows = np.arange(batch)
    own_start = np.where(chain > 0, real_columns[rows, np.maximum(chain - 1, 0)] + 1, real_columns[rows, 0])
    suffix_width = width - int(own_start.min())
    prefix_length = width - suffix_width
    suffix_start = torch.from_numpy(own_start - prefix_length)
    if fixed_buffers and max_new_tokens is None:
        raise ValueError("`fixed_buffers=True` needs `max_new_tokens` to size the buffers.")
    cache = CascadeCache(
        model, levels, row_nodes=row_nodes, prefix_length=prefix_length,
        max_suffix_length=None if not fixed_buffers else (
            # The last new token is sampled and never fed back: sw + max_new_tokens - 1 columns are written.
            suffix_capacity(suffix_width + max_new_tokens - 1) if bucket_buffers else suffix_width + max_new_tokens
        ),
        suffix_start=suffix_start, prefix_tree=tree, window_mask=torch.from_numpy(mask_host[:, prefix_length:]),
    )
    cache.builtin_kernels = builtin_kernels
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
        input_ids: ``[batch, seq]`` int64 token ids on the model's device, left-padded (a right-padded batch whose
            rows share a segment raises a ValueError: see :func:`_refuse_right_padding`).
        attention_mask: ``[batch, seq]`` 1 for real tokens, 0 for padding (None: no padding).
        min_shared_tokens: shortest shared segment stored as its own node.
        min_rows: fewest rows that must share a segment.
        max_levels: deepest nesting of shared segments (system prompt -> few-shot block -> ...).
        layout: ``"full"``: the returned rows are the user's rows, as wide as ``input_ids``, so
            ``out[:, input_ids.shape[1]:]`` are the new tokens; ``"suffix"``:
            returned ``input_ids`` hold only the last ``L - prefix_length`` columns (the widest own suffix) while
            ``attention_mask`` still spans all columns (generate() output starts with those columns). generate()
            counts ``max_length`` / ``min_length`` from the ``input_ids`` it gets: with ``"suffix"`` pass
            ``max_new_tokens`` / ``min_new_tokens`` instead. generate()'s logits processors see only those columns
            (a warning says so): with ones that read the prompt (``repetition_penalty``, ``no_repeat_ngram_size``,
            ...) use ``"full"``; ``hf_cascade.generate`` refuses them on suffix rows
            (:func:`refuse_prompt_readers_on_suffix_rows`).
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
        # Windows and chunks count from each row's first real column (transformers' masks): its own tokens start there.
        first = (attention_mask.cumsum(-1) == 0).sum(-1).cpu() if window_sizes(model) else None
        cache = CascadeCache(
            model, [], prefix_length=0, max_suffix_length=None if max_new_tokens is None else
            input_ids.shape[1] + max_new_tokens, suffix_start=first, prefix_tree=find_shared_prefixes([]),
        )
        cache.rows_verified = True
    prefix_length = cache.prefix_length
    new_ids, new_mask = input_ids, attention_mask
    if layout == "suffix" and prefix_length:
        new_ids = new_ids[:, prefix_length:]
        logger.warning_once(
            "hf_cascade.shared_prefix_inputs(layout='suffix'): generate()'s logits processors see only the suffix "
            "columns, so penalties and bans that read the prompt (repetition_penalty, no_repeat_ngram_size, "
            "encoder_repetition_penalty, multi-token bad_words_ids / sequence_bias, prefix_allowed_tokens_fn, "
            "watermarking, your own processors) act as if the shared prefix were not there; use layout='full' "
            "with them (hf_cascade.generate refuses them on suffix rows)."
        )
    inputs = {"input_ids": new_ids, "attention_mask": new_mask, CACHE_KWARG: cache}
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) is not None:
        inputs["cache_implementation"] = None
    return inputs


# transformers' logits processors that read the prompt's tokens (all of them, or the last few of a multi-token ban or
# bias; single-token ones read none): on suffix rows (shared_prefix_inputs(layout="suffix")) they would not see the
# shared prefix.
PROMPT_READING_PROCESSORS = (
    "RepetitionPenaltyLogitsProcessor", "EncoderRepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "EncoderNoRepeatNGramLogitsProcessor", "PrefixConstrainedLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "WatermarkLogitsProcessor",
)


def refuse_prompt_readers_on_suffix_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                                         logits_processor) -> None:
    """A ValueError where generate() got suffix rows (``input_ids [B, W]`` narrower than ``attention_mask [B, L]``:
    :func:`shared_prefix_inputs` with ``layout="suffix"``) and a logits processor that reads the prompt
    (:data:`PROMPT_READING_PROCESSORS`): it would act as if the shared prefix were not there."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] <= input_ids.shape[1]:
        return
    readers = sorted({type(p).__name__ for p in (logits_processor or []) if _reads_prompt(p)})
    if readers:
        raise ValueError(
            f"These rows hold only their suffix columns ({input_ids.shape[1]} of {attention_mask.shape[1]}: "
            f"shared_prefix_inputs(layout='suffix')), and {', '.join(readers)} read the prompt's tokens: they would "
            "act as if the shared prefix were not there. Build the inputs with layout='full' (the default), or leave "
            "those options out."
        )


def _reads_prompt(processor) -> bool:
    """Whether a logits processor reads prompt tokens (a bias or ban: only where a sequence is longer than one)."""
    if type(processor).__name__ not in PROMPT_READING_PROCESSORS:
        return False
    bias = getattr(processor, "sequence_bias", None)
    return bias is None or any(len(ids) > 1 for ids in bias)


def _base_chain(prefix_cache: CascadeCache, model) -> tuple[list, list, tuple[int, ...]]:
    if not isinstance(prefix_cache, CascadeCache):
        raise ValueError(f"`prefix_cache` must be a CascadeCache; got {type(prefix_cache).__name__}.")
    if prefix_cache.row_nodes is not None or prefix_cache._planned_row_nodes is not None:
        raise ValueError(
            "`prefix_cache` must hold a single prefix shared by every row (built with CascadeCache.from_prefix)."
        )
    served = prefix_cache._modules.get(0, ())
    if not any(m in served for m in attention_modules(model).get(0, ())):
        raise ValueError(
            "`prefix_cache` was built with a different model; build it with CascadeCache.from_prefix(model, ...)."
        )
    tokens: tuple[int, ...] = ()
    for level in prefix_cache.levels:
        tokens += level.node_tokens[0]
    parents = [[None]] + [[0] for _ in prefix_cache.levels[1:]]
    return list(prefix_cache.levels), parents, tokens
