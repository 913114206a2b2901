"""Scheduler: the policy half of the tick: whom to admit, which rows to step, with which k.

EQSPEC: all running rows form one batch (up to max_batch_size), realigned after every step.
EXSPEC: the pool holds up to max_num_seqs sequences in sticky groups; each tick steps one
group (topped up by merging smaller groups, equal lengths first, while the batch fits), never
leaving a sequence unstepped for more than max_skipped_ticks ticks. Ragged groups need no
realignment in EXSPEC's cache layout, so a group stays together until its rows finish.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import EngineConfig
from .draft_stop import DraftStop
from .group import Group
from .prefix_cache import PrefixCaching
from .proposer import Proposer
from .sequence import Sequence

if TYPE_CHECKING:
    from .runner import StepResult


@dataclass
class Plan:
    groups: list[Group]   # stepped as one group (merged first when more than one)


class AdaptiveK:
    """k per group from the tokens each k commits and measured step cost, with hysteresis.

    Committed tokens per row-step at k come from measured per-draft hazards: h_j, the share of
    rows whose draft j was verified (drafts 1 .. j-1 accepted) that rejected it. A row that
    accepted a of k drafts tells h_1 .. h_min(a+1, k), whatever k the step ran at (greedy and the
    gumbel coupling accept the same prefix at any k), and a row-step at k commits
    1 + S_1 + ... + S_k, S_j = (1 - h_1) ... (1 - h_j). Acceptance comes in runs (a row that
    accepts its first drafts tends to accept them all), so measured hazards fall with depth
    where a geometric model at one per-token rate (on the demo pair at k = 5: 3.5 predicted,
    4.7 committed) steers k too low. Every depth's counts decay with each row-step, and each
    h_j is shrunk toward h_(j-1) (h_1 toward 1 - acceptance) by PRIOR_ROWS pseudo row-steps:
    a depth no step has verified lately (the drafts beyond the current k, whose counts fade
    faster) is extrapolated from the deepest measured one instead of holding on to stale
    counts, which otherwise kept k stuck below its best after an early stretch of low
    acceptance. With no counts at all this is the geometric model at the group's acceptance,
    estimated per sequence (and pool-wide, as the prior for new sequences) as
    accepted / (accepted + rejections) over recent steps.
    Step cost at k >= 1 is modelled as rest + k x draft: a step's time besides its drafts
    (verification, acceptance, bookkeeping) and one draft forward, both moving averages (EMA)
    per batch-size bucket, updated together from every speculative step, whatever its k. Both
    are measured at the same moments, so the comparison of k's does not move with the host's
    speed: this host's speed swings by +-20% within seconds and one step's time differs from the
    next by 7% (median; 25% at the 90th percentile), more than neighbouring k's differ near the
    best (5-9% on the demo pair), and the earlier table of measured step times per k, each k
    timed at its own moments, compared k's at different speeds and settled one below its best
    (0.91 of the best fixed k at B = 1, timed tick by tick). The verification's width (k + 1
    columns) is taken not to change `rest`: measured, 19.3 vs 19.5 ms at widths 5 and 6 on the
    demo pair at B = 1, the regime of a launch- or memory-bound verifier; on a compute-bound
    verifier this favours a larger k. A plain step (k = 0) costs `plain` x rest, its own
    ratio measured at the rest of its moment; until measured it is taken as costly as rest. A
    bucket not measured yet borrows the nearest measured bucket's costs.
    Plain decoding is measured once per batch-size bucket, by one plain step right after the
    bucket's first speculative step: its cost cannot be told from speculative steps (on a
    compute-bound verifier a one-token step costs a fraction of a k + 1 wide one, on a
    memory-bound one about as much), and taking it as costly as `rest` kept a marginal draft
    speculating at B = 8 on a CPU at 0.91x autoregressive (an optimism bonus of 1.3 on that
    guess still lost to 1.66 tokens per step). Speculation is probed again after
    PROBE_EVERY plain steps, at the k most likely to pay, and twice as rarely each time a probe
    leads back to plain decoding.
    """

    # hysteresis: change k only for a 3% better expected rate. A step at another k costs nothing
    # beyond itself, and neighbouring k's near the best differ by 5-9% on the demo pair: a
    # wider margin (10% before) left k one below its best for good.
    GAIN_TO_SWITCH = 1.03
    PROBE_EVERY = 8         # plain steps before speculation is tried again (doubles up to 256)
    EMA = 0.1               # of a bucket's costs, per step measured there (~10 steps' memory)
    DECAY = 0.9             # of the pool-wide acceptance counts, per speculative step
    HAZARD_DECAY = 0.98     # of the per-draft counts, per row-step (a memory of ~50 row-steps)
    STALE_DECAY = 0.95      # of the counts of drafts beyond the step's k, per row-step
    PRIOR_ROWS = 2.0        # pseudo row-steps pulling a draft's hazard toward the one before it

    def __init__(self, max_k: int):
        self.max_k = max_k
        # per batch-size bucket, seconds: a speculative step besides its drafts, one draft
        # forward; and a plain step's time as a share of `rest` (module doc)
        self.rest: dict[int, float] = {}
        self.draft: dict[int, float] = {}
        self.plain: dict[int, float] = {}
        self.recent_accepted, self.recent_rejections = 7.0, 3.0   # prior: acceptance 0.7
        self.probe_every = self.PROBE_EVERY
        # decayed counts per draft depth j (index j - 1): rows whose draft j was verified, and
        # rows that rejected it
        self.verified = [0.0] * max_k
        self.rejected = [0.0] * max_k

    @property
    def acceptance(self) -> float:
        return self.recent_accepted / (self.recent_accepted + self.recent_rejections)

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << (batch - 1).bit_length()   # 1, 2, 4, 8, 16, ...

    def _measured(self, batch: int) -> int | None:
        """The bucket whose costs stand for this batch size: its own, else the nearest measured."""
        if not self.rest:
            return None
        here = self.bucket(batch)
        if here in self.rest:
            return here
        return min(self.rest, key=lambda b: abs(b.bit_length() - here.bit_length()))

    def cost(self, batch: int, k: int) -> float | None:
        """A step's estimated seconds at k (module doc); None before any speculative step."""
        b = self._measured(batch)
        if b is None:
            return None
        if k == 0:
            return self.plain.get(b, 1.0) * self.rest[b]
        return self.rest[b] + k * self.draft[b]

    def hazards(self, acceptance: float) -> list[float]:
        """h_1 .. h_max_k: each depth's measured rejection share, shrunk toward the depth before."""
        out, prior = [], 1.0 - min(max(acceptance, 0.0), 0.999)
        for verified, rejected in zip(self.verified, self.rejected):
            prior = (rejected + self.PRIOR_ROWS * prior) / (verified + self.PRIOR_ROWS)
            out.append(prior)
        return out

    def tokens_by_k(self, acceptance: float) -> list[float]:
        """Tokens a row-step commits at k = 0 .. max_k: 1 + the chances that drafts 1 .. k survive."""
        out, survive = [1.0], 1.0
        for h in self.hazards(acceptance):
            survive *= 1.0 - h
            out.append(out[-1] + survive)
        return out

    def choose(self, group: Group, cap: int) -> int:
        acceptance = group.acceptance(self.acceptance)
        batch = len(group)
        current = min(group.k if group.k is not None else cap, cap)
        tokens = self.tokens_by_k(acceptance)
        costs = [self.cost(batch, k) for k in range(cap + 1)]
        if costs[0] is None:
            return current   # nothing measured yet: the first step tells
        rates = [batch * tokens[k] / costs[k] for k in range(cap + 1)]
        if current == 0 and group.plain_steps_in_a_row >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, 256)
            # re-measure acceptance now and then, more rarely each time, at the k most likely
            # to pay (at low acceptance the cheapest probe, k = 1)
            return max(range(1, cap + 1), key=rates.__getitem__)
        here = self.bucket(batch)
        if here in self.rest and here not in self.plain:
            return 0   # plain decoding, unmeasured at this bucket: one step measures it
        best = max(range(cap + 1), key=rates.__getitem__)
        choice = best if rates[best] > rates[current] * self.GAIN_TO_SWITCH else current
        if choice > 0 and current > 0:
            self.probe_every = self.PROBE_EVERY   # speculation pays again: probe eagerly
        return choice

    def observe(self, batch: int, k: int, seconds: float, draft_seconds: float,
                accepted: list[int], proposed: list[int] | None = None) -> None:
        """A step at k took `seconds`, `draft_seconds` of them drafting; `proposed`: per row,
        the drafts it verified when rows differ (n-gram), else k each. A proposal that ended
        at n < k yielded nothing at depth n + 1: that depth counts as verified and rejected, so
        the hazards give what a row-step commits (a proposer that seldom matches yields little,
        and plain decoding wins where it is cheaper)."""
        b = self.bucket(batch)
        if k == 0:
            if b in self.rest:
                _ema(self.plain, b, seconds / self.rest[b], self.EMA)
            return
        _ema(self.rest, b, seconds - draft_seconds, self.EMA)
        _ema(self.draft, b, draft_seconds / k, self.EMA)
        proposed = proposed or [k] * len(accepted)
        self.recent_accepted = self.DECAY * self.recent_accepted + sum(accepted)
        self.recent_rejections = self.DECAY * self.recent_rejections + sum(
            a < n for a, n in zip(accepted, proposed))
        # depths beyond k measured an older regime: they fade faster than verified ones
        decays = [(self.HAZARD_DECAY if j < k else self.STALE_DECAY) ** len(accepted)
                  for j in range(self.max_k)]
        self.verified = [d * v for d, v in zip(decays, self.verified)]
        self.rejected = [d * r for d, r in zip(decays, self.rejected)]
        for a, n in zip(accepted, proposed):
            # drafts 1 .. a+1 were verified (depth n + 1 of a short proposal: nothing to accept)
            for j in range(min(a + 1, k)):
                self.verified[j] += 1.0
            if a < k:
                self.rejected[a] += 1.0


def _ema(table: dict, key, value: float, weight: float) -> None:
    """Move table[key] toward value by `weight` (the first value sets it)."""
    old = table.get(key)
    table[key] = value if old is None else old + weight * (value - old)


class Scheduler:
    def __init__(self, config: EngineConfig, proposer: Proposer, entries_for=lambda n: n,
                 allocation_for=lambda reservations, models: sum(reservations),
                 prefix: PrefixCaching | None = None):
        """`proposer`: what the scheduler reads of it is its capabilities (proposer.py)."""
        self.config = config
        self.prefix = prefix   # shared blocks count once (prefix_cache.py)
        self.speculative = proposer.proposes and config.speculative
        self.exspec = config.method == "exspec"
        self.adaptive = AdaptiveK(config.num_speculative_tokens) if (
            self.speculative and config.adaptive_k) else None
        stop = config.draft_stop   # 0: off, "auto", or a fixed confidence
        self.draft_stop = DraftStop(None if stop == "auto" else stop) if (
            self.adaptive is not None and stop and proposer.gives_confidences) else None
        self.entries_for = entries_for      # KV entries the layout allocates a row of n tokens
        self.allocation_for = allocation_for   # ... and a set of rows with these reservations
        self.models = 1 + len(proposer.kv_models)   # models whose caches every row fills

    # -- admission ----------------------------------------------------------------------------------
    def kv_peak(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
        """KV entries (all models, in whole allocation units) a sequence can ever hold:
        its last step starts at most at prompt + max_tokens - 1 committed tokens and appends up
        to k drafts (verification never reaches past max_model_len; see k_for)."""
        last = min(prompt_tokens + max_tokens, max_model_len)
        k = self.config.num_speculative_tokens if self.speculative else 0
        return self.models * self.entries_for(min(last - 1 + k, max_model_len))

    def reservation(self, seq: Sequence) -> int:
        return self.kv_peak(seq.num_prompt_tokens, seq.max_tokens, seq.max_model_len)

    def allocation(self, seqs: list[Sequence]) -> int:
        """KV entries the layout can come to allocate for these sequences: what admission
        holds within max_num_kv_tokens (not their use: a padded group allocates rows x its
        longest row, and a block store its scratch block too); a cached block several rows
        hold counts once."""
        shared = 0 if self.prefix is None else self.prefix.shared_entries()
        return self.allocation_for([self.reservation(s) for s in seqs], self.models) - shared

    def admit(self, waiting, admitted: list[Sequence],
              budget: int | None) -> list[tuple[Sequence, int]]:
        """Waiting sequences to admit now, in arrival order, with the prompt tokens each gets
        this tick (all of it, or 0 for a prompt longer than what is left, fed in chunks;
        `budget` = the tick's prefill tokens left, None = unlimited). A sequence is admitted only when what it can grow to fits beside the
        reservations of those already admitted, so the pool cannot run out of KV mid-generation
        (one that could never fit was refused at add_request)."""
        limit = self.config.max_num_seqs if self.exspec else self.config.max_batch_size
        room = min(limit - len(admitted), self.config.max_batch_size)
        kv_budget = self.config.max_num_kv_tokens
        holding = list(admitted)
        chosen = []
        for seq in waiting:
            if len(chosen) >= room or (budget is not None and budget <= 0):
                break
            hit = None if self.prefix is None else self.prefix.lookup(seq)
            held = 0 if hit is None else hit.held_entries   # cached blocks other rows hold
            if kv_budget is not None and self.allocation(holding + [seq]) - held > kv_budget:
                break   # waits, in order, for finishing sequences to free their reservations
            holding.append(seq)
            if hit is not None:   # its cached prefix is not fed again
                self.prefix.claim(seq, hit)
            left = seq.num_prompt_tokens - seq.num_cached_target
            # whole when it fits what the tick has left; a longer prompt gets none now: its
            # chunks come from what the budget leaves once the short ones are fed (pool.py)
            count = left if budget is None or left <= budget else 0
            budget = None if budget is None else budget - count
            chosen.append((seq, count))
        return chosen

    def prefill_budget(self, group: Group | None, k: int) -> int | None:
        """Prefill tokens this tick may feed beside the step it runs (vLLM's
        max_num_batched_tokens: prefill chunks and decode tokens together); None: no limit."""
        if self.config.max_num_batched_tokens is None:
            return None
        return self.config.max_num_batched_tokens - (len(group) * (k + 1) if group else 0)

    # -- choosing the step ----------------------------------------------------------------------------
    def choose(self, groups: list[Group]) -> Plan | None:
        if not groups:
            return None
        if not self.exspec:   # EQSPEC: every running row in one batch
            return Plan(list(groups))
        # The group to step: one holding a sequence at the fairness bound, else the one whose
        # rows waited longest, larger first.
        base = max(groups, key=lambda g: (g.max_skipped >= self.config.max_skipped_ticks,
                                          g.max_skipped, len(g)))
        chosen, size = [base], len(base)
        # Top the batch up with whole groups, equal lengths first (no padding, uniform writes).
        others = sorted((g for g in groups if g is not base),
                        key=lambda g: (g.length_spread_with(base), -g.max_skipped))
        for group in others:
            if size + len(group) <= self.config.max_batch_size:
                chosen.append(group)
                size += len(group)
        return Plan(chosen)

    def k_for(self, group: Group) -> int:
        if not self.speculative:
            return 0
        k = self.config.num_speculative_tokens
        caps = [s.params.num_speculative_tokens for s in group.seqs]
        if all(c is not None for c in caps):
            k = min(k, max(caps))
        # Verification feeds positions up to len-1+k, which must exist in both models. (No cap
        # by max_tokens: it would make a seeded request's k schedule, and so its samples,
        # depend on the other rows of its group.)
        k = max(0, min(k, min(s.max_model_len - s.num_tokens for s in group.seqs)))
        if self.adaptive is not None and k > 0:
            k = self.adaptive.choose(group, k)
        return k

    def stop_for(self, group: Group, k: int) -> list[float] | None:
        """The step's draft-stop thresholds per draft depth 1 .. k-1 (None: no stop)."""
        if self.draft_stop is None or k < 2:
            return None
        batch = len(group)
        hazards = self.adaptive.hazards(group.acceptance(self.adaptive.acceptance))
        return self.draft_stop.thresholds(k, hazards, lambda j: self.adaptive.cost(batch, j))

    def observe(self, group: Group, k: int, result: StepResult, seconds: float,
                draft_seconds: float) -> None:
        """A step planned at k ran result.k drafts (fewer when its round stopped early) in
        `seconds`, `draft_seconds` of them drafting: its cost and acceptance count at result.k;
        the group keeps k as its current choice."""
        group.k = k
        group.plain_steps_in_a_row = group.plain_steps_in_a_row + 1 if k == 0 else 0
        if self.adaptive is not None:
            self.adaptive.observe(len(group), result.k, seconds, draft_seconds, result.num_accepted,
                                  result.proposed)
        if self.draft_stop is not None and result.confidence_bins is not None:
            caps = [s.drafts_at(result.k) for s in group.seqs]
            self.draft_stop.observe(result.confidence_bins, result.num_accepted, caps)
