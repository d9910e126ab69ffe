"""A TRL GRPO rollout, reproduced without TRL: its default transformers path, its paged path, and hf_cascade's route
(issue 51). TRL is not needed (the device machine has none); where it is importable, ``tests/test_cb_peer.py``
checks that :func:`trl_generation_config` equals the config a ``GRPOTrainer`` builds.

What TRL 1.16.0's ``GRPOTrainer`` does (``trl/trainer/grpo_trainer.py``):

* ``__init__``, lines 1154-1175 (neither vLLM nor anything else set): ``generation_kwargs = {"max_new_tokens":
  max_completion_length, "do_sample": True, "pad_token_id": tokenizer.pad_token_id, "bos_token_id":
  tokenizer.bos_token_id, "eos_token_id": self.eos_token_ids, "temperature", "top_p", "top_k", "min_p",
  "repetition_penalty", "cache_implementation"}`` (GRPOConfig's defaults: 1.0, 1.0, 0, None, 1.0, None), updated with
  ``args.generation_kwargs``; ``self.generation_config = GenerationConfig(**generation_kwargs, disable_compile=True)``.
  ``self.eos_token_ids`` (lines 409-416): the model's ``generation_config.eos_token_id`` as a list, with the
  tokenizer's eos first where it is missing.
* The batch of a step: the ``RepeatSampler`` yields each prompt ``num_generations`` times in a row; one rollout call
  takes them all (``_generate_single_turn``).
* Default path (lines 1813-1888): the prompts' token lists left-padded with the pad token (``pad(...,
  padding_side="left")``), then under ``torch.no_grad()``: ``unwrapped_model.generate(**generate_inputs,
  generation_config=self.generation_config)``; completions cut after the first eos.
* Paged path (``use_transformers_continuous_batching=True``, lines 795-807 and 1784-1811): ``unwrapped_model.
  generate_batch(prompt_ids, generation_config=self.generation_config, continuous_batching_config=
  ContinuousBatchingConfig(max_memory_percent=0.5, **args.transformers_continuous_batching_config),
  progress_bar=False)`` on the unpadded token lists.
* hf_cascade (``docs/trl.md``): ``hf_cascade.write_custom_generate(folder)`` + ``GRPOConfig(trust_remote_code=True)``;
  TRL's ``unwrapped_model.generate(...)`` is then the folder's ``custom_generate/generate.py``, i.e.
  :func:`hf_cascade.checkpoint.checkpoint_generate` with the same arguments, which this module calls directly.

All three run the model in its own dtype, outside autocast (``GRPOConfig(bf16=False)`` with a bf16 or fp32 model; TRL's
default ``bf16=True`` autocasts an fp32 model, which hf_cascade refuses: ``docs/trl.md``).

    python benchmarks/trl_rollout.py --tiny          # CPU, fp32: hf_cascade's rollout == the default path's
    python benchmarks/trl_rollout.py --output x.jsonl  # GPU: Qwen2.5-1.5B shape, bf16, 16 prompts x 8 x 256 new
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cb_peer  # noqa: E402

# Qwen2.5-1.5B(-Instruct)'s shape and special tokens (pad <|endoftext|>, eos <|im_end|>, no bos); "tiny" for CPU tests.
SHAPES = {
    "qwen2.5-1.5b": dict(config=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                     num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                     tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                                     rms_norm_eps=1e-6),
                         pad=151643, bos=None, tokenizer_eos=151645, model_eos=[151645, 151643], normal_tokens=151643),
    "tiny": dict(config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=300, tie_word_embeddings=True,
                             max_position_embeddings=2048, initializer_range=0.1),
                 pad=297, bos=None, tokenizer_eos=298, model_eos=[298, 297], normal_tokens=297),
}
PEERS = ("trl_default", "trl_paged", "trl_hf_cascade")


def trl_version() -> str | None:
    try:
        import trl
    except Exception:  # noqa: BLE001 (not installed, or broken)
        return None
    return trl.__version__


def build_model(shape: str = "qwen2.5-1.5b", device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """A random-init Qwen2 model of ``shape`` with sdpa (what ``from_pretrained`` loads), its generation config's
    eos the checkpoint's."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = SHAPES[shape]
    config = Qwen2Config(**spec["config"], pad_token_id=spec["pad"], eos_token_id=spec["model_eos"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = list(spec["model_eos"])
    model.generation_config.pad_token_id = spec["pad"]
    return model.eval()


def make_prompts(shape: str, prompts: int = 16, system: int = 128, own=(64, 320), seed: int = 51) -> list[list[int]]:
    """``prompts`` distinct prompts: a ``system``-token system prompt shared by all, then own tokens of lengths
    spread over ``own`` (GRPO prompts differ in length: left padding as TRL's)."""
    g = torch.Generator().manual_seed(seed)
    top = SHAPES[shape]["normal_tokens"]
    head = torch.randint(3, top, (system,), generator=g).tolist()
    lengths = torch.linspace(own[0], own[1], prompts).round().long().tolist()
    return [head + torch.randint(3, top, (n,), generator=g).tolist() for n in lengths]


def trl_eos_token_ids(shape: str) -> list[int]:
    """``GRPOTrainer.eos_token_ids`` (lines 409-416)."""
    spec = SHAPES[shape]
    eos = list(spec["model_eos"])
    return eos if spec["tokenizer_eos"] in eos else [spec["tokenizer_eos"], *eos]


def trl_generation_kwargs(shape: str, max_completion_length: int, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                          repetition_penalty=1.0, cache_implementation=None, generation_kwargs=None) -> dict:
    """``GRPOTrainer``'s ``generation_kwargs`` (lines 1155-1172), GRPOConfig's defaults as the defaults."""
    spec = SHAPES[shape]
    kwargs = {"max_new_tokens": max_completion_length, "do_sample": True, "pad_token_id": spec["pad"],
              "bos_token_id": spec["bos"], "eos_token_id": trl_eos_token_ids(shape), "temperature": temperature,
              "top_p": top_p, "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
              "cache_implementation": cache_implementation}
    kwargs.update(generation_kwargs or {})
    return kwargs


def trl_generation_config(shape: str, max_completion_length: int, **overrides):
    """``GenerationConfig(**generation_kwargs, disable_compile=True)`` (line 1173)."""
    from transformers import GenerationConfig

    return GenerationConfig(**trl_generation_kwargs(shape, max_completion_length, **overrides), disable_compile=True)


def left_pad(prompt_ids: list[list[int]], pad: int, device) -> dict:
    """TRL's ``pad(..., padding_side="left")`` of the token lists and of their ones (the attention mask)."""
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, row in enumerate(prompt_ids):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def cut_after_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """TRL's completion mask: every token up to and including the first eos (lines 1880-1889)."""
    out = []
    for row in completion_ids.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), len(row) - 1)
        out.append(row[: end + 1])
    return out


def rollout_default(model, prompt_ids, generation_config) -> list[list[int]]:
    """TRL's default path: ``model.generate(**left-padded inputs, generation_config=...)`` (sdpa, as loaded)."""
    model.set_attn_implementation("sdpa")
    inputs = left_pad(prompt_ids, generation_config.pad_token_id, model.device)
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=generation_config)
    return cut_after_eos(out[:, inputs["input_ids"].shape[1]:], generation_config.eos_token_id)


def rollout_cascade(model, prompt_ids, generation_config, caches: list | None = None,
                    cascade_options: dict | None = None) -> list[list[int]]:
    """The same call where the checkpoint folder has hf_cascade's ``custom_generate/generate.py`` and TRL loads it
    with ``trust_remote_code=True``: ``checkpoint_generate(model, **inputs, generation_config=...)``. ``caches``
    (optional): receives the CascadeCache built (an observer list; TRL passes none). ``cascade_options``: for probes
    only (TRL passes none), e.g. ``{"max_levels": 1}``."""
    from hf_cascade.checkpoint import checkpoint_generate

    inputs = left_pad(prompt_ids, generation_config.pad_token_id, model.device)
    extra = {} if caches is None else {"cascade_caches": caches}
    if cascade_options:
        extra["cascade_options"] = cascade_options
    with torch.no_grad():
        out = checkpoint_generate(model, **inputs, generation_config=generation_config, **extra)
    model.set_attn_implementation("sdpa")
    return cut_after_eos(out[:, inputs["input_ids"].shape[1]:], generation_config.eos_token_id)


def rollout_paged(model, prompt_ids, generation_config, cb_settings: dict | None = None, observer=None):
    """TRL's paged path: ``generate_batch(prompt_ids, generation_config=..., continuous_batching_config=
    ContinuousBatchingConfig(max_memory_percent=0.5, ...), progress_bar=False)``. Returns the completions (the
    generated tokens, which stop at an eos) or raises where requests failed."""
    from transformers.generation import ContinuousBatchingConfig

    settings = {"max_memory_percent": 0.5, **(cb_settings or {})}
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        outputs = model.generate_batch(prompt_ids, generation_config=generation_config,
                                       continuous_batching_config=ContinuousBatchingConfig(**settings),
                                       progress_bar=False)
    tokens, problem = cb_peer._outputs(outputs, prompt_ids)
    if problem:
        raise RuntimeError(problem)
    return tokens


def _kv_gib(model, prompt_ids, new_tokens: int) -> float:
    """generate()'s DynamicCache at the end: every row, padded prompt + new tokens, K and V of every layer."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    return len(prompt_ids) * (max(map(len, prompt_ids)) + new_tokens - 1) * per_token / 2**30


def _last_tier(model) -> str | None:
    """The tier hf_cascade's last call ran on (``hf_cascade.tiers.tier_report``), or None."""
    from hf_cascade.tiers import tier_report

    calls = tier_report(model)["calls"]
    return calls[-1][0] if calls else None


def time_peer(model, peer: str, prompt_ids, generation_config, calls: int = 2, seed: int = 0,
              cb_settings: dict | None = None) -> dict:
    """``calls`` rollouts of ``peer`` (each after ``torch.manual_seed(seed)``): ``calls_s``, ``first_call_s``,
    ``total_s`` (the last), ``peak_gib``, KV, completion lengths, ``status``; ``completions`` (the last call's) for
    the caller to pop. ``cb_settings``: the paged path's ``transformers_continuous_batching_config``."""
    record = {"bench": "trl_rollout", "peer": peer, "rows": len(prompt_ids), "calls": calls}
    calls_s, completions, caches, observer = [], None, [], None
    call_tiers, call_levels = [], []  # hf_cascade: each call's tier and its tree's levels
    try:
        for _ in range(calls):
            cb_peer._reset_memory()
            caches.clear()
            torch.manual_seed(seed)
            if peer == "trl_default":
                seconds, completions = cb_peer._timed(lambda: rollout_default(model, prompt_ids, generation_config))
            elif peer == "trl_hf_cascade":
                seconds, completions = cb_peer._timed(lambda: rollout_cascade(
                    model, prompt_ids, generation_config, caches))
            else:
                with cb_peer.PagedCacheObserver(model) as observer:
                    seconds, completions = cb_peer._timed(lambda: rollout_paged(
                        model, prompt_ids, generation_config, cb_settings))
            calls_s.append(seconds)
            if peer == "trl_hf_cascade":
                call_tiers.append(_last_tier(model))
                call_levels.append(caches[-1].num_levels if caches else None)
            record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        record["status"] = "ok"
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    except Exception as err:  # noqa: BLE001 (one path failing must not hide the others)
        record["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
    finally:
        model.set_attn_implementation("sdpa")
        cb_peer._reset_memory()
    if calls_s:
        record.update(calls_s=[round(s, 4) for s in calls_s], first_call_s=calls_s[0], total_s=calls_s[-1])
    new_tokens = generation_config.max_new_tokens
    if peer == "trl_default":
        record["kv_gib"] = _kv_gib(model, prompt_ids, new_tokens)
    elif caches:
        record.update(kv_gib=caches[-1].nbytes / 2**30, levels=caches[-1].num_levels,
                      prefix_tree=caches[-1].prefix_tree.describe(), call_tiers=call_tiers,
                      call_levels=call_levels)
    elif observer is not None:
        record.update(observer.summary(), settings={"max_memory_percent": 0.5, **(cb_settings or {})})
        record["kv_gib"] = record["kv_used_peak_gib"]
    if completions:
        record["completion_tokens"] = sum(map(len, completions))
    record["completions"] = completions
    return record


def run_rollouts(model, shape: str, prompts: list[list[int]], num_generations: int, max_completion_length: int,
                 peers=PEERS, calls: int | dict = 2, seed: int = 0, cb_settings: dict | None = None,
                 on_record=None) -> list[dict]:
    """One GRPO step's rollout, ``prompts`` x ``num_generations`` rows (each prompt's rows in a row, as TRL's
    sampler gives them), through each of ``peers`` (``calls`` each, or ``calls[peer]``); the records (completions
    popped) with the workload and the generation config, and whether each peer's completions equal the default
    path's (same seed; exact in fp32, bf16 roundings differ; the paged path has a sampler of its own).
    ``on_record(record)``: called with each record as soon as its peer is done."""
    prompt_ids = [p for p in prompts for _ in range(num_generations)]
    config = trl_generation_config(shape, max_completion_length)
    workload = {"workload": "trl_grpo_rollout", "shape": shape, "dtype": str(model.dtype).replace("torch.", ""),
                "prompts": len(prompts), "num_generations": num_generations,
                "max_completion_length": max_completion_length, "prompt_lengths": [len(p) for p in prompts],
                "generation_config": config.to_diff_dict(), "trl": trl_version(), "seed": seed,
                "autocast": False}
    records, reference = [], None
    for peer in peers:
        n = calls.get(peer, 1) if isinstance(calls, dict) else calls
        record = {**time_peer(model, peer, prompt_ids, config, n, seed, cb_settings), **workload}
        completions = record.pop("completions")
        if peer == "trl_default":
            reference = completions
        elif reference is not None and completions is not None:
            record["completions_equal_default"] = completions == reference
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def tiny_check(device: str = "cpu", seed: int = 1) -> dict:
    """fp32, a tiny Qwen2: 3 prompts x 4 generations x 8 new tokens, sampling: hf_cascade's rollout equals TRL's
    default path's with the same seed (``passed``); the paged path runs (its own sampler: not compared)."""
    model = build_model("tiny", device=device, dtype=torch.float32)
    prompts = make_prompts("tiny", prompts=3, system=24, own=(6, 14))
    records = run_rollouts(model, "tiny", prompts, num_generations=4, max_completion_length=8, calls=1, seed=seed,
                           cb_settings={"num_blocks": 64})  # a small pool (the default: half the free memory)
    by_peer = {r["peer"]: r for r in records}
    passed = all(r["status"] == "ok" for r in records) and by_peer["trl_hf_cascade"].get("completions_equal_default")
    return {"bench": "trl_rollout_check", "device": device, "dtype": "float32", "passed": bool(passed),
            "statuses": {p: r["status"] for p, r in by_peer.items()},
            "hf_cascade_levels": by_peer["trl_hf_cascade"].get("levels")}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the fp32 equality check on a tiny model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2, help="rollouts per peer")
    parser.add_argument("--paged-calls", type=int, default=None,
                        help="rollouts of trl_paged where it differs from --calls (its call is the longest)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--output", default=None, help="append the records (JSON lines) to this file")
    args = parser.parse_args(argv)
    writer = None
    if args.output:
        from common import ResultWriter

        writer = ResultWriter(os.path.basename(args.output), args.output)
    if args.tiny:
        records = [tiny_check(args.device)]
        if writer is not None:
            writer.write(records[0])
    else:  # each peer's record written as soon as it is done: a later peer's failure loses nothing
        model = build_model(device=args.device)
        records = run_rollouts(model, "qwen2.5-1.5b", make_prompts("qwen2.5-1.5b", args.prompts), args.num_generations,
                               args.max_completion_length, args.peers,
                               {peer: args.paged_calls if peer == "trl_paged" and args.paged_calls else args.calls
                                for peer in args.peers},
                               on_record=None if writer is None else writer.write)
    for record in records:
        print(json.dumps({k: v for k, v in record.items() if k not in ("generation_config", "prompt_lengths")}))
    return records


if __name__ == "__main__":
    main()
