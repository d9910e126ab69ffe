"""Explicit control of the shared prefix (the usual way in is one argument: ``model.generate(**batch,
custom_generate=hf_cascade.generate)``, as in ``examples/few_shot_eval.py`` and the README).

Two explicit ways in:

1. You know the shared prefix (a system prompt): ``CascadeCache.from_prefix(model, prefix_ids)`` prefills it once;
   pass the cache to ``generate(cache=cache)`` (``past_key_values=`` before transformers 5.24: ``CACHE_KWARG`` names
   it) with rows laid out ``[prefix | pads | suffix]``. The same cache serves batch after batch.
2. You have an ordinary tokenized batch: ``shared_prefix_inputs(model, input_ids, attention_mask)`` finds the
   (nested) shared prefixes itself and returns the inputs for ``generate(**inputs)``.

Runs on CPU with a tiny random-init model (no downloads; its text is gibberish), or on a real checkpoint:

    python examples/shared_prefix_generate.py
    python examples/shared_prefix_generate.py --model ./Llama-3.2-1B-Instruct --device cuda --dtype bfloat16
"""

import argparse

import torch

from hf_cascade import CACHE_KWARG, CascadeCache, shared_prefix_inputs
from hf_cascade.tiny import load_model_and_tokenizer, reference_attn_implementation

SYSTEM = (
    "You are a concise assistant for a hardware store. Answer in one short sentence.\n"
    "Store hours: 8am-6pm, closed Sundays. Returns within 30 days with a receipt.\n\n"
)
QUESTIONS = ["Are you open on Sunday?", "Can I return a drill after two weeks?", "When do you open?"]
MORE_QUESTIONS = ["Do you sell paint?", "Is there parking?"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="PATH", help="local checkpoint (default: tiny random-init Llama)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: model's own)")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    # attn_implementation="cascade" (registered by `import hf_cascade`); with a path this is
    # AutoModelForCausalLM.from_pretrained(path, attn_implementation="cascade").
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    # ---- 1. A known prefix: prefill it once, reuse it for every batch ----------------------------------------
    prefix_ids = tokenizer(SYSTEM, return_tensors="pt").input_ids.to(model.device)  # [1, P] (with BOS)
    cache = CascadeCache.from_prefix(model, prefix_ids)

    def prefix_batch(questions):
        # Rows [prefix | pads | suffix]: the prefix columns first, then the left-padded questions. Split prompts
        # where the tokenizer splits anyway (here after a newline) so prefix + suffix tokens = the whole prompt's.
        suffix = tokenizer(questions, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        batch = len(questions)
        input_ids = torch.cat([prefix_ids.expand(batch, -1).cpu(), suffix.input_ids], dim=1).to(model.device)
        attention_mask = torch.cat(
            [torch.ones(batch, prefix_ids.shape[1], dtype=torch.long), suffix.attention_mask], dim=1
        ).to(model.device)
        return input_ids, attention_mask

    print(f"prefix: {prefix_ids.shape[1]} tokens prefilled once; {cache}")
    for questions in (QUESTIONS, MORE_QUESTIONS):  # two batches, one prefill
        input_ids, attention_mask = prefix_batch(questions)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache}, **gen)
        for q, text in zip(questions, tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)):
            print(f"  {q!r} -> {text!r}")
        print(f"  KV held: {cache.nbytes / 2**20:.2f} MiB (prefix once + {len(questions)} suffixes)")

    # ---- 2. An ordinary batch: let hf_cascade find what the rows share ----------------------------------------
    prompts = [SYSTEM + q for q in QUESTIONS + MORE_QUESTIONS]
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    inputs = shared_prefix_inputs(model, batch.input_ids, batch.attention_mask)
    out = model.generate(**inputs, **gen)
    completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"\nshared_prefix_inputs found: {inputs[CACHE_KWARG].prefix_tree.describe()}")

    # Same weights, stock attention: the greedy tokens are the same (exactly so in float32).
    model.set_attn_implementation(reference_attn_implementation(model))  # "sdpa" ("eager" for Gemma2)
    ref = model.generate(**batch, **gen)
    model.set_attn_implementation("cascade")
    same = completions == tokenizer.batch_decode(ref[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    for prompt, text in zip(prompts, completions):
        print(f"  {prompt[len(SYSTEM):]!r} -> {text!r}")
    print(f"identical to plain generate(): {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
