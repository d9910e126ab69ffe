"""``context_parallel_inputs``: shard one long prompt's KV over the ranks of a process group, then ``generate()``.

Run the same script on every rank (``torchrun --nproc_per_node N`` / ``accelerate launch --num_processes N``)::

    state = accelerate.PartialState()                       # cpu=True on CPU (gloo)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cascade").to(state.device)
    inputs = hf_cascade.context_parallel_inputs(model, input_ids.to(state.device))
    out = model.generate(**inputs, max_new_tokens=64)       # the same tokens on every rank

What happens: every rank first checks that the prompt fits (:mod:`~hf_cascade.parallel.capacity`; one small
all-gather, the same error on every rank if not), then runs the model over ONLY its zigzag shard of the prompt (all
but the last token; global ``position_ids``), in rounds of a bounded size (:mod:`~hf_cascade.parallel.prefill_plan`),
with ring attention inside the registered ``"cascade"`` attention; the KV stays where it was computed, so no rank
ever holds the whole prompt's KV. ``generate()`` then feeds the last prompt token and the
decode tokens to every rank; each attention layer combines the ranks' partial results exactly (``combine``).

Same tokens on every rank: every step's scores are broadcast from rank 0, and for sampling every rank gets rank 0's
RNG state (``sync_rng=True``; rank 0's own state is untouched), so ``do_sample=True`` draws the same tokens
everywhere, and with ``torch.manual_seed(seed)`` before the calls the tokens a single-process sdpa ``generate()``
draws with that seed.

Failures: every attention layer is a collective; if one rank raises or dies, the others fail when the process
group's timeout expires (gloo also as soon as the dead peer's connection drops; NCCL's watchdog aborts, on by
default). Set the timeout where the group is created (torch's defaults: 10 min NCCL, 30 min gloo):
``torch.distributed.init_process_group(..., timeout=datetime.timedelta(seconds=60))``, or with Accelerate
``PartialState(timeout=datetime.timedelta(seconds=60))`` / ``InitProcessGroupKwargs(timeout=...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_cascade.attention import check_model_uses_cascade, dropout_in_training, unshareable_model
from hf_cascade.model_scan import rope_limit
from hf_cascade.parallel._group import check_device, resolve_group, sync_rng
from hf_cascade.parallel.cache import ContextParallelCache
from hf_cascade.parallel.combine import check_combine
from hf_cascade.parallel.fixed import check_max_new_tokens
from hf_cascade.parallel.capacity import MemoryNeed, ModelShape, check_capacity, free_bytes, memory_need
from hf_cascade.parallel.generation import check_decode_step, context_parallel_generate, decode_buffer_tokens
from hf_cascade.parallel.prefill_plan import PrefillPlan, check_rank_tokens, default_rank_tokens
from hf_cascade.transformers_compat import CACHE_KWARG

_PROGRESS_FROM_ROUNDS = 8


@dataclass(frozen=True)
class ParallelOptions:
    """``context_parallel_inputs``' options, checked once before any collective (see its docstring for each)."""

    combine: str = "all_gather"
    placement: str = "least_loaded"
    shared_prefix: object = "auto"
    min_shared_tokens: int = 16
    pad_token_id: int | None = None
    sync_rng: bool = True
    check_inputs: bool = True
    max_new_tokens: int | None = None
    decode_step: str = "auto"
    kernels: str = "auto"
    prefill_chunk_tokens: int | None = None
    memory_per_rank: int | None = None

    @classmethod
    def of(cls, combine: str, options: dict) -> ParallelOptions:
        """Check ``options`` (the keyword arguments) with ``combine``; a typo or a bad value raises ValueError on
        every rank at once, before any collective."""
        valid = tuple(f.name for f in dataclasses.fields(cls) if f.name != "combine")  # (combine: its own argument)
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"context_parallel_inputs: unknown option(s) {unknown}; valid options are {valid}.")
        check_combine(combine)
        opts = cls(combine=combine, **options)
        max_new_tokens = check_max_new_tokens(opts.max_new_tokens)
        if max_new_tokens is not None and combine == "all_gather_kv":
            raise ValueError("context_parallel_inputs: combine='all_gather_kv' (a benchmark baseline) has no "
                             "fixed-buffer decode; pick 'all_gather', 'tree' or 'all_to_all', or drop `max_new_tokens`.")
        check_rank_tokens(opts.prefill_chunk_tokens)
        memory = opts.memory_per_rank
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
            raise ValueError(f"`memory_per_rank` must be a positive int (bytes each rank may use for the KV, the "
                             f"prefill and the decode buffers) or None (measured); got {memory!r}.")
        decode_step = check_decode_step(opts.decode_step)
        if decode_step not in ("auto", "eager") and combine == "all_gather_kv":
            raise ValueError(f"context_parallel_inputs: combine='all_gather_kv' (a benchmark baseline) runs eager "
                             f"steps only; got decode_step={decode_step!r}.")
        if opts.shared_prefix not in ("auto", True, False):
            raise ValueError(f"`shared_prefix` must be 'auto', True or False; got {opts.shared_prefix!r}.")
        return dataclasses.replace(opts, max_new_tokens=max_new_tokens, decode_step=decode_step)


def _validate(model, input_ids, attention_mask):
    device = model.device
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"`input_ids` must be a [batch, seq] tensor of token ids with seq > 0; got {shape}. For one prompt use "
            "`input_ids[None]`."
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"`input_ids` must hold integer token ids (torch.int64); got {input_ids.dtype}.")
    if input_ids.device != device:
        raise ValueError(
            f"`input_ids` is on {input_ids.device} but the model is on {device}; move it with "
            "`input_ids.to(model.device)`."
        )
    if attention_mask is None:
        return input_ids.long(), torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; got {shape}."
        )
    if attention_mask.device != device:
        raise ValueError(f"`attention_mask` is on {attention_mask.device}; move it to {device}.")
    mask = attention_mask.long()
    real = mask.bool()
    if not real[:, -1].all():
        raise ValueError(
            "`attention_mask` has padding in the last column: pad batches on the left (tokenizer.padding_side = "
            "'left'), as generate() needs."
        )
    first = real.long().argmax(dim=1)
    if not torch.equal(real.long().sum(dim=1), input_ids.shape[1] - first):
        raise ValueError("`attention_mask` has padding between real tokens; pass a left-padded batch.")
    return input_ids.long(), mask


def _check_same_on_all_ranks(input_ids, mask, info) -> None:
    """Every rank must pass the same prompt: compare shapes and a position-weighted checksum (one all-gather)."""
    weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device).view_as(input_ids)
    mine = torch.stack([
        torch.tensor(input_ids.shape[0], device=input_ids.device),
        torch.tensor(input_ids.shape[1], device=input_ids.device),
        (input_ids * weights).sum() % (2**61 - 1),
        (mask * weights).sum() % (2**61 - 1),
    ]).long()
    everyone = [torch.empty_like(mine) for _ in range(info.world_size)]
    dist.all_gather(everyone, mine, group=info.group)
    different = [r for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
    if different:
        raise ValueError(
            f"context_parallel_inputs: ranks {different} got a different `input_ids`/`attention_mask` than rank 0 "
            f"(this rank: shape {tuple(input_ids.shape)}). Every rank must pass the same prompt batch."
        )


def _shared_prefix_length(input_ids, mask, min_tokens: int) -> int:
    """Longest prefix of real tokens common to every row, leaving each row at least one token after it."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), mask.cpu())]
    limit = min(len(r) for r in rows) - 1
    length = 0
    while length < limit and all(r[length] == rows[0][length] for r in rows):
        length += 1
    return length if length >= min_tokens else 0


def _check_fits(model, plan: PrefillPlan, info, input_ids, mask, prefix: int, max_new_tokens,
                memory_per_rank) -> MemoryNeed:
    """The capacity check (:mod:`~hf_cascade.parallel.capacity`): one all-gather; raises on every rank at once.
    Returns what this rank needs."""
    shape = ModelShape.of(model)
    rows = input_ids.shape[0]
    suffix = 0 if not prefix else int(mask.sum()) - rows * prefix  # the rows' own columns after the shared prefix
    new_tokens = max_new_tokens or getattr(getattr(model, "generation_config", None), "max_new_tokens", None) or 256
    decode_columns = rows * (-(-decode_buffer_tokens(new_tokens) // info.world_size) + 1)
    stored_rows = 1 if prefix else rows
    need = memory_need(shape, world_size=info.world_size, stored_columns=plan.num_real(info.rank), rows=stored_rows,
                       round_tokens=stored_rows * plan.max_local_columns(), suffix_columns=suffix,
                       decode_columns=decode_columns)
    free = memory_per_rank if memory_per_rank is not None else free_bytes(input_ids.device, info)
    check_capacity(need, free, info, input_ids.device, prompt_tokens=input_ids.shape[1], rows=rows,
                   kv_per_token=shape.kv_bytes_per_column * stored_rows)
    return need


def _check_attention_splits(model, longest: int | None = None) -> None:
    """A NotImplementedError (the same on every rank: no collective) where the prompt's attention cannot be split
    into shards: attention that is not causal over the prompt, attention dropout (training mode), or RoPE that picks its frequencies from each forward's
    longest position (dynamic NTK, longrope) for a prompt of ``longest`` real tokens past its limit."""
    reason = unshareable_model(model)
    if reason is not None:
        raise NotImplementedError(f"Context parallelism cannot serve {reason}: the ring prefill attends causally "
                                  "from each rank's shard. Run this model on one device.")
    dropout = dropout_in_training(model)
    if dropout is not None:
        raise NotImplementedError(f"Context parallelism cannot run {dropout}: its attention has none.")
    limit = rope_limit(model)
    if longest is not None and limit is not None and longest > limit:
        raise NotImplementedError(
            f"This model's RoPE (dynamic / longrope) picks its frequencies from each forward's longest position past "
            f"{limit} tokens, and the prompt has {longest}: each rank's shard is its own forward, so its keys would "
            "be rotated otherwise than one forward over the whole prompt rotates them. Context parallelism supports "
            "such models for prompts up to that length."
        )


def _default_pad_id(model) -> int:
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _ring_prefill(model, cache, plan: PrefillPlan, ids, positions, key_valid, *, shared: bool,
                  keep_cached: int) -> None:
    """Run ``ids`` ``[B, T]`` (global ``positions``) through the model in the plan's rounds, each rank its zigzag
    shard of each round (:mod:`~hf_cascade.parallel.prefill_plan`); the KV stays on the rank that computed it.
    ``keep_cached``: bytes of free cached segments the allocator may keep between layers (one round's temporaries,
    :attr:`~hf_cascade.parallel.capacity.MemoryNeed.temporaries`)."""
    info = cache.info
    if plan.length == 0:
        return
    cache.begin_prefill(plan, key_valid, shared=shared, device=ids.device, keep_cached=keep_cached)
    rounds = plan.rounds(info.rank)
    bar = _progress(len(rounds), info, plan)
    for rnd in rounds:
        cache.begin_round(rnd.index)
        span = slice(rnd.start, rnd.start + rnd.layout.length)
        local_ids = rnd.layout.shard(ids[:, span], info.rank, dim=1, pad_value=0)
        local_positions = rnd.layout.shard(positions[:, span], info.rank, dim=1, pad_value=0)
        model.base_model(input_ids=local_ids, position_ids=local_positions, use_cache=True, **{CACHE_KWARG: cache})
        if bar is not None:
            bar.update(rnd.layout.length)
    if bar is not None:
        bar.close()
    cache.end_prefill()


def _progress(rounds: int, info, plan: PrefillPlan):
    """A progress bar on rank 0 for a prefill of many rounds (tqdm, as transformers' own); None otherwise."""
    if rounds < _PROGRESS_FROM_ROUNDS or info.rank != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=plan.length, unit="tok", unit_scale=True, desc=f"context-parallel prefill ({info.world_size} "
                f"ranks, {rounds} rounds)", leave=False)


@torch.no_grad()
def context_parallel_inputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    combine: str = "all_gather",
    group=None,
    **options,
) -> dict:
    """Prefill ``input_ids`` with its KV sharded over the ranks and return ``generate()`` inputs.

    Call it on every rank with the same arguments (a collective operation), then
    ``model.generate(**inputs, ...)`` on every rank.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"`` on this rank's device (full attention
            layers; sliding windows only while the sequence fits the window).
        input_ids: ``[batch, seq]`` int64 token ids on the model's device, left-padded when rows differ.
        attention_mask: ``[batch, seq]`` 1 = real token, 0 = padding (left only); None = no padding.
        combine: how decode merges the ranks' partial attention (out ``[B, H, 1, D]``, fp32 lse ``[B, H, 1]`` per
            rank and layer), exactly: ``"all_gather"`` (default: ONE all-gather of every rank's packed fp32
            state, merged locally), ``"tree"`` (all-reduce max + one all-reduce), ``"all_to_all"`` (vLLM DCP
            style: all-to-all + all-gather), or ``"all_gather_kv"`` (baseline: gathers the KV, grows with the
            context).
        group: the process group (default: the default group set up by torchrun / Accelerate).
        **options:
            placement: ``"least_loaded"`` (default) or ``"round_robin"``: which rank stores each new token's KV.
            shared_prefix: ``"auto"`` (default), True or False. With True (auto: batch > 1 and the rows share at
                least ``min_shared_tokens`` leading tokens) the common prefix is prefilled once (batch 1) and
                sharded over the ranks, stored without a batch dimension (cascade); the rows' suffixes are
                prefilled afterwards and stay on one rank. The returned rows are then laid out
                ``[prefix | pads | suffix]``: the completions are ``out[:, inputs["input_ids"].shape[1]:]``.
            min_shared_tokens: shortest prefix ``"auto"`` shares (default 16).
            pad_token_id: id written in padding columns (never attended; default the model's pad id, else 0).
            sync_rng: give every rank rank 0's RNG state so sampling agrees (default True).
            check_inputs: verify every rank passed the same prompt (default True; one small all-gather).
            max_new_tokens: None (default: decode KV grows as needed, eager decode) or the most tokens generate()
                will produce: fixed per-layer decode buffers written in place (:mod:`hf_cascade.parallel.fixed`),
                so the cache is compileable and generate() compiles the decode step where it compiles (CUDA by
                default; ``CompileConfig._compile_all_devices`` elsewhere). Not with ``combine="all_gather_kv"``.
                The cache records the prompt's padding: pass generate() the returned ``attention_mask``. Not needed
                on CUDA, where the default ``decode_step`` sizes the buffers from generate()'s own max_new_tokens;
                buffers smaller than that are resized before the first step.
            decode_step: how generate() runs the decode steps (:mod:`hf_cascade.parallel.generation`): ``"auto"``
                (default: on CUDA the step recorded into a CUDA graph with the decoder layers compiled and the
                combine inside the graph; elsewhere transformers' own loop), ``"layers"``, ``"graphs"``,
                ``"compile"`` or ``"eager"`` (the opt-out: every step eager; growing KV unless ``max_new_tokens``).
            kernels: the attention blocks' kernel (ring prefill, decode prompt shards): ``"auto"`` (default:
                PyTorch's cuDNN attention for ring blocks, FlashAttention-2 for decode shards, where they apply on
                CUDA; else hf_cascade's suffix kernel), ``"fused"`` or ``"suffix"``.
            prefill_chunk_tokens: prompt columns each rank runs through the model at a time (even; default
                ``min(16384, 65536 / ranks) / rows``). The prefill runs the prompt in rounds of ``ranks x`` that many
                columns (:mod:`~hf_cascade.parallel.prefill_plan`), so its working set does not grow with the prompt.
            memory_per_rank: bytes each rank may use for the KV, the prefill's working set and the decode buffers
                (default None: measured, the GPU's free memory). Checked on every rank before any work
                (:mod:`~hf_cascade.parallel.capacity`).
    Returns:
        ``{"input_ids", "attention_mask", CACHE_KWARG, "custom_generate"}`` for ``model.generate(**inputs, ...)``;
        the cache is a :class:`~hf_cascade.parallel.cache.ContextParallelCache` holding this rank's shard
        (``.nbytes``), ``custom_generate`` :func:`~hf_cascade.parallel.generation.context_parallel_generate` (do not
        pass another one). The same dict may be passed to several generate() calls: each starts again from the
        prompt.
    Raises:
        ValueError: no process group is initialised (the message explains how to launch), bad arguments,
            ranks passing different prompts, or a prompt that does not fit the ranks' memory (raised on every rank
            before any work; the message names the longest prompt that fits and how many GPUs this one needs).
    """
    opts = ParallelOptions.of(combine, options)  # before any collective: a typo fails at once on every rank
    _check_attention_splits(model)
    info = resolve_group(group)
    check_model_uses_cascade(model)
    check_device(info, model.device, "context_parallel_inputs")
    input_ids, mask = _validate(model, input_ids, attention_mask)
    pad_id = _default_pad_id(model) if opts.pad_token_id is None else int(opts.pad_token_id)
    if opts.check_inputs:
        _check_same_on_all_ranks(input_ids, mask, info)
    if opts.sync_rng:
        sync_rng(info, input_ids.device)
    _check_attention_splits(model, int(input_ids.shape[1] if mask is None else mask.sum(-1).max()))

    prefix = 0
    if opts.shared_prefix is not False and input_ids.shape[0] > 1:
        prefix = _shared_prefix_length(input_ids, mask, 1 if opts.shared_prefix is True else
                                       int(opts.min_shared_tokens))
    if prefix and combine == "all_gather_kv":
        raise ValueError("combine='all_gather_kv' (a benchmark baseline) cannot be used with a shared prefix; "
                         "pass shared_prefix=False.")
    rows = 1 if prefix else input_ids.shape[0]
    length = prefix if prefix else input_ids.shape[1] - 1  # generate() feeds the last column itself
    plan = PrefillPlan(length, info.world_size, opts.prefill_chunk_tokens or default_rank_tokens(info.world_size, rows))
    need = _check_fits(model, plan, info, input_ids, mask, prefix, opts.max_new_tokens, opts.memory_per_rank)

    cache = ContextParallelCache(model, info, combine=combine, placement=opts.placement, kernels=opts.kernels)
    cache.decode_step = opts.decode_step
    new_ids, new_mask = _prefill_prompt(model, cache, plan, input_ids, mask, prefix, pad_id, need)
    as_given = input_ids[:, input_ids.shape[1] - new_ids.shape[1]:]
    if prefix and not torch.equal(as_given, new_ids):  # (logits processors see the rows as given)
        cache.prompt_as_given = as_given
        # (their left padding, as transformers counts it from the mask for repetition_penalty)
        cache.prompt_padding_as_given = (mask[:, mask.shape[1] - new_ids.shape[1]:] != 0).int().argmax(dim=1)
    cache.mark_prompt(new_ids.shape[0])
    if opts.max_new_tokens is not None:
        cache.use_fixed_buffers(opts.max_new_tokens, new_mask)
    if combine == "all_gather_kv":
        cache.decode_step = "eager"
    inputs = {"input_ids": new_ids, "attention_mask": new_mask, CACHE_KWARG: cache,
              "custom_generate": context_parallel_generate}
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) is not None:
        inputs["cache_implementation"] = None
    return inputs


def _prefill_prompt(model, cache, plan: PrefillPlan, input_ids, mask, prefix: int, pad_id: int, need: MemoryNeed):
    """Prefill the prompt into ``cache`` (all but its last column; with a shared ``prefix``, the prefix in rounds
    and then the rows' suffixes on one rank). Returns the rows ``(input_ids, attention_mask)`` generate() gets."""
    if prefix == 0:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        body = slice(0, plan.length)
        key_valid = mask[:, body].bool()
        key_valid = None if bool(key_valid.all()) else key_valid
        _ring_prefill(model, cache, plan, input_ids[:, body], positions[:, body], key_valid, shared=False,
                      keep_cached=need.temporaries)
        return input_ids, mask
    new_ids, new_mask = _relayout_shared(input_ids, mask, prefix, pad_id)
    positions = (new_mask.cumsum(-1) - 1).masked_fill(new_mask == 0, 1)
    _ring_prefill(model, cache, plan, new_ids[:1, :prefix], positions[:1, :prefix], None, shared=True,
                  keep_cached=need.temporaries)
    end = new_ids.shape[1] - 1
    if end > prefix:  # the rows' suffixes but their last token: an ordinary forward, placed on one rank
        model.base_model(input_ids=new_ids[:, prefix:end], attention_mask=new_mask[:, :end],
                         position_ids=positions[:, prefix:end], use_cache=True, **{CACHE_KWARG: cache})
    return new_ids, new_mask


def _relayout_shared(input_ids, mask, prefix: int, pad_id: int):
    """Left-padded rows -> ``[prefix | pads | suffix]`` (``[B, prefix + max suffix]``)."""
    rows = [ids[m.bool()] for ids, m in zip(input_ids, mask)]
    width = max(r.numel() for r in rows) - prefix
    new_ids = input_ids.new_full((len(rows), prefix + width), pad_id)
    new_mask = mask.new_zeros((len(rows), prefix + width))
    for i, row in enumerate(rows):
        suffix = row.numel() - prefix
        new_ids[i, :prefix] = row[:prefix]
        new_ids[i, prefix + width - suffix:] = row[prefix:]
        new_mask[i, :prefix] = 1
        new_mask[i, prefix + width - suffix:] = 1
    return new_ids, new_mask
