"""lm-evaluation-harness model type ``"hf-cascade"``: lm-eval's ``hf`` model with shared prefixes run once.

``loglikelihood`` (multiple choice, cloze) goes through :func:`hf_cascade.score`: the few-shot block every question of
a task starts with, and each question's context its choices share, run through the model once each, instead of
once per (question, choice) pair. ``generate_until`` calls ``model.generate(..., custom_generate=hf_cascade.generate)``
(a batch's shared prompt prefix prefilled once). Everything else (tokenization, request handling, chat templates,
``loglikelihood_rolling``'s windows, truncation to ``max_length``) is lm-eval's own ``HFLM``, subclassed.

Use it from Python (importing this module registers the name)::

    import hf_cascade.eval_harness  # noqa: F401  (registers "hf-cascade" with lm-eval)
    import lm_eval
    results = lm_eval.simple_evaluate(model="hf-cascade", model_args="pretrained=PATH,dtype=float32", tasks=[...])

or from the command line, through this module (lm-eval's own ``lm_eval`` command finds only its built-in models)::

    python -m hf_cascade.eval_harness run --model hf-cascade --model_args pretrained=PATH --tasks hellaswag

Model arguments beyond ``hf``'s: ``max_batch_tokens`` (query tokens per scoring forward; default
:data:`~hf_cascade.scoring.DEFAULT_MAX_BATCH_TOKENS`), ``min_shared_tokens`` (4), ``max_levels`` (4). ``batch_size``
applies to ``generate_until`` only: scoring batches by ``max_batch_tokens``.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hf_cascade
from hf_cascade.attention import ATTENTION_NAME
from hf_cascade.scoring import DEFAULT_MAX_BATCH_TOKENS, score

MODEL_NAME = "hf-cascade"


class CascadeLM(HFLM):
    """lm-eval's ``HFLM`` whose model runs ``attn_implementation="cascade"``; see the module docstring.

    Args:
        pretrained: a local path or hub id (loaded with ``attn_implementation="cascade"``), or a loaded
            ``PreTrainedModel`` (switched to ``"cascade"``, which is exactly sdpa when no hf_cascade cache is in play).
        max_batch_tokens, min_shared_tokens, max_levels: as in :func:`hf_cascade.score`.
        kwargs: ``HFLM``'s (``dtype``, ``device``, ``batch_size``, ``max_length``, ...).
    """

    def __init__(self, pretrained, *, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, min_shared_tokens: int = 4,
                 max_levels: int = 4, **kwargs):
        if isinstance(pretrained, str):
            impl = kwargs.setdefault("attn_implementation", ATTENTION_NAME)
            if impl != ATTENTION_NAME:
                raise ValueError(
                    f"The {MODEL_NAME!r} model type runs attn_implementation={ATTENTION_NAME!r}; got "
                    f"attn_implementation={impl!r}. Leave it out, or use lm-eval's 'hf' model type for {impl!r}."
                )
        super().__init__(pretrained, **kwargs)
        if getattr(self.model.config, "_attn_implementation", None) != ATTENTION_NAME:
            self.model.set_attn_implementation(ATTENTION_NAME)
        for name, value in (("max_batch_tokens", max_batch_tokens), ("min_shared_tokens", min_shared_tokens),
                            ("max_levels", max_levels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_levels" else 1):
                raise ValueError(f"`{name}` (a model_args entry of {MODEL_NAME!r}) must be a positive int; got "
                                 f"{value!r}.")
        self.score_options = dict(max_batch_tokens=max_batch_tokens, min_shared_tokens=min_shared_tokens,
                                  max_levels=max_levels)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """``[(logprob, is_greedy)]`` for ``requests`` = ``[(cache key, context ids, continuation ids)]``, as
        ``HFLM._loglikelihood_tokens`` returns them (its truncation: the last ``max_length + 1`` tokens of
        context + continuation), from one :func:`hf_cascade.score` call."""
        if self.backend != "causal":
            raise NotImplementedError(f"{MODEL_NAME!r} scores decoder-only (causal) models; use 'hf' for seq2seq.")
        contexts, continuations = [], []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError(
                    f"lm-eval passed a request with {len(context)} context and {len(continuation)} continuation "
                    "tokens; HFLM needs both non-empty (it prepends prefix_token_id to an empty context)."
                )
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"A continuation of {len(continuation)} tokens is longer than max_length={self.max_length}."
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            contexts.append(whole[: len(whole) - len(continuation)])
            continuations.append(continuation)
        autocast = getattr(self, "mixed_precision_dtype", None)  # (lm-eval >= 0.4.10)
        with torch.autocast(device_type=self.device.type, dtype=autocast, enabled=autocast is not None):
            out = score(self.model, contexts, continuations,
                        progress=False if disable_tqdm or self.rank != 0 else None, **self.score_options)
        results = out.as_tuples()
        for (key, _, _), answer in zip(requests, results):
            if key is not None:  # loglikelihood_rolling's windows have none (it caches per document)
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """HFLM's generate() call with ``custom_generate=hf_cascade.generate``: the batch's shared prefixes run
        once."""
        generation_kwargs.setdefault("custom_generate", hf_cascade.generate)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main() -> None:
    """lm-eval's command line with ``"hf-cascade"`` registered: ``python -m hf_cascade.eval_harness run ...``."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # registered from the importable module (a class of __main__ would be a second one)
    from hf_cascade.eval_harness import main

    main()
else:
    register_model(MODEL_NAME)(CascadeLM)
