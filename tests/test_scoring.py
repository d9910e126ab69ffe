"""hf_cascade.score == scoring each (context, continuation) pair alone with sdpa (eager for Gemma2), fp32 on CPU.

The pairs look like a multiple-choice evaluation: a few-shot block every question starts with, each question's own
text of odd length, 1 to 3 choices of 0 to 3 tokens each (empty and 1-token continuations included), plus pairs
that share nothing (a 1-token context among them).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf_cascade
from hf_cascade.model_zoo import reference_attention, tiny_model
from hf_cascade.tiny import tiny_model as byte_model
from hf_cascade.tiny import tiny_tokenizer

TOL = 1e-5  # nats: fp32 cascade attention (prefix and suffix merged) vs sdpa differ by rounding only (~2e-6 seen)


def mc_pairs(seed=0, shots=37, questions=7, vocab=128):
    """``(contexts, continuations)`` token lists: [1][few-shot block][question q] x its choices, then 2 loners."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    block = [1] + rand(shots)
    contexts, continuations = [], []
    for q in range(questions):
        context = block + rand(5 + 3 * q)  # odd and even lengths
        for c in range(1 + q % 3):
            contexts.append(context)
            continuations.append(rand((c + q) % 4))  # 0-3 tokens
    contexts += [rand(9), [5]]
    continuations += [rand(3), rand(2)]
    return contexts, continuations


def reference(model, context, continuation):
    """``(sum, is_greedy, [len] per-token log-probs)`` from one sdpa forward over the pair alone."""
    if not continuation:
        return 0.0, True, torch.zeros(0)
    ids = torch.tensor([list(context) + list(continuation)])
    with torch.no_grad():  # the LM head on the continuation positions only
        logits = model(ids[:, :-1], logits_to_keep=len(continuation)).logits[0].float()
    target = torch.tensor(continuation)
    token_lps = F.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
    return float(token_lps.double().sum()), bool((logits.argmax(-1) == target).all()), token_lps


def batched_reference(model, pairs):
    """``[N]`` float64 summed log-probs of the pairs from one right-padded forward (as lm-eval's ``hf`` model); the
    LM head (a Llama's: no soft-capping) on the continuation positions only."""
    rows = [list(c) + list(x) for c, x in pairs]
    ids = torch.zeros((len(rows), max(map(len, rows)) - 1), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row) - 1] = torch.tensor(row[:-1])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        return torch.stack([
            F.log_softmax(model.lm_head(hidden[i, len(c) - 1 : len(c) - 1 + len(x)]).double(), -1)
            .gather(-1, torch.tensor(x)[:, None]).sum() for i, (c, x) in enumerate(pairs)
        ])


def check_against_reference(out, ref_model, contexts, continuations):
    for i, (context, continuation) in enumerate(zip(contexts, continuations)):
        total, greedy, token_lps = reference(ref_model, context, continuation)
        assert abs(out.logprobs[i].item() - total) < TOL, (i, out.logprobs[i].item(), total)
        assert out.is_greedy[i].item() == greedy, i
        if out.token_logprobs is not None:
            assert out.token_logprobs[i].shape == (len(continuation),)
            torch.testing.assert_close(out.token_logprobs[i], token_lps, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])  # GQA; MHA; soft-capped logits (eager reference)
def test_score_matches_pairs_alone(family):
    model, ref = tiny_model(family), tiny_model(family, reference_attention(family))
    contexts, continuations = mc_pairs()
    out = hf_cascade.score(model, contexts, continuations, return_token_logprobs=True)
    check_against_reference(out, ref, contexts, continuations)
    assert out.logprobs.dtype == torch.float64 and out.is_greedy.dtype == torch.bool and len(out) == len(contexts)
    # The block once, each question's context (shared by its choices) once, the rest per row.
    stats = out.stats
    assert stats["shared_tokens"] > 37 and stats["tokens_run"] < stats["tokens_unshared"] / 3
    assert stats["forwards"] == 3  # level 0 (the block), level 1 (the questions), the rows


def test_streaming_small_budget_same_result_and_frees_segments(monkeypatch):
    """A budget of 7 tokens: many forwards, segments prefilled in several batches, and each segment's KV dropped
    after its last chunk (no more than the chunk's segments live at once)."""
    import hf_cascade.scoring as scoring

    model, ref = tiny_model("llama"), tiny_model("llama", "sdpa")
    contexts, continuations = mc_pairs(seed=1)
    live, scorers = [], []
    run = scoring._Scorer.run

    def watched(self, rows):
        scorers.append(self)
        yield from run(self, rows)
        live.append(len(self.resident))

    monkeypatch.setattr(scoring._Scorer, "run", watched)
    out = hf_cascade.score(model, contexts, continuations, max_batch_tokens=7)
    check_against_reference(out, ref, contexts, continuations)
    assert out.stats["forwards"] > 10 and max(live) <= 2 and not scorers[0].resident


def test_duplicates_order_and_input_kinds():
    """Identical pairs scored once, results in the pairs' order; tensors, numpy arrays and tuples accepted."""
    model, ref = tiny_model("llama"), tiny_model("llama", "sdpa")
    contexts, continuations = mc_pairs(seed=2, questions=3)
    order = list(range(len(contexts)))[::-1] + [0, 0]
    ctx = [torch.tensor(contexts[i]) if k % 3 == 0 else np.array(contexts[i]) if k % 3 == 1 else tuple(contexts[i])
           for k, i in enumerate(order)]
    cont = [torch.tensor(continuations[i], dtype=torch.int64) for i in order]
    out = hf_cascade.score(model, ctx, cont)
    check_against_reference(out, ref, [contexts[i] for i in order], [continuations[i] for i in order])
    assert out.stats["unique_pairs"] < len(order)
    assert out.as_tuples()[-1] == (out.logprobs[-1].item(), out.is_greedy[-1].item())


def test_strings_split_like_lm_eval():
    """Strings: the context's trailing space moves to the continuation; context + continuation tokenized whole."""
    model, ref = byte_model("llama"), byte_model("llama", attn_implementation="sdpa")
    tokenizer = tiny_tokenizer()
    prompt = "Q: 2 + 2 = ?\nA: 4\nQ: 3 + 1 = ?\nA: "
    choices = ["4", "5", "four", ""]
    out = hf_cascade.score(model, [prompt] * 4, choices, tokenizer=tokenizer)
    ids = [tokenizer(prompt.rstrip() + " " + c)["input_ids"] for c in choices]
    n = len(tokenizer(prompt.rstrip())["input_ids"])
    check_against_reference(out, ref, [i[:n] for i in ids], [i[n:] for i in ids])
    assert out.logprobs[3] != 0  # " " is still scored


def test_greedy_continuation_detected():
    model = tiny_model("llama")
    context = [1, 40, 41, 42, 43, 44]
    greedy = []
    with torch.no_grad():
        for _ in range(3):
            greedy.append(int(model(torch.tensor([context + greedy])).logits[0, -1].argmax()))
    other = [(greedy[0] + 1) % 128] + greedy[1:]
    out = hf_cascade.score(model, [context] * 3, [greedy, greedy[:1], other])
    assert out.is_greedy.tolist() == [True, True, False]


@pytest.mark.parametrize("contexts, continuations, kwargs, match", [
    ([[1, 2]], [[3], [4]], {}, r"1 contexts and 2 continuations"),
    ([[]], [[3]], {}, r"`contexts\[0\]` is empty.*eos_token_id"),
    ([[1, 2]], [[300]], {}, r"`continuations\[0\]` holds token ids outside the model's vocabulary \[0, 128\)"),
    ([[1, -2]], [[3]], {}, r"`contexts\[0\]` holds token ids outside"),
    ([torch.ones(2, 3, dtype=torch.long)], [[3]], {}, r"`contexts\[0\]` must be a 1-D integer tensor.*shape \(2, 3\)"),
    ([torch.ones(3)], [[3]], {}, r"`contexts\[0\]` must be a 1-D integer tensor of token ids; got torch.float32"),
    ([np.ones(3)], [[3]], {}, r"`contexts\[0\]` must hold integer token ids; got an array of dtype float64"),
    ([[1, 2.5]], [[3]], {}, r"`contexts\[0\]` must be a sequence of int token ids.*list holding other values than ints"),
    ([[1, 2]], [None], {}, r"`continuations\[0\]` must be a sequence of int token ids"),
    (["a b"], ["c"], {}, r"pass `tokenizer=`"),
    (["a b"], [[3]], {}, r"all strings or all token-id sequences"),
    ("abc", ["c"], {}, r"`contexts` must be a list.*`\[context\]`"),
    ([[1, 2]], [[3]], {"max_batch_tokens": 0}, r"`max_batch_tokens` must be a positive int; got 0"),
])
def test_bad_input_raises_valueerror(contexts, continuations, kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        hf_cascade.score(model, contexts, continuations, **kwargs)


def test_model_without_cascade_attention_refused():
    with pytest.raises(ValueError, match="attn_implementation='sdpa'; hf_cascade needs 'cascade'"):
        hf_cascade.score(tiny_model("llama", "sdpa"), [[1, 2]], [[3]])


def test_real_model_multiple_choice(smollm2):
    """SmolLM2-135M-Instruct: a 2-shot block, 3 questions x 4 choices (strings), against each pair alone.

    Over 30 layers sdpa's own fp32 rounding reaches 2e-5 nats (measured against the same pairs in float64), so the
    cascade scores are held to the float64 reference: at most twice sdpa's fp32 error (flash-attention's rule);
    measured: sdpa 2.0e-5, cascade 1.0e-5 from float64, 2.8e-5 apart."""
    model, tokenizer = smollm2
    shots = "Q: What is the capital of France?\nA: Paris\n\nQ: What color is the sky on a clear day?\nA: Blue\n\n"
    questions = ["What is 2 + 3?", "Which animal barks?", "What is the opposite of hot?"]
    choices = [" 5", " 6", " Dog", " Cold"]
    contexts = [f"{shots}Q: {q}\nA:" for q in questions for _ in choices]
    continuations = choices * len(questions)
    out = hf_cascade.score(model, contexts, continuations, tokenizer=tokenizer, return_token_logprobs=True)
    pairs = [hf_cascade.scoring._encode_pair(tokenizer, c, x, True) for c, x in zip(contexts, continuations)]
    model.set_attn_implementation("sdpa")
    try:
        sdpa = torch.tensor([reference(model, c, x)[0] for c, x in pairs], dtype=torch.float64)
        # fp32 -> fp64 -> fp32 is exact: the session's model is unchanged after (nn.Module's own cast: transformers
        # refuses .float() on a GGUF-loaded model)
        torch.nn.Module.double(model)
        exact = batched_reference(model, pairs[: len(choices)])  # the first question's choices (fp64 is slow)
    finally:
        torch.nn.Module.float(model)
        model.set_attn_implementation("cascade")
    first = slice(0, len(choices))
    sdpa_error = (sdpa[first] - exact).abs().max().item()
    assert (out.logprobs[first] - exact).abs().max().item() <= max(2 * sdpa_error, TOL)
    assert (out.logprobs - sdpa).abs().max().item() < 5e-5
    best = out.logprobs.view(len(questions), len(choices)).argmax(-1).tolist()
    assert best == [0, 2, 3]  # " 5", " Dog", " Cold"
    assert out.stats["tokens_run"] < out.stats["tokens_unshared"] / 4


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_many_node_prefix_level_gathered_equals_reference(softcap):
    """The torch path runs a level of many short nodes as one gather (hf_cascade.score's question nodes): the same
    result as the per-node reference, rows without a node and an empty node included."""
    from hf_cascade.ops.plan import _GATHER_MIN_NODES, plan_shared_prefix
    from hf_cascade.ops.prefix_attention import shared_prefix_attention
    from hf_cascade.ops.reference import shared_prefix_attention_ref

    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 0, 5, 7, 1, 9, 4, 6, 2]
    assert len(lengths) >= _GATHER_MIN_NODES
    starts = torch.tensor([0] + lengths).cumsum(0)
    row_node = torch.tensor([0, 1, 1, -1, 3, 4, 5, 6, 6, 7, 8, 9, 2, 0, 4])
    q = torch.randn(len(row_node), 8, 3, 16, generator=g)  # GQA 8/2, 3 query positions
    k, v = torch.randn(2, int(starts[-1]), 16, generator=g), torch.randn(2, int(starts[-1]), 16, generator=g)
    plan = plan_shared_prefix(row_node, starts, device=q.device)
    assert plan.batch_size * plan.max_node_len <= 2 * plan.key_row_pairs  # the gathered path runs
    out, lse = shared_prefix_attention(q, k, v, row_node, starts, scale=0.25, softcap=softcap, plan=plan)
    ref_out, ref_lse = shared_prefix_attention_ref(q, k, v, row_node, starts, scale=0.25, softcap=softcap)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    assert torch.isneginf(lse[3]).all() and torch.isneginf(lse[12]).all() and not out[3].any()
