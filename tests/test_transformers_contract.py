"""The transformers surfaces hf_cascade relies on that are not documented extension points, each checked to still
behave as assumed. If transformers changes one, this file fails loudly instead of hf_cascade going silently wrong.

The documented ones (AttentionInterface, AttentionMaskInterface, Cache/CacheLayerMixin, generate(custom_generate=))
are exercised by every generate test; here: the private ones.
"""

import inspect

import torch
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel
from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin, GenerationMode

import hf_cascade
from hf_cascade import CascadeCache
from hf_cascade.transformers_compat import CACHE_KWARG, output_cache

from test_generate import make_prompts, model_pair, pad_batch


def test_generate_marks_a_user_cache_with_is_user_defined():
    """CascadeCache.reset() runs when generate() sets ``cache._is_user_defined = True`` on a cache the user passed
    (so one cache serves several batches, and a second thread's call is detected)."""
    _, cas = model_pair("llama")
    cache = CascadeCache.from_prefix(cas, [5, 6, 7, 8])
    calls = []
    original = CascadeCache._claim
    cache._claim = lambda: (calls.append(1), original(cache))  # instance attribute, this test only
    cas.generate(torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=cache, max_new_tokens=1, pad_token_id=0)
    assert calls == [1] and cache._user_defined


def test_cache_travels_under_the_name_hf_cascade_uses():
    """transformers 5.24 renamed generate()'s cache argument, its model kwarg and its output field from
    ``past_key_values`` to ``cache``. hf_cascade reads and passes ``CACHE_KWARG``: the cache passed under that name
    must be the one generate() fills and returns under it, and the decoding loop must see it in its model kwargs."""
    from transformers import DynamicCache

    sdpa, _ = model_pair("llama")
    cache = DynamicCache(config=sdpa.config)
    out = sdpa.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=2, pad_token_id=0,
                        return_dict_in_generate=True, **{CACHE_KWARG: cache})
    assert CACHE_KWARG in out and out[CACHE_KWARG] is cache and output_cache(out) is cache
    assert cache.get_seq_length() == 6  # 5 prompt tokens + the first new one (the last is never fed back)
    assert CACHE_KWARG in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert CACHE_KWARG in inspect.signature(type(sdpa.model).forward).parameters


def test_decoding_methods_hf_cascade_generate_delegates_to():
    """hf_cascade.generate maps the mode to transformers' own decoding method by GENERATION_MODES_MAPPING."""
    assert GENERATION_MODES_MAPPING[GenerationMode.GREEDY_SEARCH] == "_sample"
    assert GENERATION_MODES_MAPPING[GenerationMode.SAMPLE] == "_sample"
    assert GENERATION_MODES_MAPPING[GenerationMode.BEAM_SEARCH] == "_beam_search"
    assert GENERATION_MODES_MAPPING[GenerationMode.BEAM_SAMPLE] == "_beam_search"
    for name in ("_sample", "_beam_search"):
        params = inspect.signature(getattr(GenerationMixin, name)).parameters
        assert {"input_ids", "logits_processor", "stopping_criteria", "generation_config"} <= set(params)


def test_custom_generate_routes_extra_keyword_arguments():
    """generate() passes the callable's own keyword arguments (cascade_caches, cascade_options) to it, and the rows
    it hands over are already expanded for num_return_sequences."""
    _, cas = model_pair("llama")
    seen = {}

    def probe(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
              cascade_probe=None, **model_kwargs):
        seen.update(rows=input_ids.shape[0], probe=cascade_probe, cache=type(model_kwargs[CACHE_KWARG]).__name__,
                    max_new=generation_config.max_new_tokens)
        return input_ids

    ids, mask = pad_batch(make_prompts(seed=1, groups=1))
    cas.generate(ids, attention_mask=mask, custom_generate=probe, cascade_probe="here", num_return_sequences=3,
                 do_sample=True, max_new_tokens=4, pad_token_id=0)
    assert seen == {"rows": 3 * ids.shape[0], "probe": "here", "cache": "DynamicCache", "max_new": 4}


def test_auto_compile_criteria_fields():
    """hf_cascade.generate sizes fixed buffers where transformers would compile: disable_compile and
    compile_config._compile_all_devices are the fields its criteria read."""
    config = GenerationConfig()
    assert hasattr(config, "disable_compile")
    source = inspect.getsource(GenerationMixin._valid_auto_compile_criteria)
    assert "disable_compile" in source and "_compile_all_devices" in source and "is_compileable" in source


def test_attention_registry_is_readable():
    """`python -m hf_cascade info` reads AttentionInterface._global_mapping to say whether "cascade" is registered."""
    assert "cascade" in AttentionInterface._global_mapping
    assert AttentionInterface._global_mapping["cascade"] is hf_cascade.attention.cascade_attention_forward


def test_sample_loop_hf_cascade_mirrors():
    """hf_cascade.decode.sampling.sample is _sample's loop with the stop flag read a step late: the private methods it
    calls keep their signatures, and _sample still selects, pads and appends tokens as it mirrors (a change here
    means decode/sampling.py must follow; the behaviour itself is compared in test_custom_generate)."""
    for name, params in {
        "_prefill": {"input_ids", "generation_config", "model_kwargs", "is_first_iteration"},
        "_update_model_kwargs_for_generation": {"outputs", "model_kwargs", "is_encoder_decoder"},
        "prepare_inputs_for_generation": {"input_ids", "next_sequence_length"},
        "get_compiled_call": {"compile_config"},
        "_valid_auto_compile_criteria": {"model_kwargs", "generation_config"},
        "_optimize_model_for_decode": set(),
    }.items():
        method = getattr(GenerationMixin, name, None) or getattr(PreTrainedModel, name)
        assert params <= set(inspect.signature(method).parameters), name
    source = inspect.getsource(GenerationMixin._sample)
    for line in (
        "next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)",
        "next_token_scores = logits_processor(input_ids, next_token_logits)",
        "next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)",
        "next_tokens = torch.argmax(next_token_scores, dim=-1)",
        "next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)",
        "input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)",
        "unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)",
    ):
        assert line in source, line
    assert hasattr(GenerationConfig(), "_pad_token_tensor") or "_pad_token_tensor" in source


def test_decode_step_masks_are_built_in_the_decoding_loop():
    """sdpa's mask builder returns None at a decode step without padding, which it decides by reading the padding
    mask on the host (a GPU synchronisation per step); in hf_cascade's decoding loop the "cascade" builder always
    builds the mask instead (all True here), and outside the loop it is sdpa's."""
    from transformers.masking_utils import sdpa_mask

    from hf_cascade.attention import cascade_mask
    from hf_cascade.step_context import step_context

    args = dict(batch_size=2, q_length=1, kv_length=5, q_offset=4, kv_offset=0, attention_mask=torch.ones(2, 5,
                dtype=torch.bool), allow_is_causal_skip=True, device="cpu")
    assert sdpa_mask(**args) is None and cascade_mask(**args) is None
    with step_context(decode_masks=True):
        mask = cascade_mask(**args)
    assert mask.shape == (2, 1, 1, 5) and bool(mask.all())


def test_torch_surfaces_the_compiled_layers_rely_on():
    """hf_cascade.compiled_layers and ops._backend use three torch internals: ``Module._compiled_call_impl`` (what
    ``Module.compile()`` sets and ``Module.__call__`` runs instead of ``_call_impl``), dynamo's
    ``allow_unspec_int_on_nn_module`` config, and Inductor's ``triton_cache_dir``."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    layer = torch.nn.Linear(2, 2)
    calls = []
    layer._compiled_call_impl = lambda *args, **kwargs: calls.append(args) or "compiled"
    try:
        assert layer(torch.ones(2)) == "compiled" and len(calls) == 1
    finally:
        layer._compiled_call_impl = None
    assert isinstance(layer(torch.ones(2)), torch.Tensor)
    assert hasattr(torch._dynamo.config, "allow_unspec_int_on_nn_module")
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        assert torch._dynamo.config.allow_unspec_int_on_nn_module
    assert isinstance(triton_cache_dir(0), str)


def test_triton_and_dynamo_surfaces_the_cold_start_relies_on():
    """ops._backend.warm_triton_key finds Triton's ``triton_key`` (an ``lru_cache`` of one value: the thread's
    result is what a launch reads); share_compiler_kernel_cache's ``triton.knobs`` (3.4+): ``cache.dir`` stands for
    ``TRITON_CACHE_DIR`` and ``propagate_env`` keeps a knob set out of ``os.environ``; and compiled_layers'
    ``dynamic_sources`` regex names the layer index as dynamo's sources spell module attributes (``....layer_idx``).
    Where torch has no ``dynamic_sources`` the patch is a no-op context."""
    import re

    from hf_cascade.compiled_layers import _LAYER_INDEX_SOURCES, _layer_index_symbolic
    from hf_cascade.ops._backend import _triton_key_function, triton_available

    if triton_available():
        key = _triton_key_function()
        assert key is not None and hasattr(key, "cache_info")
        try:
            from triton import knobs
        except ImportError:  # Triton < 3.4: the environment variable is set instead
            knobs = None
        if knobs is not None:
            assert type(knobs.cache).__dict__["dir"].key == "TRITON_CACHE_DIR"
            assert isinstance(knobs.propagate_env, bool)
    assert re.match(_LAYER_INDEX_SOURCES, "L['self']._modules['self_attn'].layer_idx")
    assert not re.match(_LAYER_INDEX_SOURCES, "L['self']._modules['self_attn'].layer_idx_max")
    with _layer_index_symbolic():
        if hasattr(getattr(torch.compiler, "config", None), "dynamic_sources"):
            assert torch.compiler.config.dynamic_sources == _LAYER_INDEX_SOURCES
