"""Can torch's AOT precompile (``torch.compile(fn, fullgraph=True).aot_compile(...)``, ``save_compiled_function``,
``torch.compiler.load_compiled_function``) spare a later process dynamo's tracing of hf_cascade's compiled layers?
(CPU probe, torch >= 2.10; notes in ``benchmarks/notes_aot_precompile.md``.)

Run each mode in its own process, all with the same fresh ``TORCHINDUCTOR_CACHE_DIR``:

* ``--mode save``: process A. AOT-compiles and saves the artifact(s) to ``--dir``.
* ``--mode load``: process B. Loads the artifact(s) and runs (no dynamo tracing, no torch.compile call).
* ``--mode compile``: process C. Plain ``torch.compile`` (run twice: the first warms the caches, the second is
  the warm-cache number to compare B with).

``--case layer``: decoder layer 0 of ``tiny_model("llama", "cascade", num_hidden_layers=2)`` called as transformers
calls it in a decode step (its args captured by a forward pre-hook; a ``DynamicCache``; sdpa, no hf_cascade
cache), ``layer._call_impl`` compiled; the output is checked against eager. ``--case prefill``: hf_cascade's real
compiled-layers path on CPU, ``generate(custom_generate=hf_cascade.generate, cascade_options=
{"compile_prefill": True, ...})`` (the prefill forwards with ``compiled_layers(dynamic=True)``; the decode step's
compiled layers are CUDA-only). For save/load the model's ``_LayerCalls.dynamic_calls`` are set beforehand to
wrappers that call the AOT function(s) with the layer as first argument (one artifact per graph, shared by the
layers); ``compile`` leaves them to compiled_layers. Tokens are checked against eager generate().

    TORCHINDUCTOR_CACHE_DIR=/tmp/x python benchmarks/probes/probe_aot_precompile.py --case layer --mode save
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import time

T0 = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter() - T0


def layer_inputs(model):
    """Decoder layer 0's (args, kwargs) in a decode step of ``model`` (batch 2, 8 tokens of prompt)."""
    layer, captured = model.model.layers[0], {}
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        hook = layer.register_forward_pre_hook(lambda mod, a, k: captured.setdefault("x", (a, dict(k))),
                                               with_kwargs=True)
        model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        hook.remove()
    return captured["x"]


def run_layer(args, timings, result):
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", "cascade", num_hidden_layers=2)
    layer = model.model.layers[0]
    a, kw = layer_inputs(model)
    with torch.no_grad():
        want = layer._call_impl(*a, **copy.deepcopy(kw))
    path = os.path.join(args.dir, "layer.bin")
    t = time.perf_counter()
    with torch.no_grad():
        if args.mode == "save":
            fn = torch.compile(layer._call_impl, fullgraph=True).aot_compile((a, copy.deepcopy(kw)))
            timings["aot_compile_s"] = time.perf_counter() - t
            t1 = time.perf_counter()
            fn.save_compiled_function(path)
            timings["save_s"] = time.perf_counter() - t1
            call = lambda *x, **k: fn(layer, *x, **k)  # noqa: E731 (the traced fn is the unbound _call_impl)
        elif args.mode == "load":
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            timings["load_s"] = time.perf_counter() - t
            call = lambda *x, **k: fn(layer, *x, **k)  # noqa: E731
        else:
            call = torch.compile(layer._call_impl, fullgraph=True)
        t1 = time.perf_counter()
        got = call(*a, **copy.deepcopy(kw))
        timings["first_call_s"] = time.perf_counter() - t1
        timings["compile_or_load_plus_first_call_s"] = time.perf_counter() - t
        t1 = time.perf_counter()
        call(*a, **copy.deepcopy(kw))
        timings["second_call_s"] = time.perf_counter() - t1
        # the other layer through the same artifact / wrapper
        other = model.model.layers[1]
        if args.mode == "compile":
            other_call = torch.compile(other._call_impl, fullgraph=True)
        else:
            other_call = lambda *x, **k: fn(other, *x, **k)  # noqa: E731
        try:
            other_call(*a, **copy.deepcopy(kw))
            result["layer1_same_artifact"] = "ok"
        except Exception as err:  # noqa: BLE001
            result["layer1_same_artifact"] = f"{type(err).__name__}: {str(err)[:300]}"
    result["max_abs_diff"] = (got[0] if isinstance(got, tuple) else got).sub(
        want[0] if isinstance(want, tuple) else want).abs().max().item()


def prompts():
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 120, (12,), generator=g)
    rows = [torch.cat([prefix, torch.randint(3, 120, (n,), generator=g)]) for n in (3, 5, 4)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def picklable_cache():
    """What dynamo's guard serialisation needs of hf_cascade (torch 2.13): the cache, a local of the traced frame,
    is pickled into the guards state, and a ``CascadeCache`` holds a ``threading.Lock`` (``TypeError: cannot
    pickle '_thread.lock' object``) and weak sets. Patched here (not in hf_cascade): its state without them."""
    from hf_cascade.cache import CascadeCache
    from hf_cascade.step_buffers import StepBuffers

    unpicklable = ("_lock", "_modules", "_step_buffers")

    def getstate(self):
        return {k: v for k, v in self.__dict__.items() if k not in unpicklable}

    CascadeCache.__getstate__ = getstate
    StepBuffers.__getstate__ = getstate  # (a cache layer's step_buffers holds a lock too)


class AOTLayers:
    """The prefill's compiled layer calls served by AOT-compiled functions (save: compiled on a guard miss and
    saved; load: loaded from disk, a guard miss is an error)."""

    def __init__(self, model, mode, directory, timings):
        self.mode, self.dir, self.timings, self.fns = mode, directory, timings, []
        self.errors, self.trust_marks = [], False
        if mode == "load":
            t = time.perf_counter()
            for path in sorted(glob.glob(os.path.join(directory, "prefill_*.bin"))):
                with open(path, "rb") as f:
                    self.fns.append(torch.compiler.load_compiled_function(f))
            timings["load_s"] = time.perf_counter() - t
            timings["artifacts"] = len(self.fns)

    def for_layer(self, layer):
        def call(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except Exception as err:  # compiled_forward takes a non-dynamo error back silently: keep it
                import traceback
                self.errors.append(f"{type(err).__name__}: {str(err)[:1500]} | " + " < ".join(
                    f"{fr.name}:{os.path.basename(fr.filename)}:{fr.lineno}" for fr in traceback.extract_tb(err.__traceback__)[-6:]))
                raise

        def inner(*args, **kwargs):
            for fn in self.fns:
                if fn.guard_check(layer, *args, **kwargs):
                    return fn(layer, *args, **kwargs)
            if self.mode == "load" and self.trust_marks:
                # UNSAFE (a measurement aid): the first artifact whose first failing guard is only the lost dim marks
                for fn in self.fns:
                    reason = str(fn._artifacts.guard_manager.check_verbose(
                        fn.prepare_f_locals(layer, *args, **kwargs)).verbose_code_parts)
                    if "_has_dynamo_dim_marking is present" in reason:
                        self.timings["trusted_calls"] = self.timings.get("trusted_calls", 0) + 1
                        return fn._artifacts and fn.fn(layer, *args, **kwargs)
            if self.mode == "load":
                reasons = [str(fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(layer, *args, **kwargs))
                               .verbose_code_parts)[:400] for fn in self.fns]
                raise RuntimeError(f"no loaded artifact's guards pass: {reasons}")
            t = time.perf_counter()
            fn = torch.compile(layer._call_impl, fullgraph=True).aot_compile((args, kwargs))
            fn.save_compiled_function(os.path.join(self.dir, f"prefill_{len(self.fns)}.bin"))
            self.timings.setdefault("aot_compile_and_save_s", []).append(round(time.perf_counter() - t, 3))
            self.fns.append(fn)
            return fn(layer, *args, **kwargs)

        return call


def run_prefill(args, timings, result):
    import hf_cascade
    from hf_cascade.compiled_layers import _VARYING_DIMS, _with_symbolic_dims, compiled_prefills
    from hf_cascade.compiled_layers import layer_calls
    from hf_cascade.model_zoo import tiny_model

    model = tiny_model("llama", "cascade", num_hidden_layers=2)
    ids, mask = prompts()
    gen = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False, disable_compile=True)
    options = dict(min_shared_tokens=2, cost_model=None, fixed_buffers=True, compile_prefill=True)
    if args.mode in ("save", "load"):
        if args.picklable_cache:
            picklable_cache()
        aot = AOTLayers(model, args.mode, args.dir, timings)
        aot.trust_marks = args.trust_marks
        # load: the inputs left unmarked (a loaded artifact's guards say "_has_dynamo_dim_marking is present on
        # runtime tensor but was absent at compile time" for marked inputs: the marks are not in the saved guards)
        mark = (lambda call: _with_symbolic_dims(call, _VARYING_DIMS)) if args.mode == "save" or args.mark_on_load else (lambda call: call)
        layer_calls(model).dynamic_calls = [mark(aot.for_layer(layer)) for layer in model.model.layers]
    for i in range(2):
        t = time.perf_counter()
        got = model.generate(ids, attention_mask=mask, custom_generate=hf_cascade.generate,
                             cascade_options=options, **gen)
        timings[f"generate_{i}_s"] = time.perf_counter() - t
    result["compiled_prefills"] = compiled_prefills(model)
    if args.mode in ("save", "load"):
        result["errors"] = aot.errors[:3]
    want = model.generate(ids, attention_mask=mask, **gen)
    result["tokens_equal_eager"] = bool(torch.equal(got, want))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["layer", "prefill"], default="layer")
    parser.add_argument("--mode", choices=["save", "load", "compile"], required=True)
    parser.add_argument("--picklable-cache", action="store_true", help="patch CascadeCache.__getstate__ "
                        "(drops its lock and weak sets, StepBuffers' lock) so that dynamo can pickle the guards state")
    parser.add_argument("--mark-on-load", action="store_true", help="load: mark the inputs' dims dynamic as "
                        "compiled_layers does (their guards then fail)")
    parser.add_argument("--trust-marks", action="store_true", help="load, UNSAFE: run an artifact whose guards "
                        "fail on the dim marks alone, without checking its other guards")
    parser.add_argument("--dir", default="/tmp/aot_precompile")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    t = time.perf_counter()
    import transformers  # noqa: F401

    import hf_cascade  # noqa: F401
    timings = {"import_torch_s": T_TORCH, "import_rest_s": time.perf_counter() - t}
    result = {"case": args.case, "mode": args.mode, "torch": torch.__version__, "timings": timings}
    try:
        (run_layer if args.case == "layer" else run_prefill)(args, timings, result)
    except Exception as err:  # noqa: BLE001
        result["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
    timings["process_s"] = time.perf_counter() - T0
    for key, value in timings.items():
        if isinstance(value, float):
            timings[key] = round(value, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
