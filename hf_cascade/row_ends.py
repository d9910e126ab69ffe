"""Where each generated row of a batch ends: its first EOS (kept), a stopping criterion that ended it (a stop string,
the user's own), or the batch's last column; the rest is generate()'s padding. ``generate_dataset`` cuts each
completion there, so that its text is a per-row generate()'s."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

__all__ = ["FinishWidths", "eos_ids_of", "row_lengths"]


def eos_ids_of(model, gen_kwargs: dict) -> list[int]:
    """The EOS ids a generate() call with ``gen_kwargs`` stops at (its own, else the model's generation config)."""
    eos = gen_kwargs.get("eos_token_id")
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):  # generate() takes a tensor of one or more ids too
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class FinishWidths(StoppingCriteria):
    """The call's own stopping criteria (the user's, its stop strings), recording each row's width when they first
    said it was done: a row they stopped is padded after that by generate() (with the EOS where pad is EOS), and
    its text ends there, as a per-row generate()'s. ``first_width [rows]`` int64, -1 for a row never stopped."""

    def __init__(self, criteria):
        self.criteria = StoppingCriteriaList(criteria)
        self.first_width: torch.Tensor | None = None

    @classmethod
    def around(cls, gen_kwargs: dict, model) -> "FinishWidths | None":
        """Around ``gen_kwargs``' ``stopping_criteria``, or None (none; beam search, whose criteria see beams)."""
        beams = gen_kwargs.get("num_beams") or getattr(getattr(model, "generation_config", None), "num_beams", 1)
        if not gen_kwargs.get("stopping_criteria") or (beams or 1) > 1:
            return None
        return cls(gen_kwargs["stopping_criteria"])

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = self.criteria(input_ids, scores, **kwargs)
        if self.first_width is None:
            self.first_width = torch.full(done.shape, -1, dtype=torch.long, device=done.device)
        self.first_width = torch.where(done & (self.first_width < 0), input_ids.shape[1], self.first_width)
        return done


def row_lengths(new: torch.Tensor, eos_ids: list[int], pad_token_id: int) -> torch.Tensor:
    """``[rows]`` int64: each row's generated tokens up to and including its first EOS (rows that finished early are
    padded after it); without an EOS, the row's tokens other than padding at its end."""
    rows, width = new.shape
    full = torch.full((rows,), width, dtype=torch.long, device=new.device)
    if width == 0:
        return full
    if not eos_ids:
        real = (new != pad_token_id).long()
        last = width - real.flip(1).argmax(1)  # one past the last token that is not padding
        return torch.where(real.any(1), last, torch.zeros_like(full))
    is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
    return torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, full)
