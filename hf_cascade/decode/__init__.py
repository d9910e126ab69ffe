"""The decode engine: how ``hf_cascade.generate`` runs a decode step fast.

* :mod:`~hf_cascade.decode.sampling`: transformers' ``_sample`` loop with the stop flag read a step late.
* :mod:`~hf_cascade.decode.captured_step`: the decode step recorded into a CUDA graph and replayed.

One layer above the cache: they import :mod:`hf_cascade.cache`, :mod:`hf_cascade.compiled_layers` (the decoder
layers compiled once for all layers and layouts, which the prefill runs too), :mod:`hf_cascade.step_context` (the
step's facts, which they set and the cache and the attention read) and :mod:`hf_cascade.step_buffers` (a model's
fixed buffers kept between calls, so recorded graphs replay); nothing below imports them back. Nothing is imported
here.
"""
