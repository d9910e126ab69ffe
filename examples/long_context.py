"""One long prompt, its KV sharded over N processes, generated with transformers' own generate().

CPU (tiny random model, gloo; `accelerate launch --cpu` would start a single process, so use torchrun):

    torchrun --nproc_per_node 2 examples/long_context.py

GPUs (one process per GPU, NCCL):

    accelerate launch --num_processes 4 examples/long_context.py --model /path/to/Llama-3-8B --prompt-file book.txt
    accelerate launch --num_processes 4 examples/long_context.py --model llama3-8b-shape --prompt-tokens 1048576

(``llama3-8b-shape``: Llama-3-8B's architecture with random bf16 weights, no checkpoint needed: the timings and memory
of the real model, gibberish tokens.)

Every rank prints the same completion (rank 0 prints it, the others check they agree). ``--check`` also runs the
prompt through a plain single-process sdpa generate() on rank 0 and compares (needs the whole prompt's KV on one
device: for small prompts only).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from accelerate import PartialState

import hf_cascade
import hf_cascade.decode.captured_step
from hf_cascade.tiny import load_model_and_tokenizer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local checkpoint, or llama3-8b-shape (random bf16 weights); default a tiny random model")
    p.add_argument("--family", default="llama", help="tiny model family when --model is not given")
    p.add_argument("--prompt-file", default=None, help="text file holding the prompt")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="random prompt length when no --prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--combine", default="all_gather", choices=["all_gather", "tree", "all_to_all", "all_gather_kv"])
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: checkpoint's, fp32 tiny)")
    p.add_argument("--do-sample", action="store_true", help="sample (the same tokens on every rank)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: a rank that fails makes the others fail after this")
    p.add_argument("--check", action="store_true", help="compare with single-process sdpa generate() on rank 0")
    return p.parse_args()


def llama3_8b_shape(device, attn_implementation="cascade"):
    """Llama-3-8B's architecture with random bf16 weights (the same on every rank: one seed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=1 << 21, bos_token_id=128000, eos_token_id=128001)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.bfloat16)
    return model.eval()


def main():
    args = parse_args()
    # The process group: NCCL on GPUs, gloo on CPU. Its timeout bounds how long a rank waits for a failed peer.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(seconds=args.timeout))
    if args.model == "llama3-8b-shape":
        model, tokenizer = llama3_8b_shape(state.device), None
    else:
        model, tokenizer = load_model_and_tokenizer(args.model, family=args.family, device=state.device,
                                                    dtype=args.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
    if args.prompt_file:
        with open(args.prompt_file) as f:
            input_ids = tokenizer(f.read(), return_tensors="pt")["input_ids"]
    else:
        g = torch.Generator().manual_seed(0)  # the same prompt on every rank
        input_ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens), generator=g)
    input_ids = input_ids.to(state.device)

    torch.manual_seed(0)
    start = time.perf_counter()
    inputs = hf_cascade.context_parallel_inputs(model, input_ids, combine=args.combine)
    prefill_s = time.perf_counter() - start
    cache = inputs[hf_cascade.CACHE_KWARG]
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                         pad_token_id=pad_id)
    decode_s = time.perf_counter() - start
    new_tokens = out[:, input_ids.shape[1]:]

    # Every rank must hold the same tokens.
    gathered = [torch.empty_like(new_tokens) for _ in range(state.num_processes)]
    dist.all_gather(gathered, new_tokens)
    agree = all(torch.equal(t, gathered[0]) for t in gathered)
    kv_per_rank = [torch.zeros(1, dtype=torch.long, device=state.device) for _ in range(state.num_processes)]
    dist.all_gather(kv_per_rank, torch.tensor([cache.nbytes], device=state.device))
    if state.is_main_process:
        print(f"{state.num_processes} ranks ({dist.get_backend()}), prompt {input_ids.shape[1]} tokens, "
              f"combine={args.combine}")
        print(f"prefill {prefill_s:.2f} s, generate {new_tokens.shape[1]} tokens {decode_s:.2f} s")
        if torch.cuda.is_available():
            print(f"peak GPU memory on rank 0: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated, "
                  f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")
        graphs = hf_cascade.decode.captured_step.recorded_steps(model)
        print("decode steps: " + (f"replayed from a CUDA graph ({graphs['replayed']} steps, {graphs['recorded']} "
                                   "recorded)" if graphs["recorded"] else "eager"))
        print(f"KV per rank (MiB): {[round(int(t) / 2**20, 2) for t in kv_per_rank]}")
        print(f"all ranks agree: {agree}")
        if tokenizer is not None:
            print("completion:", repr(tokenizer.decode(new_tokens[0], skip_special_tokens=True)))
        else:
            print("completion token ids:", new_tokens[0, :16].tolist(), "...")
    if args.check and state.is_main_process:
        if args.model == "llama3-8b-shape":
            ref = llama3_8b_shape(state.device, "sdpa")
        else:
            ref, _ = load_model_and_tokenizer(args.model, family=args.family, device=state.device, dtype=args.dtype,
                                              attn_implementation="sdpa")
        want = ref.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=args.max_new_tokens, pad_token_id=pad_id)
        same = torch.equal(want[:, input_ids.shape[1]:], new_tokens) if not args.do_sample else None
        print(f"matches single-process sdpa generate(): {same}")
    state.wait_for_everyone()
    if not agree:
        raise SystemExit("ranks disagree")


if __name__ == "__main__":
    main()
