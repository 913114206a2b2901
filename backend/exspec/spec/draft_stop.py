"""Where a round of drafts ends early: at a draft token the draft is unsure of.

Drafting past a token the target will likely reject wastes draft forwards and verified columns,
but drafting on past one it will likely accept is what earns a long round. Hugging Face
assisted generation stops at a fixed confidence (its assistant_confidence_threshold, 0.4); how
often a 0.4-sure draft token is accepted, and what one more draft costs against a verification,
depend on the pair and the machine (on this project's CI machines the same 0.4 won 10% at
batch 1 on one and lost 6% on another). So the threshold is derived per step from measurements:
- calibration: the share of verified draft tokens the target accepted, by the draft's
  confidence (its top probability) in CONFIDENCE_BINS bins, decayed, each bin shrunk toward its
  own confidence by PRIOR_TOKENS pseudo-tokens and made non-decreasing in confidence;
- the trade, from adaptive k's hazards and step costs: stopping after draft j commits
  A + D p tokens per row at the cost of a round of j, drafting on to k commits A + D p (1 + G)
  at the cost of a round of k, where A = 1 + S_1 + .. + S_(j-1), D = S_(j-1), G the drafts
  after j expected to survive given that j did, and p draft j's acceptance. The round stops
  after draft j when every row's p is below the break-even p*, i.e. every row's confidence
  below the lowest bin whose calibrated p reaches p*.
A stop never changes outputs: the target verifies whatever the round drafted.
"""
from __future__ import annotations

import torch

CONFIDENCE_BINS = 10


def confidence_bins(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per distribution of draft logits ([..., V]): its top probability and that probability's bin."""
    # a position where the request's constraints leave no token has no distribution: 0
    confidence = logits.float().softmax(-1).amax(-1).nan_to_num(0.0)
    return confidence, (confidence * CONFIDENCE_BINS).long().clamp_(max=CONFIDENCE_BINS - 1)


class DraftStop:
    """Per-step confidence thresholds (one per draft depth 1 .. k-1): fixed (`fixed` in (0, 1)),
    or ("auto", `fixed` None) derived from calibration and adaptive k's costs (module doc)."""

    DECAY = 0.995         # of the calibration counts, per verified draft token observed
    PRIOR_TOKENS = 2.0    # pseudo-tokens per bin at acceptance = the bin's confidence

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.verified = [0.0] * CONFIDENCE_BINS
        self.accepted = [0.0] * CONFIDENCE_BINS

    def acceptance_by_bin(self) -> list[float]:
        """Calibrated acceptance per confidence bin, non-decreasing in confidence."""
        out, floor = [], 0.0
        for b, (verified, accepted) in enumerate(zip(self.verified, self.accepted)):
            centre = (b + 0.5) / CONFIDENCE_BINS
            shrunk = (accepted + self.PRIOR_TOKENS * centre) / (verified + self.PRIOR_TOKENS)
            floor = max(floor, shrunk)
            out.append(floor)
        return out

    def thresholds(self, k: int, hazards: list[float], cost) -> list[float]:
        """The confidence below which (in every row) the round ends after draft j, for j in
        1 .. k-1; 0 where it never should. `cost(j)`: a round of j drafts' step time (None: not
        known yet, then no stop at j)."""
        if self.fixed is not None:
            return [self.fixed] * (k - 1)
        survive = [1.0]                       # survive[i]: drafts 1 .. i all accepted
        for h in hazards[:k]:
            survive.append(survive[-1] * (1.0 - h))
        cost_k = cost(k)
        acceptance = self.acceptance_by_bin()
        out = []
        for j in range(1, k):
            cost_j = cost(j)
            if cost_k is None or cost_j is None or survive[j] <= 0:
                out.append(0.0)
                continue
            a, d = sum(survive[:j]), survive[j - 1]
            g = sum(survive[j + 1:k + 1]) / survive[j]
            gain = d * ((1.0 + g) * cost_j - cost_k)
            p_star = a * (cost_k - cost_j) / gain if gain > 0 else float("inf")
            # below the lowest bin that reaches p* (none: drafting on never pays by these
            # numbers, which then disagree with adaptive k's choice of k; trust k, no stop)
            edge = next((b for b, p in enumerate(acceptance) if p >= p_star), None)
            out.append(0.0 if edge is None else edge / CONFIDENCE_BINS)
        return out

    def observe(self, bins: list[list[int]], accepted: list[int], caps: list[int]) -> None:
        """A step's drafts: per row their confidence bins, how many the target accepted, and
        how many it could accept (the row's own k cap)."""
        if self.fixed is not None:
            return
        # draft j (0-based) was verified if drafts before it were all accepted (j <= a)
        seen = [(b, j < a) for row_bins, a, cap in zip(bins, accepted, caps)
                for j, b in enumerate(row_bins[:min(cap, a + 1)])]
        decay = self.DECAY ** len(seen)
        self.verified = [v * decay for v in self.verified]
        self.accepted = [x * decay for x in self.accepted]
        for b, took in seen:
            self.verified[b] += 1.0
            self.accepted[b] += float(took)
