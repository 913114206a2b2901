"""HybridProposer: suffix decoding with an EAGLE-3 head (method "eagle3_suffix") or a draft model
("draft_model_suffix"), per row and per step the proposal expected to keep more (Arctic
Inference's suffix + model speculation; design: "Proposers").

It owns a suffix proposer (suffix.py) and a model proposer (eagle3.py, draft_model.py). At `plan`, on the host,
each row's suffix proposal comes with its score (the sum of its tokens' path probabilities: what
it expects kept if the trees' frequencies were the target's); the row takes it where that score,
calibrated by how much of its score suffix decoding has kept, beats what the head is expected to
keep at the row's cap (the sum over depths j of the product of its measured acceptance rates at
depths 1 .. j). Otherwise, and always for a constrained row (its grammar's masks follow the
head's drafts), the row takes the head's drafts.

Both go through the one verification the head's steps use ([pending, d1 .. dk] per row): the
head drafts every row as usual, and a suffix row's drafts are replaced by its proposal, padded to
the step's width and capped at its length (the per-row cap every proposer has: a row with fewer
tokens left). So the head still takes every committed token (its first forward of the next step
takes what it lacks, the verification's features of the kept positions, whoever proposed them),
and the output stays exact: greedy and gumbel accept a draft while it equals the target's token,
whatever proposed it; under rejection sampling a suffix row's q is one-hot at its tokens (a
point mass, as a lookup proposal's), which at its cap, against a filler draft, also makes the
token committed there an exact sample of the target's p.

The estimates it chooses by are host numbers kept from the rows' committed tokens, per row with
the whole run's as its prior: no copy, no device work. With adaptive k the step is priced whole
too (`_alone_pays`): the head's k draft forwards are paid by every row of the group, so where
the tokens a second expected with them fall below suffix decoding's alone (each row's proposal,
or nothing to verify), the step runs without them. A step where every row took suffix
decoding verifies its proposals (cut to the width that pays, with adaptive k), not k, and the
model does not draft at all (its k forwards would all be replaced; on two-turn chats they cost
~16% of the hybrid's speed): a draft model's cache stays as it was and catches up at its next
drafting step, as after plain steps; the head's buffer takes the verification's features of the kept positions after the
ones it already held, and its next first forward feeds them all.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from ..sampling.sampler import point_mass
from ..speculative import SpeculativeConfig, SpeculativeMethod
from .draft_model import DraftModelProposer
from .lookup import priced
from .eagle3 import Eagle3Proposer
from .proposer import Plan, Proposal, Proposer, Runner, StepState
from .suffix import SUFFIX_KEYS, SuffixProposer


class Rates:
    """Decayed counts of trials and successes per index (a draft depth), with a prior."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.hits: list[float] = []
        self.trials: list[float] = []

    def rate(self, j: int, prior: float | None = None) -> float:
        prior = self.prior if prior is None else prior
        if j >= len(self.trials):
            return prior
        return (self.hits[j] + self.weight * prior) / (self.trials[j] + self.weight)

    def observe(self, j: int, hit: float, trial: float = 1.0) -> None:
        while len(self.trials) <= j:
            self.hits.append(0.0)
            self.trials.append(0.0)
        self.hits[j] = self.decay * self.hits[j] + hit
        self.trials[j] = self.decay * self.trials[j] + trial


@dataclass
class RowEstimates:
    """One row's: the head's acceptance per depth, suffix decoding's kept / score."""
    head: Rates = field(default_factory=lambda: Rates(0.0, 2.0, 0.8))
    suffix: Rates = field(default_factory=lambda: Rates(0.0, 2.0, 0.8))


@dataclass
class HybridPlan(Plan):
    """A step's plan and, per row, the suffix proposal it verifies ([]: the head's drafts)."""
    suffix: list[list[int]] = field(default_factory=list)
    offered: list[list[int]] = field(default_factory=list)   # the suffix proposals not taken
    starts: list[int] = field(default_factory=list)          # each row's tokens before the step
    scores: list[float] = field(default_factory=list)

    @property
    def drafts(self) -> bool:
        """Whether the model drafts this step: not when every row verifies a suffix proposal
        (then `tokens` holds them, as a lookup proposer's plan would)."""
        return self.tokens is None


class HybridProposer(Proposer):
    """Suffix decoding with a model proposer (`model_class`'s); the methods are its subclasses."""
    model_class: type[DraftModelProposer] = DraftModelProposer
    proposes = True
    learns_across_requests = True   # suffix decoding's global tree

    def __init__(self, model: DraftModelProposer, suffix: SuffixProposer):
        self.model, self.suffix = model, suffix
        self.models, self.kv_models, self.vocab = model.models, model.kv_models, model.vocab
        # the run's estimates: each row's prior (a head is assumed to keep 0.6 a depth until it
        # is measured; suffix decoding its score)
        self.head = Rates(0.6, 4.0, 0.98)
        self.suffix_kept = Rates(1.0, 4.0, 0.98)
        self.rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # row-steps per source (plain: nothing to verify, in a step without drafts)
        self.chosen = {"suffix": 0, "head": 0, "plain": 0}
        self.choice_seconds = 0.0                # host time spent choosing (its share of a step)
        self._plan: HybridPlan | None = None
        self._seqs: list = []

    @classmethod
    def load_draft(cls, config):
        return cls.model_class.load_draft(config)

    @classmethod
    def load_head(cls, config, target):
        return cls.model_class.load_head(config, target)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair, pad_id: int) -> "HybridProposer":
        return cls(cls.model_class.from_config(spec, pair, pad_id),
                   SuffixProposer.from_config(spec, pair, pad_id))

    # -- the choice ---------------------------------------------------------------------------
    def _row(self, row) -> RowEstimates:
        found = self.rows.get(row)
        if found is None:
            found = self.rows[row] = RowEstimates()
        return found

    def head_expected(self, row, cap: int) -> float:
        """The head's drafts this row is expected to keep at `cap`: sum_j prod_{i <= j} rate_i."""
        rates = self._row(row).head
        expected, alive = 0.0, 1.0
        for j in range(cap):
            alive *= rates.rate(j, self.head.rate(j))
            expected += alive
        return expected

    def suffix_expected(self, row, score: float) -> float:
        """Suffix decoding's expected kept tokens: its score times what it has kept per score."""
        return score * self._row(row).suffix.rate(0, self.suffix_kept.rate(0))

    def plan(self, runner: Runner, seqs, k: int, pricing=None) -> Plan:
        self._plan, self._seqs = None, list(seqs)
        if k == 0:
            return Plan(0, [0] * len(seqs))
        self.suffix.index_rows(runner, seqs, k)
        start = time.perf_counter()
        suffix, offered, caps, scores = [], [], [], []
        mixed, alone = 0.0, 0.0   # tokens the step is expected to commit: per row / suffix alone
        for s in seqs:
            cap = s.drafts_at(k)
            tokens, score = ([], 0.0) if s.grammar is not None or cap == 0 else \
                self.suffix.propose_scored(s, cap)
            from_suffix = self.suffix_expected(s, score) if tokens else 0.0
            from_head = self.head_expected(s, cap)
            take = bool(tokens) and from_suffix > from_head
            suffix.append(tokens if take else [])
            offered.append([] if take else tokens)
            caps.append(len(tokens) if take else cap)
            scores.append(score)
            mixed += 1.0 + (from_suffix if take else from_head)
            alone += 1.0 + from_suffix
        if not all(suffix) and self._alone_pays(seqs, suffix, offered, k, mixed, alone, pricing):
            # the rows on the head take their suffix proposals, or verify nothing, and the
            # model does not draft: its drafts were expected to add less than they cost
            suffix = [t or o for t, o in zip(suffix, offered)]
            offered, caps = [[] for _ in seqs], [len(t) for t in suffix]
        # no row on the head (a row with nothing to verify is not): the longest proposal is
        # the step's width, and the model does not draft
        drafts = not all(t or not c for t, c in zip(suffix, caps))
        width, lengths = k, None
        if not drafts:   # suffix decoding alone: its proposals priced as a lookup proposer's
            lengths = [len(t) for t in suffix]
            suffix = priced(runner, suffix, pricing, drafted=False)
            width, caps = max(map(len, suffix)), [len(t) for t in suffix]
        for t in suffix:
            self.chosen["suffix" if t and width else "head" if drafts else "plain"] += 1
        if width == 0:   # nothing to verify, or nothing that pays: a plain step
            self.choice_seconds += time.perf_counter() - start
            return Plan(0, [0] * len(seqs))
        self._plan = HybridPlan(width, caps, None if drafts else suffix, lengths, suffix=suffix,
                                offered=offered, starts=[s.num_tokens for s in seqs], scores=scores)
        self.choice_seconds += time.perf_counter() - start
        return self._plan

    @staticmethod
    def _alone_pays(seqs, suffix, offered, k: int, mixed: float, alone: float, pricing) -> bool:
        """Whether the step commits more tokens a second on suffix decoding alone (each row's
        proposal, none where it has none; no drafts) than with the head drafting for the rows
        that chose it: at B = 8 one row on the head makes every row pay its k draft forwards.
        Priced by adaptive k (a verification's width and a draft forward, measured); without
        prices, or where a constrained row needs the head, the rows' own choices stand."""
        if pricing is None or any(s.grammar is not None for s in seqs):
            return False
        width = max(len(t or o) for t, o in zip(suffix, offered))
        with_drafts, without = pricing.seconds(k, k), pricing.seconds(width, 0) if width else None
        if not with_drafts or not without:
            return False
        return alone / without > mixed / with_drafts

    # -- the head's step, with the suffix rows' drafts replaced ---------------------------------
    def new_state(self, layout, batch: int, device):
        return self.model.new_state(layout, batch, device)

    def prefill(self, runner: Runner, state, ragged: tuple) -> None:
        self.model.prefill(runner, state, ragged)

    def stage(self, runner: Runner, state, seqs, plan: Plan, upload):
        staged, room = None, {}
        if not isinstance(plan, HybridPlan) or plan.drafts:
            staged, room = self.model.stage(runner, state, seqs, plan, upload)
        at = None
        if isinstance(plan, HybridPlan) and any(plan.suffix):
            # per row: whether it takes suffix decoding, then its proposal padded to the width
            # (the padding is a filler draft past its cap: never kept, see the module doc)
            rows = [[int(bool(p))] + p + [0] * (plan.width - len(p)) for p in plan.suffix]
            at = upload.add([v for row in rows for v in row], len(rows), plan.width + 1)
        return (staged, at), room

    def propose(self, runner: Runner, state, seqs, plan: Plan, staged, sent: list[torch.Tensor],
                step: StepState) -> Proposal:
        staged, at = staged
        if isinstance(plan, HybridPlan) and not plan.drafts:   # the suffix proposals alone
            tokens = sent[at][:, 1:].long()
            q = None if step.coupled else point_mass(tokens, runner.logits_width)
            return Proposal(plan.width, tokens, q, masks=step.masks)
        proposal = self.model.propose(runner, state, seqs, plan, staged, sent, step)
        if at is None:
            return proposal
        section = sent[at]
        chosen = section[:, 0].bool()
        width = proposal.tokens.shape[1]
        tokens = torch.where(chosen[:, None], section[:, 1:width + 1].to(proposal.tokens.dtype),
                             proposal.tokens)
        q = proposal.q
        if q is not None:   # a point mass at each suffix token (and at the filler past its cap)
            point = point_mass(tokens, q.shape[-1]).to(q.dtype)
            q = torch.where(chosen[:, None, None], point, q)
        return Proposal(proposal.width, tokens, q, masks=proposal.masks,
                        confidence_bins=proposal.confidence_bins)

    def commit(self, state, width: int, accepted: list[int], kept: torch.Tensor) -> None:
        plan, self._plan = self._plan, None
        if plan is not None and not plan.drafts:
            self.model.commit_undrafted(state, width, accepted, kept)
        else:
            self.model.commit(state, width, accepted, kept)
        if plan is None or width == 0:
            return
        for row, a in enumerate(accepted):
            seq, cap = self._seqs[row], min(plan.caps[row], width)
            if cap == 0:
                continue
            estimates = self._row(seq)
            if plan.suffix[row]:   # suffix decoding kept a of what it expected (of a whole proposal)
                if plan.lengths is None or len(plan.suffix[row]) == plan.lengths[row]:
                    self._observe_suffix(estimates, a, plan.scores[row])
                continue
            for j in range(min(a + 1, cap)):   # the head: depths 1 .. a kept, a + 1 not
                estimates.head.observe(j, float(j < a))
                self.head.observe(j, float(j < a))
            offered = plan.offered[row]
            if offered:   # what suffix decoding would have kept, where the output shows it
                new = seq.tokens[plan.starts[row]:plan.starts[row] + a + 1]
                would = next((i for i, (p, t) in enumerate(zip(offered, new)) if p != t),
                             min(len(offered), len(new)))
                if would < len(new) or would == len(offered):   # not cut short by the output
                    self._observe_suffix(estimates, would, plan.scores[row])

    def _observe_suffix(self, estimates: RowEstimates, kept: int, score: float) -> None:
        estimates.suffix.observe(0, kept, score)
        self.suffix_kept.observe(0, kept, score)

    # -- across requests: suffix decoding's ------------------------------------------------------
    def request_done(self, row, reason: str) -> None:
        self.suffix.request_done(row, reason)
        self.rows.pop(row, None)

    def forget(self) -> None:
        self.suffix.forget()


class Eagle3SuffixProposer(HybridProposer):
    speculative_method = SpeculativeMethod(
        "eagle3_suffix",
        usage="by suffix decoding with an EAGLE-3 head (method 'eagle3_suffix' and 'model': the "
              "head's folder)",
        model="the EAGLE-3 head's folder", keys=SUFFIX_KEYS, head=True)
    model_class = Eagle3Proposer


class DraftModelSuffixProposer(HybridProposer):
    speculative_method = SpeculativeMethod(
        "draft_model_suffix",
        usage="by suffix decoding with a draft model (method 'draft_model_suffix' and 'model')",
        model="the draft model's path or name", keys=SUFFIX_KEYS)
    model_class = DraftModelProposer
