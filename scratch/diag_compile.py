import sys, torch, traceback
sys.path.insert(0, "tests")
import hf_cascade
from hf_cascade.model_zoo import tiny_model, reference_attention
from transformers import CompileConfig
from test_generate import make_prompts, pad_batch
fam = "llama"
ref = tiny_model(fam, reference_attention(fam), device="cuda")
gen = dict(max_new_tokens=8, pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_logits=True)
configs = {
    "static_eager": None,
    "aot_eager": CompileConfig(backend="aot_eager", mode=None, fullgraph=True),
    "inductor_nocg": CompileConfig(mode=None, fullgraph=True),
    "cudagraphs_backend": CompileConfig(backend="cudagraphs", mode=None, fullgraph=True),
    "reduce_overhead": CompileConfig(fullgraph=True),
}
for name, cc in configs.items():
    torch._dynamo.reset()
    cas = tiny_model(fam, "cascade", device="cuda")
    for seed in (21, 22):
        rows = make_prompts(seed=seed, system=37, block=19, groups=3, per_group=3)
        ids, mask = (t.cuda() for t in pad_batch(rows))
        want = ref.generate(ids, attention_mask=mask, **gen)
        inputs = hf_cascade.shared_prefix_inputs(cas, ids, mask, min_shared_tokens=2, cost_model=None, max_new_tokens=8)
        try:
            kw = dict(disable_compile=True) if cc is None else dict(compile_config=cc)
            got = cas.generate(**inputs, **gen, **kw)
            eq = torch.equal(got.sequences[:, inputs["input_ids"].shape[1]:], want.sequences[:, ids.shape[1]:])
            diffs = [round((g - w).abs().max().item(), 5) for g, w in zip(got.logits, want.logits)]
            print(name, seed, "compiled" if hasattr(cas, "_compiled_call") else "eager", "equal", eq, diffs, flush=True)
        except Exception:
            print(name, seed, "ERROR", traceback.format_exc()[-1500:], flush=True)
