"""Triton builds a variant of a kernel per pattern of its int arguments (== 1, divisible by 16): a warm compile
cache helps only the patterns an earlier call launched. The batch layouts users send (suffix lengths, batch rows,
trees, padding) must not change a kernel's pattern beyond a decode step's one query (hf_cascade/ops/_jit.py)."""

import collections
import sys

import pytest
import torch

import hf_cascade
from hf_cascade.model_zoo import tiny_model
from hf_cascade.ops._backend import interpret_mode

from test_generate import pad_batch, tree_prompts

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="captures the Triton launches of the CPU interpreter "
                                "(TRITON_INTERPRET=1, as CI runs)")


class _CapturedKernel:
    """Stands in for a kernel module's jit function: records each launch's int arguments, then launches it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            ints = {name: value for name, value in zip(self.kernel.arg_names, args)
                    if isinstance(value, int) and not isinstance(value, bool)}
            self.launches[self.kernel.fn.__name__].append(ints)
            return launch(*args, **kwargs)

        return run


def test_batch_layouts_launch_one_variant_per_kernel(monkeypatch):
    from hf_cascade.ops import _cascade_kernel, _prefix_kernel, _suffix_kernel

    force_triton = lambda backend, device, op: "torch" if backend == "torch" else "triton"  # noqa: E731
    for name, module in list(sys.modules.items()):
        if name.startswith("hf_cascade.ops") and hasattr(module, "resolve_backend"):
            monkeypatch.setattr(module, "resolve_backend", force_triton)
    launches = collections.defaultdict(list)
    kernels = {}
    for module in (_cascade_kernel, _prefix_kernel, _suffix_kernel):
        for name in ("_cascade_fwd_kernel", "_prefix_fwd_kernel", "_state_combine_kernel", "_suffix_fwd_kernel"):
            if hasattr(module, name):
                kernels[name] = getattr(module, name)
                monkeypatch.setattr(module, name, _CapturedKernel(kernels[name], launches))
    model = tiny_model("llama", "cascade", num_hidden_layers=1)  # GQA: 4 query heads over 2
    layouts = [tree_prompts([(1, 40)], own, rows=rows, seed=own + rows)
               for own, rows in ((8, 4), (40, 4), (64, 4), (64, 7))]
    layouts.append(tree_prompts([(1, 40), (2, 32)], 11, rows=5, seed=3))  # a tree, ragged rows left-padded
    for rows in layouts:
        ids, mask = pad_batch(rows)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, pad_token_id=0,
                       custom_generate=hf_cascade.generate, cascade_options=dict(cost_model=None, min_shared_tokens=2))
    assert launches, "no Triton launch was captured"
    for name, calls in launches.items():
        options = kernels[name].kwargs
        exempt = set(options.get("do_not_specialize") or ()) | set(options.get("do_not_specialize_on_alignment") or ())
        divisible = collections.defaultdict(set)  # arg -> {divisible by 16?} over the launches where it is not 1
        for ints in calls:
            for arg, value in ints.items():
                if value != 1:
                    divisible[arg].add(value % 16 == 0)
        varying = {arg for arg, seen in divisible.items() if len(seen) > 1}
        assert varying <= exempt, (f"{name}: the batch layouts give {sorted(varying - exempt)} both values divisible "
                                   "by 16 and not: a Triton variant each; list them in its jit_options")
