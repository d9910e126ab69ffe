"""The ``"cascade"`` attention implementation, registered with transformers' ``AttentionInterface``.

How a forward pass reaches hf_cascade (transformers 5.x): every decoder layer projects q/k/v, calls
``key, value = past_key_values.update(key, value, layer_idx)`` and then the registered attention function
with whatever ``update`` returned. The attention function never sees the cache itself. An hf_cascade cache
(:class:`~hf_cascade.cache.CascadeCache`, or a context-parallel cache) therefore *binds* itself in ``update``:
it records ``(cache, layer_idx, returned_key, returned_value)`` in a context variable, and
:func:`cascade_attention_forward` looks the binding up, checks that the key and value it was handed are exactly the
tensors that cache returned for this layer, and delegates to ``cache.attend(...)``. A layer whose attention call
gets other tensors (a model that transforms K/V after ``cache.update``: DeepSeek-V2/V3's MLA expands cached
latents, DiffLlama attends over halves of V) would attend without the shared prefix the cache holds apart: that is
refused with an error naming the model, never run silently.

With no hf_cascade cache in play (a plain ``DynamicCache``, no cache, training), ``"cascade"`` is exactly
``"sdpa"`` (or, for soft-capped models such as Gemma2, which sdpa cannot express, an exact eager path).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import weakref
from typing import Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from hf_cascade._own_attention_tables import OWN_ATTENTION_TABLES
from hf_cascade.step_context import TRACE, current as _step, layer_step_cache, note_layer_written, outside_layer_graphs
from hf_cascade.transformers_compat import text_config

logger = logging.get_logger(__name__)
# sdpa's backends outside compiled graphs: every one but cuDNN's (plain_attention)
_SDPA_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

ATTENTION_NAME = "cascade"

# (weakref to the binding cache, layer_idx, the key and value tensors its update() returned; value None: not
# checked). Set by a cache's update(),
# consumed (and cleared) by the attention function of the same layer, on the same thread.
_BINDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("hf_cascade_binding", default=None)
# While torch.compile traces a forward the binding is step_context.TRACE.binding instead (dynamo cannot trace a
# ContextVar): set and read within one traced frame, so the compiled graph holds the resolved cache.


class AttentionProvider(Protocol):
    """What a cache must implement to take over attention for the layers it serves."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float,
        softcap: float | None,
        sliding_window: int | None,
        **kwargs,
    ) -> torch.Tensor:
        """Return the attention output ``[batch, q_len, num_heads, head_dim]`` in ``query.dtype``.

        ``query`` is ``[batch, num_heads, q_len, head_dim]``; ``key``/``value`` are what the cache's ``update``
        returned for ``module.layer_idx``; ``attention_mask`` is what the ``"cascade"`` mask builder produced
        (``None`` = causal aligned bottom-right, or a bool ``[batch, 1, q_len, kv_len]`` mask, True = attend).
        """
        ...


def bind_layer(
    cache: AttentionProvider, layer_idx: int, key: torch.Tensor, value: torch.Tensor | None = None
) -> None:
    """Called by a cache's ``update()``: the next attention call of ``layer_idx`` goes to ``cache``; it must be given
    exactly ``key`` (and ``value``, unless None) as ``update()`` returned them (see :func:`bound_provider`)."""
    if torch.compiler.is_compiling():
        TRACE.binding = (cache, layer_idx, key, value)
        return
    stale = _BINDING.get()
    if stale is not None and stale[1] == layer_idx - 1 and stale[0]() is cache:
        # The previous layer's attention never consumed its binding: it is not hf_cascade's attention.
        _BINDING.set(None)
        raise ValueError(
            f"Layer {layer_idx - 1}'s attention did not go through hf_cascade's 'cascade' attention, so it never read "
            f"the shared prefix stored in this {type(cache).__name__}: every row would silently lose it. The model "
            "this cache was given to runs another attention implementation; load it with "
            "attn_implementation='cascade' (or call `model.set_attn_implementation('cascade')`), or pass no "
            "hf_cascade cache to it."
        )
    _BINDING.set((weakref.ref(cache), layer_idx, key, value))


def bound_provider(
    module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor | None = None
) -> AttentionProvider | None:
    """The cache bound for this attention call, or None (no hf_cascade cache in play). Clears the binding (it is
    single-use).

    Raises:
        NotImplementedError: a cache is bound, but this call was not handed the key/value tensors the cache's
            ``update()`` returned for this layer (the model transforms K/V after the cache update, or calls the
            attention for another layer): the shared prefix the cache stores apart would be silently lost.
    """
    if torch.compiler.is_compiling():
        binding, TRACE.binding = TRACE.binding, None
        if binding is None:
            return None
        cache, layer_idx, bound_key, bound_value = binding
    else:
        binding = _BINDING.get()
        if binding is None:
            return None
        _BINDING.set(None)
        cache_ref, layer_idx, bound_key, bound_value = binding
        cache = cache_ref()
        if cache is None:
            return None
    module_layer = getattr(module, "layer_idx", None)
    if bound_key is not key or (bound_value is not None and bound_value is not value) or layer_idx != module_layer:
        value_differs = bound_value is not None and value is not bound_value
        _refuse_mismatch(cache, module, layer_idx, key is not bound_key, value_differs)
    return cache


def _refuse_mismatch(cache, module: torch.nn.Module, layer_idx: int, key_differs: bool, value_differs: bool) -> None:
    """Raise for an attention call that was not handed what ``cache.update()`` returned (see bound_provider)."""
    config = getattr(module, "config", None)
    model = getattr(cache, "_model_name", None) or getattr(config, "model_type", None) or "this model"
    module_layer = getattr(module, "layer_idx", None)
    if module_layer != layer_idx:
        what = f"the attention of layer {module_layer} was called right after the cache update of layer {layer_idx}"
    else:
        tensors = " and ".join(n for n, d in (("keys", key_differs), ("values", value_differs)) if d)
        what = (f"layer {layer_idx}'s attention ({type(module).__name__}) was given other {tensors} than the "
                f"{type(cache).__name__}'s update() returned (the model transforms K/V after the cache update, e.g. "
                "MLA expanding cached latents as DeepSeek-V2/V3 do, or attention over halves of V as DiffLlama's)")
    raise NotImplementedError(
        f"hf_cascade cannot serve {model}: {what}. The cascade attention reads the shared prefix from the cache "
        "itself, in the form update() stored it, so this layer would silently attend without the prefix. Use "
        "attn_implementation='sdpa' (without an hf_cascade cache) for this model."
    )


def _as_bool_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise a transformers mask to bool ``[batch, q_len, kv_len]`` (True = attend), or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(
            f"`attention_mask` given to the cascade attention must be 4-D [batch, 1, q_len, kv_len]; got shape "
            f"{tuple(attention_mask.shape)}. Let transformers build the mask from a 2-D padding mask."
        )
    if attention_mask.shape[1] != 1:
        raise ValueError(
            f"`attention_mask` with per-head masks (shape {tuple(attention_mask.shape)}) is not supported by the "
            "cascade attention; pass a mask broadcast over heads ([batch, 1, q_len, kv_len])."
        )
    mask = attention_mask[:, 0]
    if mask.dtype != torch.bool:
        # Additive float mask (0 = attend, large negative = masked).
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


def sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, *, scaling: float | None, dropout: float = 0.0,
                   **kwargs) -> torch.Tensor:
    """transformers' sdpa attention over ``key``/``value`` as given, never through cuDNN's attention outside a
    compiled graph (see below). ``query`` ``[batch, num_heads, q_len, head_dim]``, ``key``/``value`` ``[batch,
    num_kv_heads, kv_len, head_dim]``, ``attention_mask`` None (causal, bottom-right) or 4-D ``[batch, 1, q_len,
    kv_len]``. Returns ``[batch, q_len, num_heads, head_dim]``."""
    # Never cuDNN's attention outside a compiled graph: it builds an execution plan for every new shape (its first
    # in a process 1.2 s, H100, torch 2.11: FlashAttention-2's first call 6-12 ms, 0.3 against 0.6 ms warm for a
    # 4,096-token prefill; benchmarks/results/probe_first_sdpa.jsonl), and a generate() call brings a new key
    # length at every decode step: a 1-row call of 64 new tokens took 6.8 s the first time, 1.6 s once its
    # shapes had plans (results/stall.jsonl, the calls with nothing to share).
    no_cudnn = query.is_cuda and not torch.compiler.is_compiling()
    with sdpa_kernel(_SDPA_WITHOUT_CUDNN) if no_cudnn else contextlib.nullcontext():
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    return out


def plain_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    **kwargs,
) -> torch.Tensor:
    """Standard attention over ``key``/``value`` as given: sdpa, or an exact path (hf_cascade's suffix kernel) for
    soft-capping (Gemma 2) and attention sinks (GPT-OSS's ``s_aux``, ``sinks`` ``[Hq]``: one logit per head in the
    softmax denominator whose value is zero, merged into the state's LSE); a forward of those two that needs
    gradients or dropout runs transformers' eager attention instead (:func:`~hf_cascade.ops.reference.
    eager_attention_ref`: the kernels have no backward). ``backend``: as :func:`~hf_cascade.ops.suffix_attention.
    suffix_attention`'s (``"torch"`` builds no Triton kernel). Outside a compiled graph sdpa never picks cuDNN's
    attention (a plan per new shape; see below).

    Args:
        attention_mask: None (causal, bottom-right) or 4-D ``[batch, 1, q_len, kv_len]`` (bool, or additive).
    Returns:
        ``[batch, q_len, num_heads, head_dim]``.
    """
    if softcap is None and sinks is None:
        return sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    from hf_cascade.ops.bounded import merge_sink
    from hf_cascade.ops.reference import eager_attention_ref
    from hf_cascade.ops.suffix_attention import suffix_attention

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = _as_bool_mask(attention_mask)
    training = bool(dropout) and module.training
    if training or (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, sinks))):
        return eager_attention_ref(query, key, value, scale=scale, mask=mask, softcap=softcap, sinks=sinks,
                                   dropout=dropout, training=training)
    out, lse = suffix_attention(query, key, value, scale=scale, mask=mask, causal=True, softcap=softcap,
                                backend=backend)
    out = out.transpose(1, 2)
    if sinks is not None:
        return merge_sink(out, lse, sinks, heads_dim=2)[0]
    return out if mask is None else _unseeing_queries_as_eager(out, lse, value)


def _unseeing_queries_as_eager(out: torch.Tensor, lse: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``out [B, Lq, Hq, Dv]`` with every query that sees no key (``lse [B, Hq, Lq]`` -inf: a left pad's row) given
    eager's answer, the mean of the values ``[B, Hkv, S, Dv]`` (its masked scores all sit at the dtype's minimum: a
    uniform softmax), where the kernels give 0: the logits at pads, which a loss over a left-padded batch reads."""
    if value.shape[2] == 0:
        return out
    mean = value.float().mean(dim=2).repeat_interleave(lse.shape[1] // value.shape[1], dim=1)  # [B, Hq, Dv]
    unseeing = torch.isneginf(lse).transpose(1, 2).unsqueeze(-1)  # [B, Lq, Hq, 1]
    return torch.where(unseeing, mean.unsqueeze(1).to(out.dtype), out)


def cascade_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"cascade"``; see the module docstring.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key, value: ``[batch, num_kv_heads, kv_len, head_dim]`` as returned by the cache's ``update``.
        attention_mask: from the ``"cascade"`` mask builder (same as sdpa's): None or bool 4-D.
    Returns:
        ``(attn_output [batch, q_len, num_heads, head_dim], None)``.
    """
    if outside_layer_graphs():  # a decoder layer compiled for a recorded step: one op writes the step and attends
        scaling = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        return torch.ops.hf_cascade.layer_step_attention(query, key, value, attention_mask, module.layer_idx,
                                                         scaling, softcap), None
    provider = bound_provider(module, key, value)
    if provider is None:
        if (query.shape[0] > 1 and query.shape[2] > 1 and getattr(module, "layer_idx", None) == 0
                and not (torch.is_grad_enabled() and query.requires_grad)):  # (not a training forward)
            _suggest_custom_generate()
        # (With attention sinks, GPT-OSS's s_aux, the mask holds any sliding window.)
        out = plain_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                              softcap=softcap, sinks=kwargs.pop("s_aux", None), **kwargs)
        return out, None
    if dropout and module.training:
        raise NotImplementedError(
            f"Attention dropout in training mode (p={dropout}) with a cascade cache: its attention runs without "
            "dropout. Call `model.eval()` for generation, or generate without the cache."
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = provider.attend(
        module,
        query,
        key,
        value,
        _as_bool_mask(attention_mask),
        scaling=scaling,
        softcap=softcap,
        sliding_window=sliding_window,
        **kwargs,
    )
    return out, None


@torch.library.custom_op("hf_cascade::layer_step_attention", mutates_args=())
def layer_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, layer_idx: int, scaling: float,
                         softcap: float | None) -> torch.Tensor:
    """One decoder layer's attention inside :func:`~hf_cascade.compiled_layers.compiled_layers` (a decode step or a
    prefill forward): the new columns' KV written into the cache (``CascadeCache.update``) and the cascade attention
    over it, as the eager layer runs them. One op in the layer's graph (no graph break), ``layer_idx`` a symbol, so
    one compiled graph serves every layer. The cache is the one :func:`compiled_layers` was entered with (the op only
    runs inside it; its writes are the cache's, which nothing else in the graph reads).

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``; key, value: the new ``[batch, num_kv_heads, q_len, head_dim]``
            (``q_len`` 1 in a decode step).
        attention_mask: the model's mask for the forward, or None.
    Returns:
        ``[batch, q_len, num_heads, head_dim]``, contiguous.
    """
    cache = layer_step_cache()
    if cache is None:
        raise RuntimeError("hf_cascade::layer_step_attention runs only inside compiled_layers(model, cache).")
    module = cache.attention_module(layer_idx)  # (the cache checked at prefill that it serves this model)
    keys, values = cache.update(key, value, layer_idx)
    note_layer_written(layer_idx, key.shape[2])
    out, _ = cascade_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, softcap=softcap)
    return out.contiguous()


@layer_step_attention.register_fake
def _(query, key, value, attention_mask, layer_idx, scaling, softcap):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _suggest_custom_generate() -> None:
    """Say once that a batched prefill on a "cascade" model ran as plain sdpa (no hf_cascade cache in play)."""
    if torch.compiler.is_compiling() or _step().in_generate:  # (in_generate: hf_cascade.generate planned it)
        return
    logger.warning_once(
        "hf_cascade: this batch ran with attn_implementation='cascade' but without an hf_cascade cache, so shared "
        "prompt prefixes were not shared (plain sdpa). Pass `custom_generate=hf_cascade.generate` to "
        "model.generate(...) or to a pipeline call to share them."
    )


def cascade_mask(*args, **kwargs) -> torch.Tensor | None:
    """The ``"cascade"`` mask builder: sdpa's (bool ``[batch, 1, q_len, kv_len]`` or None), with ``kv_len`` marked
    dynamic when built outside a compiled step. generate() builds the decode step's mask before calling the
    compiled forward; fixed buffers of another capacity (another bucket) then give a mask of another width that
    runs the same graph (the cascade step builds its own mask from the buffers, see ``CascadeCache``).

    In hf_cascade's decoding loop a decode step's mask (``q_length == 1``) is always built: to return None for
    "causal, no padding", sdpa's builder reads whether every padding-mask entry is 1 on the host, a host-device
    synchronisation at every step of the eager path (the compiled path builds it anyway). In a prefill forward with
    compiled layers (``StepContext.prefill_batch_masks``) a forward of several rows always gets one too: its
    layers then run the compiled graph of the forwards that need a mask, not one more graph (a second of tracing in
    a process's first calls, Llama-3-8B layer, H100)."""
    config = kwargs.get("config")
    if config is not None and not torch.compiler.is_compiling() and not routes_attention(type(config)):
        raise NotImplementedError(
            f"{config.model_type} does not route attention through transformers' AttentionInterface: its own "
            "attention would add the 'cascade' (boolean) mask to its scores as a float one, a wrong answer. Load it "
            "with attn_implementation='eager'."
        )
    step = _step()  # (the decode_masks of hf_cascade's decoding loop, decode.sampling.sample)
    if kwargs.get("q_length") == 1 and step.decode_masks:
        kwargs["allow_is_causal_skip"] = False
    if step.prefill_batch_masks and kwargs.get("batch_size", 1) > 1:
        kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(mask, 3)
    return mask


@functools.lru_cache(maxsize=None)
def routes_attention(config_class: type) -> bool:
    """Whether the base model of ``config_class`` calls the attention function transformers' ``AttentionInterface``
    registers (its ``_supports_attention_backend``; True for a config transformers does not map to a model)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        model_class = MODEL_MAPPING[config_class]
    except (KeyError, ValueError, ImportError):
        return True
    return bool(getattr(model_class, "_supports_attention_backend", True))


def unshareable_model(model: torch.nn.Module) -> str | None:
    """What in ``model`` a cascade cache cannot give exactly as its reference attention does, described for a
    message (None: nothing): attention over the prompt that is not causal (``use_bidirectional_attention``, Gemma 3
    / PaliGemma's default), positions counted from 1 (PaliGemma). Its plain forwards stay exact (sdpa)."""
    config = getattr(model, "config", None)
    decoder = text_config(config)
    if getattr(decoder, "use_bidirectional_attention", False):
        return f"{config.model_type}'s bidirectional attention over the prompt (`use_bidirectional_attention=True`)"
    if getattr(config, "model_type", None) == "paligemma":
        return "PaliGemma's positions, counted from 1"
    return None


# Config fields of the attention probabilities' dropout (transformers passes it to the attention in training mode).
_ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def dropout_in_training(model: torch.nn.Module) -> str | None:
    """Attention dropout that ``model``'s forwards apply now (training mode, a dropout field of its config above 0),
    described for a message, or None. The cascade caches attend without it (their decode runs inference kernels)."""
    if not model.training:
        return None
    decoder = text_config(getattr(model, "config", None))
    for config in (decoder, getattr(decoder, "attn_config", None)):  # (DBRX keeps it in attn_config)
        for name in _ATTENTION_DROPOUT_FIELDS:
            rate = getattr(config, name, None)
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
                return (f"attention dropout in training mode (`model.train()` with `{name}={rate}`; `model.eval()` "
                        "turns it off)")
    return None


def register() -> None:
    """Register ``"cascade"`` with ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent), and make the
    models that pick their attention class from a table of their own refuse it clearly (see :class:`_Refused`)."""
    AttentionInterface.register(ATTENTION_NAME, cascade_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, cascade_mask)
    refuse_in_own_tables()


def refuse_in_own_tables() -> None:
    """Give the attention table of each loaded model module of :data:`OWN_ATTENTION_TABLES` a ``"cascade"`` entry
    that refuses clearly (see :class:`_Refused`; never replaces an entry). Modules not loaded yet (or still loading)
    get it from :mod:`hf_cascade._registration`'s post-import hook once loaded."""
    for module_name, table, family in OWN_ATTENTION_TABLES:
        classes = getattr(sys.modules.get(module_name), table, None)
        if isinstance(classes, dict) and ATTENTION_NAME not in classes:
            classes[ATTENTION_NAME] = type(f"{family}CascadeRefused", (_Refused,), {"family": family})


class _Refused(torch.nn.Module):
    """The ``"cascade"`` entry of such a model's attention table: building it raises, naming the model and the fix."""

    family = "This model"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.family} does not route attention through transformers' AttentionInterface, so "
            "attn_implementation='cascade' cannot reach it (hf_cascade cannot share its prompt prefixes). Load it with "
            "attn_implementation='sdpa' (or 'eager')."
        )


def check_model_uses_cascade(model: torch.nn.Module, argument: str = "model") -> None:
    """Raise a ValueError/NotImplementedError explaining the fix unless ``model`` runs ``"cascade"`` attention."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"`{argument}` must be a transformers PreTrainedModel; got {type(model).__name__}.")
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"`{argument}` is an encoder-decoder model ({config.model_type}); hf_cascade supports decoder-only "
            "causal LMs."
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"`{argument}` ({type(model).__name__}) does not route attention through transformers' "
            "AttentionInterface, so attn_implementation='cascade' cannot reach it. Supported families include "
            "Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2 (see the README's support matrix)."
        )
    for name in ("num_kv_shared_layers", "kv_sharing_modes"):
        if getattr(config, name, None):
            raise NotImplementedError(
                f"`{argument}` ({config.model_type}) shares KV between layers (`config.{name}`); the cascade "
                "cache cannot serve layers that reuse another layer's KV. Use attn_implementation='sdpa'."
            )
    _check_kv_as_cached(model, config, argument)
    if getattr(text_config(config), "cross_attention_layers", None):
        raise NotImplementedError(
            f"`{argument}` ({type(model).__name__}) has cross-attention layers (to image states), whose keys and "
            "values the cascade cache does not hold. Use attn_implementation='sdpa' for this model."
        )
    layer_types = set(getattr(text_config(config), "layer_types", None) or ())
    for kinds, message in (
        (_STATEFUL_LAYER_TYPES, "is a hybrid model: its {} layers keep a convolution or recurrent state, which the "
                                "cascade cache (keys and values only) does not hold. Use attn_implementation='sdpa'"),
        (_SPARSE_LAYER_TYPES, "has sparse attention layers ({}): an indexer picks each query's keys and keeps its own "
                              "state in the cache, which the cascade cache (keys and values only) does not hold. Use "
                              "attn_implementation='eager'"),
    ):
        found = sorted(layer_types & kinds)
        if found:
            raise NotImplementedError(f"`{argument}` ({type(model).__name__}) "
                                      + message.format(", ".join(map(repr, found))) + " for this model.")
    dtype = getattr(model, "dtype", None)
    if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"`{argument}` is in {dtype}; hf_cascade's attention runs float32, float16 and bfloat16. "
                         f"Cast it first (`{argument}.to(torch.float32)`), or use attn_implementation='sdpa'.")
    if hasattr(model, "_orig_mod"):  # torch.compile(model): its generate() runs the model as loaded, its calls do not
        raise ValueError(f"`{argument}` is a torch.compile wrapper ({type(model).__name__}); pass the model as loaded "
                         f"(`{argument}._orig_mod`): hf_cascade compiles the layers itself where it pays.")
    compiled = _compiled_by_user(model)
    if compiled is not None:
        raise ValueError(
            f"`{argument}` was compiled by torch.compile ({compiled}: `.compile()` or a compiled `forward`). "
            "hf_cascade lays out each call's rows around the model's forward and compiles the layers itself where it "
            "pays; a forward compiled around its cache skips that layout and answers wrongly. Call it on the model as "
            "loaded (no `.compile()`); `torch.compile(model).generate(...)` runs it as loaded too."
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise ValueError(
            f"`{argument}` was loaded with attn_implementation={impl!r}; hf_cascade needs 'cascade'. Load it with "
            f"`AutoModelForCausalLM.from_pretrained(..., attn_implementation='cascade')` after `import hf_cascade`, "
            f"or call `{argument}.set_attn_implementation('cascade')`."
        )


def _compiled_by_user(model: torch.nn.Module) -> str | None:
    """The first module of ``model`` a user compiled (``module.compile()``, or ``module.forward =
    torch.compile(...)``), named, or None. (hf_cascade's own compiled layers are calls it holds apart.)"""
    for module in model.modules():  # (every call of an entry point: no name strings built unless one is found)
        call = getattr(module, "_compiled_call_impl", None)
        while getattr(call, "installed_by_hf_cascade", False):  # (compiled_layers' own, for its thread only)
            call = call.previous
        if call is not None or hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):
            name = next(name for name, m in model.named_modules() if m is module)
            return f"`{name}`" if name else type(module).__name__
    return None


# config.layer_types entries whose layers keep a state other than keys and values (LFM2's "conv", Mamba / GDN
# "linear_attention", Zamba2 / Falcon-H1 "hybrid", ...).
_STATEFUL_LAYER_TYPES = {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "recurrent", "rwkv"}
# Sparse attention whose indexer keeps state in the cache (DeepSeek-V3.2 / V4, GLM-MoE-DSA, HY-V4, ...).
_SPARSE_LAYER_TYPES = {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "minimax_m3_sparse"}


def _check_kv_as_cached(model: torch.nn.Module, config, argument: str) -> None:
    """Refuse the known models whose attention is not handed the K/V their layers store in the cache (the cascade
    attention reads the shared prefix from the cache, as stored): found before any work. Any other such model is
    refused at its first forward (:func:`bound_provider`)."""
    from hf_cascade.model_scan import attention_modules

    decoder_config = text_config(config)
    if getattr(decoder_config, "model_type", None) == "diffllama":
        raise NotImplementedError(
            f"`{argument}` ({type(model).__name__}) runs differential attention: each layer calls the attention "
            "twice, over two halves of the values it cached, so the cascade attention (which reads the shared prefix "
            "as the cache stored it) cannot serve it. Use attn_implementation='sdpa' for this model."
        )
    for modules in attention_modules(model).values():
        for module in modules:
            if callable(getattr(module, "expand_kv", None)):
                raise NotImplementedError(
                    f"`{argument}` ({type(model).__name__}) uses multi-head latent attention (MLA, "
                    f"`config.kv_lora_rank`={getattr(decoder_config, 'kv_lora_rank', None)}): {type(module).__name__} "
                    "caches compressed latents and expands them into keys and values after the cache update, so the "
                    "cascade attention (which reads the shared prefix as the cache stored it) cannot serve it. Use "
                    "attn_implementation='sdpa' for this model."
                )
        break  # one layer tells


# The module that defines "cascade" registers it once it is complete (idempotent). This matters where it was imported
# before transformers' attention registry was: its own imports loaded the registry, whose post-import hook
# (hf_cascade._registration) then found this module half-built and left the registration to this line.
register()
