"""``context_parallel_generate``: generate()'s decoding on a :class:`~hf_cascade.parallel.cache.ContextParallelCache`.

``context_parallel_inputs`` returns it under ``"custom_generate"`` (transformers' own hook for a custom decoding
function), so the user's ``model.generate(**inputs, max_new_tokens=N)`` runs it with no extra argument. generate()
does its usual preparation (generation config, logits processors, stopping criteria, the rows expanded for
``num_return_sequences`` / ``num_beams``) and calls it instead of its decoding loop. What it adds:

* **The decode step recorded into a CUDA graph, by default on CUDA** (greedy search and sampling), as the
  single-GPU path does (:class:`~hf_cascade.decode.captured_step.CapturedDecodeStep`): the cache gets fixed decode buffers
  sized for this call (:meth:`ContextParallelCache.use_fixed_buffers`, ``max_new_tokens`` read from the generation
  config, rounded up to a power of two so that later calls reuse them), the decoder layers run compiled once per
  model (:mod:`hf_cascade.compiled_layers`; ``decode_step="layers"``) with each layer's attention one opaque op, and
  that op's per-layer combine (one NCCL all-gather) is recorded in the graph with the rest of the step. A step then
  costs one graph launch instead of ~1,500 kernel launches and 32 host-driven collectives.
* **The same tokens on every rank**: every step's scores are broadcast from rank 0 (the ranks' logits agree only to
  rounding), and a sampling call gives every rank rank 0's RNG state first (rank 0's is untouched: the same seed
  draws sdpa's tokens), so a per-rank seed set after
  ``context_parallel_inputs`` (``set_seed(seed, device_specific=True)``) cannot make ranks differ.

``decode_step`` (``context_parallel_inputs(..., decode_step=...)``, stored on the cache): ``"auto"`` (default:
``"layers"`` where transformers would compile the step — CUDA, greedy or sampling, no ``disable_compile`` — else
transformers' own decoding), ``"layers"``, ``"graphs"`` (the eager step recorded, no compiler), ``"compile"``
(transformers' ``torch.compile`` of the whole step, functional collectives in the graph) or ``"eager"``. Beam
search and the other modes run transformers' own method on the cache.
"""

from __future__ import annotations

import functools

import torch

from hf_cascade.attention import dropout_in_training
from hf_cascade.options import DECODE_STEPS
from hf_cascade.parallel._group import sync_rng
from hf_cascade.parallel.cache import ContextParallelCache
from hf_cascade.transformers_compat import CACHE_KWARG

_MIN_BUFFER_TOKENS = 32


def decode_buffer_tokens(max_new_tokens: int) -> int:
    """Fixed decode buffers for ``max_new_tokens``: the next power of two, at least 32 (calls asking for a few tokens
    more or less reuse one set of buffers and its recorded graph)."""
    size = _MIN_BUFFER_TOKENS
    while size < max_new_tokens:
        size *= 2
    return size


def check_decode_step(decode_step) -> str:
    if decode_step not in DECODE_STEPS:
        raise ValueError(f"`decode_step` must be one of {DECODE_STEPS}; got {decode_step!r}.")
    return decode_step


def _resolve_step(cache: ContextParallelCache, model, input_ids, generation_config, method_name: str) -> str | None:
    """The decode step this call runs, or None for transformers' own decoding method as generate() prepared it."""
    from hf_cascade.run_plan import _compiles_decode

    step = cache.decode_step
    if method_name != "_sample":
        return None
    compiles = _compiles_decode(model, input_ids, generation_config, method_name)
    if step == "auto":
        fixed_work = cache.fixed_buffers_refusal is None
        return "layers" if compiles and fixed_work and input_ids.device.type == "cuda" else None
    if step in ("layers", "graphs") and input_ids.device.type != "cuda":
        return None  # CUDA graphs: on CPU the step runs as transformers runs it
    return step


def _check_windows_fit(model, input_ids: torch.LongTensor, generation_config) -> None:
    """A sliding window shorter than the prompt and the new tokens is refused before any step runs (the decode would
    refuse it at the step that crosses it, its tokens so far lost): a NotImplementedError naming the layer."""
    from hf_cascade.model_scan import attention_modules
    from hf_cascade.windows import layer_window

    if generation_config.max_length is None:
        return
    total = generation_config.max_length - 1  # the columns of the last forward (the last new token is never fed)
    for layer_idx, modules in sorted(attention_modules(model).items()):
        for module in modules:
            window = layer_window(module)
            if window is not None and total > window:
                raise NotImplementedError(
                    f"{type(module).__name__} (layer {layer_idx}) uses a sliding window of {window} tokens and this "
                    f"call reaches {total} (prompt {input_ids.shape[1]} + new tokens): context parallelism supports "
                    "full attention only. Lower max_new_tokens to keep prompt + new tokens within the window."
                )


def context_parallel_generate(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                              generation_config=None, **model_kwargs):
    """transformers' ``custom_generate`` entry point for a :class:`ContextParallelCache` (see the module docstring).

    Args:
        model: the causal LM (``attn_implementation="cascade"``) the cache was prefilled with, on this rank.
        input_ids: ``[B * n, L]`` the rows generate() prepared from ``context_parallel_inputs``' ``input_ids``.
        logits_processor, stopping_criteria, generation_config: as generate() prepared them.
        model_kwargs: generate()'s model kwargs; the cache under ``past_key_values`` (``cache`` from transformers
            5.24) must be the ContextParallelCache ``context_parallel_inputs`` returned.
    Returns:
        What generate() returns for the mode; the same tokens on every rank.
    """
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    from hf_cascade.decode.sampling import sample
    from hf_cascade.generation import _run

    cache = model_kwargs.get(CACHE_KWARG)
    if not isinstance(cache, ContextParallelCache):
        raise ValueError(
            "context_parallel_generate decodes on the ContextParallelCache that context_parallel_inputs returns; got "
            f"{type(cache).__name__}. Call model.generate(**hf_cascade.context_parallel_inputs(model, input_ids), ...)."
        )
    check_same_generation_args(cache.info, input_ids, generation_config, logits_processor, stopping_criteria)
    method_name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    decode = getattr(type(model), method_name, None) if method_name in ("_sample", "_beam_search") else None
    if decode is None:  # (assisted decoding, prompt lookup included, would feed the whole prompt again)
        raise NotImplementedError(
            f"Context parallelism runs greedy search, sampling and beam search; this generation config asks for "
            f"{generation_config.get_generation_mode().name.lower()}."
        )
    _check_windows_fit(model, input_ids, generation_config)
    dropout = dropout_in_training(model)
    if dropout is not None:  # (every rank's model is in the same mode: refused on every rank)
        raise NotImplementedError(f"Context parallelism cannot decode with {dropout}: its attention has none.")
    for flag in ("output_hidden_states", "output_attentions"):
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"`{flag}=True` with context parallelism: the prompt was run by context_parallel_inputs, each rank "
                "over its own shard, so generate() sees only the new tokens and would return their part alone "
                f"(not as wide as sdpa's). Call generate() without `{flag}`; for the prompt's, run the model on one "
                "device where it fits."
            )
    if generation_config.do_sample:
        sync_rng(cache.info, input_ids.device)
    if cache.info.world_size > 1:
        logits_processor = _with_rank_zero_scores(logits_processor, cache.info)
    if cache.prompt_as_given is not None:
        logits_processor, stopping_criteria = _seeing_prompt_as_given(logits_processor, stopping_criteria,
                                                                      cache.prompt_as_given,
                                                                      cache.prompt_padding_as_given)
    step = _resolve_step(cache, model, input_ids, generation_config, method_name)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    # Fixed buffers where the step records or compiles, and buffers of the user's too small for this call: sized
    # before any step (at a step that overran them, the tokens so far would be lost).
    if (step not in (None, "eager") and cache.max_new_tokens is None) or (
            cache.max_new_tokens is not None and cache.max_new_tokens < max_new_tokens):
        mask = model_kwargs.get("attention_mask")
        if mask is None:  # transformers >= 5.18 drops an all-ones mask
            mask = torch.ones_like(input_ids)
        cache.use_fixed_buffers(decode_buffer_tokens(max_new_tokens), mask)
    if step is not None:
        decode = functools.partial(sample, decode_step=step)
    return _run(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)


def _generation_fields(input_ids, generation_config, logits_processor, stopping_criteria) -> dict[str, str]:
    """What must be the same on every rank, as comparable strings: every generation-config field, the rows' shape,
    the logits processors' and stopping criteria's classes."""
    import json

    def plain(value):
        if isinstance(value, dict):  # (keys of any type: sequence_bias's are tuples of token ids)
            return sorted(([plain(k), plain(v)] for k, v in value.items()), key=repr)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return type(value).__name__  # an object: its class (no address, which differs per process)

    fields = {key: json.dumps(plain(value)) for key, value in generation_config.to_dict().items()
              if not key.startswith("_")}
    fields["input_ids.shape"] = str(tuple(input_ids.shape))
    fields["logits_processor"] = str([type(p).__name__ for p in logits_processor or []])
    fields["stopping_criteria"] = str([type(c).__name__ for c in stopping_criteria or []])
    return fields


def _digest(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_same_generation_args(info, input_ids, generation_config, logits_processor, stopping_criteria) -> None:
    """Every rank must call generate() with the same arguments (each decode step is a collective): compare them
    (one all-gather of a hash; a second one names the fields when they differ) and raise the same ValueError on
    every rank, before any step, instead of a rank failing or waiting alone mid-generation."""
    import torch.distributed as dist

    if info.world_size == 1:
        return
    fields = _generation_fields(input_ids, generation_config, logits_processor, stopping_criteria)
    keys = sorted(fields)
    device = input_ids.device

    def gathered(values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.long, device=device)
        out = [torch.empty_like(mine) for _ in range(info.world_size)]
        dist.all_gather(out, mine, group=info.group)
        return [t.tolist() for t in out]

    summary = gathered([_digest(repr(keys)), _digest(repr([fields[k] for k in keys]))])
    if all(row == summary[0] for row in summary):
        return
    if any(row[0] != summary[0][0] for row in summary):
        raise ValueError("context-parallel generate(): the ranks' generation configs have different fields "
                         "(different transformers versions?). Run every rank from the same environment.")
    per_key = gathered([_digest(fields[k]) for k in keys])
    differ = [k for i, k in enumerate(keys) if any(row[i] != per_key[0][i] for row in per_key)]
    raise ValueError(
        f"context-parallel generate(): the ranks called generate() with different arguments: {differ} (this rank, "
        f"{info.rank}: " + ", ".join(f"{k}={fields[k]}" for k in differ[:4]) + "). Every rank must call generate() "
        "with the same arguments (each decode step is a collective over the ranks)."
    )


def _with_rank_zero_scores(logits_processor, info):
    """generate()'s logits processors + a last one that broadcasts rank 0's scores, so that every rank picks the
    same token. The ranks' logits agree to rounding (each layer's combine gives every rank the same bytes), but not
    bitwise: a compiled layer's kernels are tuned per process, and in bf16 a near-tie then picks another token on
    one rank, whose KV and tokens would drift apart from there (seen on 4 GPUs, 2026-11-26). One broadcast of
    ``[rows, vocab]`` fp32 per step (~0.5 MB per row), on the GPU's stream, no host wait."""
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

    class _RankZeroScores(LogitsProcessor):
        def __call__(self, input_ids, scores):
            import torch.distributed as dist

            scores = scores.contiguous()
            dist.broadcast(scores, src=info.global_ranks[0], group=info.group)
            return scores

    return LogitsProcessorList([*(logits_processor or []), _RankZeroScores()])


def _seeing_prompt_as_given(logits_processor, stopping_criteria, prompt: torch.Tensor,
                            padding: torch.Tensor | None = None):
    """generate()'s logits processors and stopping criteria, handed each row's prompt as the user laid it out
    (left-padded) instead of the ``[prefix | pads | suffix]`` rows a shared prefix is decoded from: n-gram bans,
    bad words and criteria that read the prompt then see what they see without context parallelism. ``prompt``
    ``[B, W]``: the user's rows, as wide as the relaid ones (generate() repeats them for num_return_sequences /
    num_beams); the new tokens follow as they are. ``padding`` ``[B]``: their left padding; a processor that counts
    the prompt's padding from generate()'s mask (transformers >= 5.24's ``repetition_penalty``: a tensor
    ``prompt_ignore_length``, which the relaid mask makes 0) gets it instead."""
    from transformers.generation.logits_process import LogitsProcessorList

    for processor in logits_processor or []:
        ignored = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignored, torch.Tensor) and padding is not None:
            processor.prompt_ignore_length = padding.to(ignored.device).repeat_interleave(
                ignored.shape[0] // padding.shape[0])
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    def as_given(input_ids):
        rows = prompt.to(input_ids.device).repeat_interleave(input_ids.shape[0] // prompt.shape[0], dim=0)
        return torch.cat([rows, input_ids[:, prompt.shape[1]:]], dim=1)

    class _Processors(LogitsProcessorList):
        def __call__(self, input_ids, scores, **kwargs):
            return super().__call__(as_given(input_ids), scores, **kwargs)

    class _Criteria(StoppingCriteriaList):
        def __call__(self, input_ids, scores, **kwargs):
            return super().__call__(as_given(input_ids), scores, **kwargs)

    return _Processors(logits_processor or []), _Criteria(stopping_criteria or [])
