"""Draft and target vocabularies that differ only by padding rows (design: "Models").

Qwen2.5-7B has 152,064 logits and Qwen2.5-0.5B 151,936, with one tokenizer of 151,665 tokens:
every row past the tokenizer is padding. The draft is made to speak the target's vocabulary
here and only here. Its logits are widened (or narrowed) to the target's width with -inf at
every id past the tokenizer, so it proposes real ids only and a sampled q is the draft's
distribution padded with zeros: the rejection rule min(1, p/q) stays exact. Greedy compares
against the target's full argmax, as the target alone would pick it. A token the draft has no
embedding row for (the target may emit a padding id) reaches the draft as a real id instead:
that can only cost acceptance, never change an output.
"""
from __future__ import annotations

import torch

from ..errors import ModelLoadError


def logit_rows(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_vocabularies(target, draft, tokenizer) -> None:
    """Equal logit counts, or counts that differ only by padding rows past the tokenizer."""
    vt, vd, real = logit_rows(target), logit_rows(draft), len(tokenizer)
    if vt != vd and real > min(vt, vd):
        raise ModelLoadError(f"draft and target vocabularies differ: target has {vt} logits, "
                             f"draft has {vd}, the tokenizer has {real} tokens; a pair whose "
                             "sizes differ only by padding rows (the tokenizer fits in both) is "
                             "valid, this one is not: speculative decoding needs one shared "
                             "tokenizer")


class PaddedVocab:
    """How the draft's ids and logits map to the target's when their sizes differ."""

    def __init__(self, real: int, target_rows: int, draft_rows: int, substitute_id: int):
        self.real = real
        self.target_rows = target_rows
        self.draft_rows = draft_rows
        self.substitute_id = substitute_id

    @classmethod
    def of(cls, target, draft, tokenizer, pad_id: int) -> "PaddedVocab | None":
        """None when the sizes agree: then nothing is translated."""
        if draft is None or logit_rows(target) == logit_rows(draft):
            return None
        return cls(len(tokenizer), logit_rows(target), logit_rows(draft), pad_id)

    def draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids the draft can embed: a target-only padding id becomes the substitute."""
        return ids.masked_fill(ids >= self.draft_rows, self.substitute_id)

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., draft_rows] -> [..., target_rows], -inf past the real vocabulary."""
        out = logits.new_full(logits.shape[:-1] + (self.target_rows,), float("-inf"))
        out[..., :self.real] = logits[..., :self.real]
        return out
