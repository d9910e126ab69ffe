"""``hf_cascade.score``: log-likelihoods of many continuations of shared contexts, each shared prefix run once.

What multiple-choice evaluation, reranking and reference-model log-probs need: for pairs ``(context_i,
continuation_i)``, the summed log-probability of ``continuation_i`` given ``context_i``, and whether it is the
greedy continuation (lm-evaluation-harness's ``loglikelihood``). Scored one pair per forward, as lm-eval's ``hf``
model does, a 5-shot block is run again for every question and every choice; here the pairs are planned as one
prefix tree (:func:`~hf_cascade.prefix_tree.find_shared_prefixes` over the contexts):

* the shared segments (the few-shot block every question starts with, then each question's context, which its
  choices share) are prefilled once each (:func:`~hf_cascade.prefill.prefill_levels`), level by level;
* every row then runs only its own tokens (the last context token and the continuation but its last token) in
  batched forwards whose attention reads the shared segments through a :class:`~hf_cascade.cache.CascadeCache`;
  only the continuation positions go through the LM head.

Streaming. The rows are sorted by their tokens, so the rows under a shared segment are consecutive; they run in
chunks of at most ``max_batch_tokens`` query tokens (padding included), and a segment's KV is computed when the
first chunk that needs it starts and dropped after the last one: memory is bounded by the budget and the
segments one chunk reads, however long the list.

The last context token is never shared: its logits predict the first continuation token.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_cascade.attention import check_model_uses_cascade
from hf_cascade.cache import CascadeCache
from hf_cascade.attention import unshareable_model
from hf_cascade.model_scan import rope_limit
from hf_cascade.prefill import PrefixLevel, prefill_levels, window_layout
from hf_cascade.prefix_tree import PrefixTree, find_shared_prefixes
from hf_cascade.transformers_compat import CACHE_KWARG

DEFAULT_MAX_BATCH_TOKENS = 4096  # query tokens per forward (padding included); a row or segment longer runs alone


@dataclass
class ScoreOutput:
    """What :func:`score` returns, in the order of the pairs given.

    Attributes:
        logprobs: ``[N]`` float64 (CPU): each continuation's summed log-probability in nats (0 for an empty one).
            The per-token log-probabilities are computed in float32 and summed in float64.
        is_greedy: ``[N]`` bool (CPU): every continuation token is the argmax of its logits (True for an empty one).
        token_logprobs: with ``return_token_logprobs=True``, one ``[len(continuation_i)]`` float32 CPU tensor per
            pair; else None.
        stats: ``{"pairs", "unique_pairs", "forwards", "tokens_run", "tokens_unshared", "shared_tokens"}``:
            ``tokens_run`` counts the real tokens run through the model (shared segments once each, plus every
            row's own tokens); ``tokens_unshared`` the tokens one forward per unique pair would run
            (``len(context) + len(continuation) - 1`` each).
    """

    logprobs: torch.Tensor
    is_greedy: torch.Tensor
    token_logprobs: list[torch.Tensor] | None
    stats: dict

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def as_tuples(self) -> list[tuple[float, bool]]:
        """``[(logprob, is_greedy), ...]``: the form lm-evaluation-harness's ``loglikelihood`` returns."""
        return list(zip(self.logprobs.tolist(), self.is_greedy.tolist()))


def score(
    model: torch.nn.Module,
    contexts: Sequence,
    continuations: Sequence,
    *,
    tokenizer=None,
    add_special_tokens: bool = True,
    return_token_logprobs: bool = False,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    min_shared_tokens: int = 4,
    max_levels: int = 4,
    progress: bool | None = None,
) -> ScoreOutput:
    """Score ``continuations[i]`` given ``contexts[i]`` for every ``i``; shared prefixes are run once.

    Args:
        model: a causal LM loaded with ``attn_implementation="cascade"`` (after ``import hf_cascade``), in eval mode.
        contexts: N contexts: token-id sequences (lists/tuples of ints, 1-D integer tensors or numpy arrays), or
            strings with ``tokenizer``. A context needs at least one token (its last token's logits predict the
            first continuation token): lm-eval prepends the EOS token to an empty one.
        continuations: N continuations, of the same kind; an empty one scores 0 and is greedy.
        tokenizer: needed for strings. As lm-eval's ``HFLM`` does: trailing whitespace of the context moves to the
            continuation; the context is its own tokens, the continuation the tokens of ``context + continuation``
            after as many (a continuation left with none is a ValueError).
        add_special_tokens: passed to the tokenizer (strings only): e.g. a BOS token before each context.
        return_token_logprobs: also return each continuation token's log-probability.
        max_batch_tokens: most query tokens one forward runs (rows x padded width, for the rows' forwards and for
            each batch of shared segments); bounds activation memory. A single row or segment longer than this runs
            alone. The LM head runs only on continuation positions: ``rows x longest continuation x vocab`` logits.
        min_shared_tokens: shortest shared segment stored once (shorter runs stay in the rows' own tokens).
        max_levels: deepest nesting of shared segments (few-shot block -> question -> ...).
        progress: a tqdm bar over the pairs; None: shown when the pairs need more than one forward.
    Returns:
        :class:`ScoreOutput` (``logprobs`` ``[N]`` float64, ``is_greedy`` ``[N]`` bool, optional per-token
        ``token_logprobs``), in the order of the pairs.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="cascade")
        out = hf_cascade.score(model, [prompt] * 4, [" A", " B", " C", " D"], tokenizer=tokenizer)
        best = int(out.logprobs.argmax())
    """
    check_model_uses_cascade(model)
    _check_options(add_special_tokens=add_special_tokens, return_token_logprobs=return_token_logprobs,
                   max_batch_tokens=max_batch_tokens, min_shared_tokens=min_shared_tokens, max_levels=max_levels,
                   progress=progress)
    if torch.is_autocast_enabled(model.device.type):
        raise ValueError(
            "hf_cascade.score runs under torch.autocast here (lm-eval's `mixed_precision_dtype` sets it): the model's "
            "keys and values then reach the attention in different dtypes, which cascade attention does not mix. "
            "Load the model in that dtype instead (`torch_dtype=torch.bfloat16`; lm-eval: `dtype=bfloat16`)."
        )
    pairs = _token_pairs(model, contexts, continuations, tokenizer, add_special_tokens)
    n = len(pairs)
    index = {}  # identical pairs are scored once
    owner = [index.setdefault(pair, len(index)) for pair in pairs]
    unique = list(index)
    token_lps: list[torch.Tensor | None] = [None] * len(unique)
    greedy = [True] * len(unique)
    scored = [u for u, (_, cont) in enumerate(unique) if cont]
    for u, (_, cont) in enumerate(unique):
        if not cont:
            token_lps[u] = torch.zeros(0, dtype=torch.float32)
    stats = {"pairs": n, "unique_pairs": len(unique), "forwards": 0, "tokens_run": 0, "shared_tokens": 0,
             "tokens_unshared": sum(len(unique[u][0]) + len(unique[u][1]) - 1 for u in scored)}
    limit = rope_limit(model)
    if unshareable_model(model) or _positions_from_pad_id(model) or (
            limit is not None and any(len(unique[u][0]) + len(unique[u][1]) > limit for u in scored)):
        # Attention that is not causal over the prompt (a padded batch's mask would make it causal), positions the
        # embeddings count from the pad id (RoBERTa's), or RoPE that picks its frequencies from a forward's longest
        # position (dynamic NTK, longrope): each pair alone.
        max_batch_tokens, max_levels = 1, 0
    if scored:
        scorer = _Scorer(model, [unique[u] for u in scored], max_batch_tokens, min_shared_tokens, max_levels, stats)
        from tqdm.auto import tqdm

        chunks = scorer.chunks()
        show = len(chunks) > 1 if progress is None else bool(progress)
        with torch.no_grad(), tqdm(total=len(scored), disable=not show, desc="hf_cascade.score", unit="pair") as bar:
            for chunk in chunks:
                for r, lps, is_greedy in scorer.run(chunk):
                    token_lps[scored[r]], greedy[scored[r]] = lps, is_greedy
                bar.update(len(chunk))
    logprobs = torch.tensor([float(token_lps[u].double().sum()) for u in range(len(unique))], dtype=torch.float64)
    return ScoreOutput(
        logprobs=logprobs[owner],
        is_greedy=torch.tensor(greedy, dtype=torch.bool)[owner],
        # (each entry its own tensor: identical pairs were scored once)
        token_logprobs=[token_lps[u].clone() for u in owner] if return_token_logprobs else None,
        stats=stats,
    )


_INT_OPTIONS = {"max_batch_tokens": 1, "min_shared_tokens": 1, "max_levels": 0}  # name -> least value
_BOOL_OPTIONS = ("add_special_tokens", "return_token_logprobs", "progress")  # progress: None too


def _check_options(**options) -> None:
    """Raise a ValueError naming the first of :func:`score`'s options of the wrong type or range (before any work)."""
    for name, least in _INT_OPTIONS.items():
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            kind = "a positive int" if least else "an int >= 0"
            raise ValueError(f"`{name}` must be {kind}; got {value!r} ({type(value).__name__}).")
    for name in _BOOL_OPTIONS:
        value = options[name]
        if not isinstance(value, bool) and not (name == "progress" and value is None):
            kind = "None, True or False" if name == "progress" else "True or False"
            raise ValueError(f"`{name}` must be {kind}; got {value!r} ({type(value).__name__}).")


def _positions_from_pad_id(model) -> bool:
    """Whether ``model``'s embeddings count positions from its pad id + 1 (RoBERTa and its kin as decoders)."""
    embeddings = getattr(getattr(model, "base_model", None), "embeddings", None)
    return hasattr(embeddings, "create_position_ids_from_input_ids")


class _Scorer:
    """The rows (unique pairs with a continuation) sorted by tokens, their prefix tree, and the segments' KV while
    some chunk still needs them."""

    def __init__(self, model, pairs, max_batch_tokens, min_shared_tokens, max_levels, stats):
        self.model, self.budget, self.stats = model, max_batch_tokens, stats
        # Llama 4's temperature tuning reads columns, not positions: rows whose columns would shift it run apart.
        self.floor_scale = _temperature_floor_scale(model)
        # Sorted: the rows under one tree node are consecutive (a node's KV lives from its first chunk to its last).
        self.order = sorted(range(len(pairs)), key=lambda i: pairs[i][0] + pairs[i][1])
        self.pairs = [pairs[i] for i in self.order]
        # The tree over the contexts: a context's last token is never shared (find_shared_prefixes keeps each row's
        # last token out), so every row runs it and the logits predicting the first continuation token come out.
        self.tree: PrefixTree = find_shared_prefixes(
            [ctx for ctx, _ in self.pairs], min_shared_tokens=min_shared_tokens, min_rows=2, max_levels=max_levels,
        )
        stats["shared_tokens"] = self.tree.shared_tokens
        self.last_row = {(level, i): max(node.rows) for level, nodes in enumerate(self.tree.levels)
                         for i, node in enumerate(nodes)}
        self.resident: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def own_length(self, r: int) -> int:
        """Tokens row ``r`` runs itself: context + continuation - 1 - its shared chain."""
        ctx, cont = self.pairs[r]
        return len(ctx) + len(cont) - 1 - self.tree.row_prefix_len[r]

    def chunks(self) -> list[list[int]]:
        """Consecutive rows, at most ``budget`` query tokens per chunk (rows x the widest own length)."""
        rows = range(len(self.pairs))
        return _batches([self.own_length(r) for r in rows], [self.tree.row_prefix_len[r] for r in rows],
                        self.budget, self.floor_scale)

    def run(self, rows: list[int]):
        """Score one chunk; yields ``(original row index, [len(cont)] float32 log-probs, is_greedy)``."""
        model, tree = self.model, self.tree
        levels, row_nodes = self._levels_for(rows)
        own = [self.pairs[r][0][tree.row_prefix_len[r]:] + self.pairs[r][1][:-1] for r in rows]
        starts = [tree.row_prefix_len[r] for r in rows]
        batch = len(rows)
        keep = max(len(self.pairs[r][1]) for r in rows)
        prefix_length = max(starts)
        # Each row right-aligned in the window (the continuation positions are the last `keep` columns for all), laid
        # out as generate() lays out a left-padded row, so that column - (its mask's leading zeros) is its position:
        # transformers' chunked-attention mask (Llama 4) counts chunks that way. Padding queries are discarded.
        input_ids, attention_mask, position_ids, suffix_start = window_layout(own, starts, prefix_length)
        cache = CascadeCache(model, levels, row_nodes=row_nodes, prefix_length=prefix_length,
                             suffix_start=suffix_start)
        cache.positions_checked = True  # (laid out here: window_layout)
        device = model.device
        # A row alone, unpadded, with nothing stored: the model's own positions (RoBERTa's count from its pad id + 1).
        alone = batch == 1 and not levels and bool(attention_mask.all())
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    position_ids=None if alone else position_ids.to(device), use_cache=True, logits_to_keep=keep,
                    **{CACHE_KWARG: cache})
        del cache
        self.stats["forwards"] += 1
        self.stats["tokens_run"] += sum(len(o) for o in own)
        logits = out.logits[:, -keep:].float()  # [B, keep, V]
        del out
        targets = torch.zeros((batch, keep), dtype=torch.int64, device=logits.device)
        for b, r in enumerate(rows):
            cont = self.pairs[r][1]
            targets[b, keep - len(cont):] = torch.tensor(cont, dtype=torch.int64)
        token_lps = (logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)).cpu()
        hits = (logits.argmax(dim=-1) == targets).cpu()
        del logits
        for b, r in enumerate(rows):
            n = len(self.pairs[r][1])
            yield self.order[r], token_lps[b, keep - n:].clone(), bool(hits[b, keep - n:].all())
        for key in [k for k, last in self.last_row.items() if k in self.resident and last <= rows[-1]]:
            del self.resident[key]  # no later row reads this segment

    def _levels_for(self, rows: list[int]) -> tuple[list[PrefixLevel], torch.Tensor]:
        """The prefix levels the chunk's rows read (segments prefilled now if no earlier chunk did) and
        ``row_nodes`` ``[levels, len(rows)]`` int64 (each row's node in each level, -1: none)."""
        tree = self.tree
        levels: list[PrefixLevel] = []
        parents: list[list[int | None]] = []
        position: list[dict[int, int]] = []  # per level: tree node index -> index in the chunk's level
        for level, nodes in enumerate(tree.levels):
            needed = sorted({tree.row_nodes[level][r] for r in rows} - {-1})
            if not needed:
                break  # a row has a node at level l only if it has one at every level above
            missing = [i for i in needed if (level, i) not in self.resident]
            for batch in self._prefill_batches([nodes[i] for i in missing], missing):
                specs = [(nodes[i].tokens, position[-1][nodes[i].parent] if level else None, nodes[i].start)
                         for i in batch]
                new = prefill_levels(self.model, [specs], levels, parents, cache_class=CascadeCache)[-1]
                self.stats["forwards"] += 1
                self.stats["tokens_run"] += sum(len(t) for t, _, _ in specs)
                for j, i in enumerate(batch):
                    lo, hi = new.node_starts[j], new.node_starts[j + 1]
                    self.resident[(level, i)] = ([k[:, lo:hi] for k in new.keys], [v[:, lo:hi] for v in new.values])
            kv = [self.resident[(level, i)] for i in needed]
            keys = [torch.cat(layer, dim=1) if len(layer) > 1 else layer[0] for layer in zip(*(k for k, _ in kv))]
            values = [torch.cat(layer, dim=1) if len(layer) > 1 else layer[0] for layer in zip(*(v for _, v in kv))]
            node_starts = [0]
            for i in needed:
                node_starts.append(node_starts[-1] + len(nodes[i].tokens))
            levels.append(PrefixLevel([nodes[i].tokens for i in needed], node_starts, keys, values))
            parents.append([position[-1][nodes[i].parent] if level else None for i in needed])
            position.append({i: j for j, i in enumerate(needed)})
        row_nodes = torch.full((len(levels), len(rows)), -1, dtype=torch.int64)
        for level in range(len(levels)):
            row_nodes[level] = torch.tensor([position[level].get(tree.row_nodes[level][r], -1) for r in rows])
        return levels, row_nodes

    def _prefill_batches(self, nodes, indices: list[int]) -> list[list[int]]:
        """``indices`` in batches of at most ``budget`` tokens (nodes x the longest node; a longer node alone), laid
        out exactly (:func:`_layout_exact`) in :func:`~hf_cascade.prefill.prefill_levels`' forward."""
        batches = _batches([len(node.tokens) for node in nodes], [node.start for node in nodes], self.budget,
                           self.floor_scale)
        return [[indices[k] for k in batch] for batch in batches]


def _batches(lengths: list[int], starts: list[int], budget: int, floor_scale: int | None) -> list[list[int]]:
    """Consecutive indices into ``lengths`` (each row's tokens, its first at position ``starts[i]``) in batches of at
    most ``budget`` query tokens (rows x the longest row; a longer row alone), each batch laid out exactly
    (:func:`_layout_exact`)."""
    batches, current, width = [], [], 0
    for k, length in enumerate(lengths):
        new_width = max(width, length)
        if current and ((len(current) + 1) * new_width > budget or floor_scale is not None and not _layout_exact(
                [starts[j] for j in current + [k]], [lengths[j] for j in current + [k]], floor_scale)):
            batches.append(current)
            current, new_width = [], length
        current.append(k)
        width = new_width
    if current:
        batches.append(current)
    return batches


def _temperature_floor_scale(model: torch.nn.Module) -> int | None:
    """Llama 4's attention temperature tuning: its layers without RoPE scale the queries by
    ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1``, ``i`` the query's column (``cache.get_seq_length()`` +
    its index in the forward), not its position. The ``floor_scale`` of such a layer, or None."""
    for module in model.modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            return int(module.floor_scale)
    return None


def _layout_exact(starts: list[int], lengths: list[int], floor_scale: int) -> bool:
    """Whether every row of one forward laid out by :func:`~hf_cascade.prefill.window_layout` (``P = max(starts)``
    prefix columns, a window of ``W = max(lengths)``) gets the temperature its position gets scored alone: row ``b``'s
    columns are its positions + ``d = P + W - lengths[b] - starts[b]``, and ``floor((i + 1) / floor_scale)`` is the
    same at every column ``i`` as at its position iff ``d == 0`` or it is the same at its first position and its
    last column (``P + W - 1``)."""
    prefix, width = max(starts), max(lengths)
    return all(prefix + width - n == s or (s + 1) // floor_scale == (prefix + width) // floor_scale
               for s, n in zip(starts, lengths))


def _token_pairs(model, contexts, continuations, tokenizer, add_special_tokens) -> list[tuple[tuple, tuple]]:
    """The pairs as ``(context tuple, continuation tuple)`` of Python ints, validated (ValueErrors name the fix)."""
    for name, value in (("contexts", contexts), ("continuations", continuations)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not isinstance(value, torch.Tensor):
            raise ValueError(
                f"`{name}` must be a list (one entry per pair); got {type(value).__name__}. For one pair pass "
                f"`[{name[:-1]}]`."
            )
    if len(contexts) != len(continuations):
        raise ValueError(
            f"`contexts` and `continuations` must have one entry per pair: got {len(contexts)} contexts and "
            f"{len(continuations)} continuations. Repeat a context for each of its continuations "
            "(`[ctx] * len(choices)`)."
        )
    strings = [isinstance(x, str) for x in (*contexts, *continuations)]
    if any(strings):
        if not all(strings):
            raise ValueError("`contexts` and `continuations` must be all strings or all token-id sequences; got both.")
        if tokenizer is None:
            raise ValueError("`contexts`/`continuations` are strings: pass `tokenizer=` to tokenize them.")
        pairs = [_encode_pair(tokenizer, c, x, add_special_tokens) for c, x in zip(contexts, continuations)]
    else:
        pairs = []
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            pairs.append((_ids(ctx, f"contexts[{i}]"), _ids(cont, f"continuations[{i}]")))
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    for i, (ctx, cont) in enumerate(pairs):
        if not ctx:
            raise ValueError(
                f"`contexts[{i}]` is empty: the first continuation token is predicted from the context's last token. "
                "Prepend a token (lm-evaluation-harness uses the EOS token, `[tokenizer.eos_token_id]`)."
            )
        for name, tokens in ((f"contexts[{i}]", ctx), (f"continuations[{i}]", cont)):
            if tokens and (min(tokens) < 0 or (vocab is not None and max(tokens) >= vocab)):
                raise ValueError(
                    f"`{name}` holds token ids outside the model's vocabulary [0, {vocab}): min {min(tokens)}, max "
                    f"{max(tokens)}. Was it tokenized with this model's tokenizer?"
                )
    return pairs


def _ids(tokens, name: str) -> tuple[int, ...]:
    """One context or continuation as a tuple of Python ints; a ValueError naming ``name`` for anything else (bytes,
    bools, floats, a 2-D tensor)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"`{name}` must be a sequence of int token ids (or a str with `tokenizer=`); got {type(tokens).__name__}. "
            "Decode it to a str (`.decode()`) and pass `tokenizer=`, or pass its token ids as a list of ints."
        )
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(
                f"`{name}` must be a 1-D integer tensor of token ids; got {tokens.dtype} of shape "
                f"{tuple(tokens.shape)}. Pass one sequence per pair (a [N, L] batch as a list of rows, padding "
                "removed)."
            )
        return tuple(tokens.tolist())
    kind = getattr(getattr(tokens, "dtype", None), "kind", "i")  # a numpy array's: integers only
    if kind not in "iu":
        raise ValueError(f"`{name}` must hold integer token ids; got an array of dtype {tokens.dtype}.")
    try:
        return tuple(map(_token_id, tokens))
    except TypeError:
        raise ValueError(
            f"`{name}` must be a sequence of int token ids (or a string with `tokenizer=`); got "
            f"{type(tokens).__name__}{' holding other values than ints' if hasattr(tokens, '__iter__') else ''} "
            "(bools and floats are not token ids)."
        ) from None


def _token_id(token) -> int:
    """``token`` as a Python int: ints and numpy ints; a bool (an int to Python, never a token id), a float or
    anything else raises TypeError."""
    if isinstance(token, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(token)


def _encode_pair(tokenizer, context: str, continuation: str, add_special_tokens: bool):
    """lm-evaluation-harness's split of a (context, continuation) text pair into token ids (``HFLM._encode_pair``):
    the context's own tokens, then the tokens of ``context + continuation`` after as many. Where tokens merge across
    the boundary the scored sequence is not the whole text's tokens, as in lm-eval. A continuation left with no
    token (merged into the context's last one) is a ValueError: it would score 0, the best possible."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=add_special_tokens)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=add_special_tokens)["input_ids"]
    continuation_ids = whole[len(context_ids):]
    if continuation and not continuation_ids:
        raise ValueError(
            f"The continuation {continuation!r} has no token of its own after the context {context[-40:]!r}: "
            "tokenizing them together merges it into the context's last token, so it would score 0 (certain). "
            "Pass the pair as token ids, or split the text where a token boundary lies."
        )
    return tuple(context_ids), tuple(continuation_ids)
