"""Where a round of drafts ends early: after a draft token the draft is unsure of.

Drafting past a token the target will likely reject wastes draft forwards and verified columns,
but drafting on past one it will likely accept is what earns a long round. Hugging Face
assisted generation stops at a fixed confidence (its assistant_confidence_threshold, 0.4); how
often a 0.4-sure draft token is accepted, and what one more draft costs against a verification,
depend on the pair and the machine (on this project's CI machines the same 0.4 won 10% at
batch 1 on one and lost 6% on another). So "auto" decides per draft from measurements:
- calibration: the share of verified draft tokens the target accepted, by the draft's
  confidence (its top probability) in CONFIDENCE_BINS bins, decayed, each bin shrunk toward its
  own confidence by PRIOR_TOKENS pseudo-tokens and made non-decreasing in confidence;
- the trade, after draft j, from the round's own confidences so far and adaptive k's hazards
  and step costs: row r's drafts 1 .. j are all kept with chance D_r = p_1 ... p_j (p_i the
  calibrated acceptance of its draft i's confidence), so stopping commits
  sum_r A_r = sum_r (1 + p_1 + p_1 p_2 + ... + D_r) tokens at the cost of a round of j, and
  drafting on to k commits sum_r (A_r + D_r G) at the cost of a round of k, G the drafts after
  j expected to survive given that j did (from the hazards). The round ends when stopping
  commits more tokens per second.
Each row's chance comes from its own drafts' confidences, not from the hazards' average: a
row whose first drafts were sure is likelier to keep them than the average row.
A stop never changes outputs: the target verifies whatever the round drafted. It is off by
default: measured on this project's CPU, measuring every draft's confidence cost more than the
stops saved (docs/engine.md).
"""
from __future__ import annotations

import torch

CONFIDENCE_BINS = 10


def confidences(logits: torch.Tensor) -> torch.Tensor:
    """Per distribution of draft logits ([..., V]): its top probability, exp(max - logsumexp)
    (no softmax written out)."""
    logits = logits.float()
    # a position where the request's constraints leave no token has no distribution: 0
    return (logits.amax(-1) - logits.logsumexp(-1)).exp().nan_to_num(0.0)


def confidence_bin(confidence: torch.Tensor) -> torch.Tensor:
    return (confidence * CONFIDENCE_BINS).long().clamp_(max=CONFIDENCE_BINS - 1)


class DraftStop:
    """Where rounds of drafts end: fixed (`fixed` in (0, 1), every row below it), or ("auto",
    `fixed` None) from calibration and adaptive k's costs (module doc)."""

    DECAY = 0.995         # of the calibration counts, per verified draft token observed
    PRIOR_TOKENS = 2.0    # pseudo-tokens per bin at acceptance = the bin's confidence

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.verified = [0.0] * CONFIDENCE_BINS
        self.accepted = [0.0] * CONFIDENCE_BINS
        # the same per draft depth (index j - 1), grown as deeper drafts are seen
        self.verified_at: list[list[float]] = []
        self.accepted_at: list[list[float]] = []

    def acceptance_by_bin(self, depth: int | None = None) -> list[float]:
        """Calibrated acceptance per confidence bin, non-decreasing in confidence: over every
        depth, or of draft `depth`'s, shrunk toward every depth's by PRIOR_TOKENS (a draft deep
        in a kept run is kept more often than its confidence says: on the demo pair 0.90 of
        depth-4 drafts 30-40% sure, 0.65 of such drafts at every depth)."""
        if depth is None:
            counts = zip(self.verified, self.accepted,
                         ((b + 0.5) / CONFIDENCE_BINS for b in range(CONFIDENCE_BINS)))
        elif depth > len(self.verified_at):
            return self.acceptance_by_bin()
        else:
            counts = zip(self.verified_at[depth - 1], self.accepted_at[depth - 1],
                         self.acceptance_by_bin())
        out, floor = [], 0.0
        for verified, accepted, prior in counts:
            floor = max(floor, (accepted + self.PRIOR_TOKENS * prior) / (verified + self.PRIOR_TOKENS))
            out.append(floor)
        return out

    def round(self, k: int, hazards: list[float], cost) -> "RoundStop":
        """The rule for one round of up to k drafts (module doc). `cost(j)`: a round of j
        drafts' step time (None: not known yet, then no stop after j)."""
        if self.fixed is not None:
            return RoundStop(fixed=self.fixed)
        after = []   # after[j - 1]: drafts after j expected to survive, given that j did
        for j in range(1, k):
            survive, total = 1.0, 0.0
            for h in hazards[j:k]:
                survive *= 1.0 - h
                total += survive
            after.append(total)
        return RoundStop(acceptance=[self.acceptance_by_bin(j) for j in range(1, k)], after=after,
                         costs=[cost(j) for j in range(1, k + 1)])

    def observe(self, bins: list[list[int]], accepted: list[int], caps: list[int]) -> None:
        """A step's drafts: per row their confidence bins, how many the target accepted, and
        how many it could accept (the row's own k cap)."""
        if self.fixed is not None:
            return
        # draft j (0-based) was verified if drafts before it were all accepted (j <= a)
        seen = [(j, b, j < a) for row_bins, a, cap in zip(bins, accepted, caps)
                for j, b in enumerate(row_bins[:min(cap, a + 1)])]
        while len(self.verified_at) < max((j + 1 for j, _, _ in seen), default=0):
            self.verified_at.append([0.0] * CONFIDENCE_BINS)
            self.accepted_at.append([0.0] * CONFIDENCE_BINS)
        decay = self.DECAY ** len(seen)
        for counts in (self.verified, self.accepted, *self.verified_at, *self.accepted_at):
            counts[:] = [c * decay for c in counts]
        for j, b, took in seen:
            for verified, accepted in ((self.verified, self.accepted),
                                       (self.verified_at[j], self.accepted_at[j])):
                verified[b] += 1.0
                accepted[b] += float(took)


class RoundStop:
    """One round's stop rule: `ends_after(j, confidences)` after draft j (1-based) is drafted,
    with every row's confidence in it; it keeps each row's chances of the drafts so far."""

    def __init__(self, fixed: float | None = None, acceptance=None, after=None, costs=None):
        self.fixed = fixed   # else: per depth j < k the calibrated acceptance by bin, `after`
        # (drafts after j expected to survive given j did) and per j <= k a round's cost
        self.acceptance, self.after, self.costs = acceptance, after, costs
        self.kept: list[float] = []     # per row: D_r, the chance drafts 1 .. j are all kept
        self.tokens: list[float] = []   # per row: A_r, the tokens a stop after j commits

    def ends_after(self, j: int, confidences: list[float]) -> bool:
        if self.fixed is not None:   # Hugging Face's rule: every row below a fixed confidence
            return all(c < self.fixed for c in confidences)
        if not self.kept:
            self.kept, self.tokens = [1.0] * len(confidences), [1.0] * len(confidences)
        for r, c in enumerate(confidences):
            self.kept[r] *= self.acceptance[j - 1][min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)]
            self.tokens[r] += self.kept[r]
        cost_j, cost_k = self.costs[j - 1], self.costs[-1]
        if cost_j is None or cost_k is None:
            return False
        stop = sum(self.tokens)
        on = stop + self.after[j - 1] * sum(self.kept)
        return stop * cost_k > on * cost_j
