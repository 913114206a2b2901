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
    Step cost is an exponential moving average of measured step times per (batch-size bucket,
    k), kept relative to the machine's speed. A host's speed drifts (this CI machine's by +-15%
    over minutes, every op alike), and costs measured at different moments would otherwise
    compare k's at different speeds: a k timed in a slow minute lost to a stale, fast timing of
    its neighbour, and k moved off its best with nothing changed but the machine. So each
    step's time against its own k's cost moves `speed` (SPEED_EMA) more than that cost (EMA),
    and a drift shifts every k alike. What one k's timings alone cannot tell apart from a drift
    (that k, and only it, got costlier) is settled by a refresh: after REFRESH_EVERY steps
    without a timing of the runner-up, one step runs at it, and that timing, taken at today's
    speed, replaces most of its stale cost (REFRESH_WEIGHT). A bucket not yet measured at some k borrows the nearest measured bucket's cost at that k
    (scaled by their plain-step costs), a k measured nowhere is interpolated in k from the
    bucket's measured k's (each extra draft token adds one draft forward and one verified
    column), and only a k that cannot be estimated at all is tried blind, so the table fills
    itself.
    Exploration is optimistic, not blind: a k not yet measured at this batch size counts
    EXPLORE_BONUS better than its estimate, so a close contender is tried and a clearly worse
    one (a costly draft at low acceptance) is not. Speculation is probed again after
    PROBE_EVERY plain steps, at the k most likely to pay, and twice as rarely each time a probe
    leads back to plain decoding.
    """

    GAIN_TO_SWITCH = 1.10   # hysteresis: change k only for a 10% better expected rate
    EXPLORE_BONUS = 1.30    # optimism for a k not yet measured at this batch size
    PROBE_EVERY = 8         # plain steps before speculation is tried again (doubles up to 256)
    EMA = 0.03              # of a (bucket, k)'s cost, per step measured at it
    SPEED_EMA = 0.3         # of the machine's speed, per step (geometric)
    REFRESH_EVERY = 32      # steps (this AdaptiveK's) before the runner-up k is timed again
    REFRESH_WEIGHT = 0.5    # of a refreshed timing against the stale cost it replaces
    DECAY = 0.9             # of the pool-wide acceptance counts, per speculative step
    HAZARD_DECAY = 0.98     # of the per-draft counts, per row-step (a memory of ~50 row-steps)
    STALE_DECAY = 0.95      # of the counts of drafts beyond the step's k, per row-step
    PRIOR_ROWS = 2.0        # pseudo row-steps pulling a draft's hazard toward the one before it

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.step_time: dict[tuple[int, int], float] = {}   # (bucket, k) -> seconds at speed 1
        self.speed = 1.0   # how much slower the machine runs now than when costs began
        self.steps = 0     # observed steps, the clock of `timed_at`
        self.timed_at: dict[tuple[int, int], int] = {}     # (bucket, k) -> step of its last timing
        self.refresh_k: int | None = None   # the k of the last choice, if it was a refresh
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

    def cost(self, batch: int, k: int) -> float | None:
        """Measured, or estimated from other measurements; None if k was never measured."""
        here = self.bucket(batch)
        if (here, k) in self.step_time:
            return self.step_time[here, k]
        measured = [b for (b, kk) in self.step_time if kk == k]
        if not measured:
            return self._interpolate(here, k)
        # Borrow from the nearest bucket that measured k, scaled by a k' both buckets measured
        # (step cost is far from linear in batch size, so never scale by the size ratio).
        for near in sorted(measured, key=lambda b: abs(b.bit_length() - here.bit_length())):
            for (b, ref), t_here in self.step_time.items():
                if b == here and (near, ref) in self.step_time:
                    return self.step_time[near, k] * t_here / self.step_time[near, ref]
        return self.step_time[min(measured, key=lambda b: abs(b.bit_length() - here.bit_length())), k]

    def _interpolate(self, bucket: int, k: int) -> float | None:
        """Linear in k through the two measured k's of this bucket nearest to k; None with
        fewer than two."""
        ks = sorted((kk for (b, kk) in self.step_time if b == bucket), key=lambda kk: abs(kk - k))
        if len(ks) < 2:
            return None
        k1, k2 = sorted(ks[:2])
        t1, t2 = self.step_time[bucket, k1], self.step_time[bucket, k2]
        return max(t1 + (t2 - t1) * (k - k1) / (k2 - k1), min(t1, t2) * 0.5)

    def hazards(self, acceptance: float) -> list[float]:
        """h_1 .. h_max_k: each depth's measured rejection share, shrunk toward the depth before."""
        out, prior = [], 1.0 - min(max(acceptance, 0.0), 0.999)
        for verified, rejected in zip(self.verified, self.rejected):
            prior = (rejected + self.PRIOR_ROWS * prior) / (verified + self.PRIOR_ROWS)
            out.append(prior)
        return out

    def tokens_per_row_step(self, acceptance: float, k: int) -> float:
        """Tokens a row-step at k commits: 1 + the chances that drafts 1, 2, .., k survive."""
        total, survive = 1.0, 1.0
        for h in self.hazards(acceptance)[:k]:
            survive *= 1.0 - h
            total += survive
        return total

    def rate(self, batch: int, k: int, acceptance: float) -> float:
        cost = self.cost(batch, k)
        if cost is None:
            return float("inf")   # never measured: try it
        return batch * self.tokens_per_row_step(acceptance, k) / cost

    def choose(self, group: Group, cap: int) -> int:
        acceptance = group.acceptance(self.acceptance)
        batch = len(group)
        current = min(group.k if group.k is not None else cap, cap)
        rates = {k: self.rate(batch, k, acceptance) for k in range(cap + 1)}
        if current == 0 and group.plain_steps_in_a_row >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, 256)
            # re-measure acceptance now and then, more rarely each time, at the k most likely
            # to pay (at low acceptance the cheapest probe, k = 1)
            return max(range(1, cap + 1), key=rates.get)
        # Local exploration: plain decoding and the neighbours of the current k are tried at
        # this batch size when their estimates, taken optimistically, could beat a measurement.
        here = self.bucket(batch)
        if (here, current) in self.step_time:
            for k in {0, max(current - 1, 0), min(current + 1, cap)}:
                if (here, k) not in self.step_time:
                    rates[k] *= self.EXPLORE_BONUS
        best = max(rates, key=rates.get)
        choice = best if rates[best] > rates[current] * self.GAIN_TO_SWITCH else current
        if choice > 0 and current > 0:
            self.probe_every = self.PROBE_EVERY   # speculation pays again: probe eagerly
        self.refresh_k = None
        if choice == current > 0:
            runner_up = max((k for k in rates if k != current), key=rates.get, default=None)
            if runner_up is not None and self._stale((here, runner_up)):
                self.refresh_k = runner_up   # one step, to compare both at today's speed;
                return runner_up             # the group's current k stays (Scheduler.observe)
        return choice

    def _stale(self, key: tuple[int, int]) -> bool:
        """Timed once, but not in the last REFRESH_EVERY steps."""
        return key in self.timed_at and self.steps - self.timed_at[key] > self.REFRESH_EVERY

    def observe(self, batch: int, k: int, seconds: float, accepted: list[int]) -> None:
        key = (self.bucket(batch), k)
        old = self.step_time.get(key)
        if old is None:
            self.step_time[key] = seconds / self.speed
        elif self._stale(key):   # a refresh: its cost is what is out of date, not the speed
            self.step_time[key] = old + self.REFRESH_WEIGHT * (seconds / self.speed - old)
        else:
            self.speed *= (seconds / (old * self.speed)) ** self.SPEED_EMA
            self.step_time[key] = old + self.EMA * (seconds / self.speed - old)
        self.steps += 1
        self.timed_at[key] = self.steps
        if k > 0:
            self.recent_accepted = self.DECAY * self.recent_accepted + sum(accepted)
            self.recent_rejections = (self.DECAY * self.recent_rejections
                                      + sum(a < k for a in accepted))
            # depths beyond k measured an older regime: they fade faster than verified ones
            decays = [(self.HAZARD_DECAY if j < k else self.STALE_DECAY) ** len(accepted)
                      for j in range(self.max_k)]
            self.verified = [d * v for d, v in zip(decays, self.verified)]
            self.rejected = [d * r for d, r in zip(decays, self.rejected)]
            for a in accepted:
                for j in range(min(a + 1, k, self.max_k)):   # drafts 1 .. a+1 were verified
                    self.verified[j] += 1.0
                if a < k:
                    self.rejected[a] += 1.0


class Scheduler:
    def __init__(self, config: EngineConfig, has_draft: bool, entries_for=lambda n: n):
        self.config = config
        self.speculative = has_draft and config.speculative
        self.exspec = config.method == "exspec"
        self.adaptive = AdaptiveK(config.num_speculative_tokens) if (
            self.speculative and config.adaptive_k) else None
        stop = config.draft_stop   # 0: off, "auto", or a fixed confidence
        self.draft_stop = DraftStop(None if stop == "auto" else stop) if (
            self.adaptive is not None and stop) else None
        self.entries_for = entries_for      # KV entries the layout allocates a row of n tokens
        self.models = 2 if has_draft else 1   # the runner prefills the draft whenever it has one

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

    def admit(self, waiting, admitted: list[Sequence],
              budget: int | None) -> list[tuple[Sequence, int]]:
        """Waiting sequences to admit now, in arrival order, with the prompt tokens each gets
        this tick (all of it, or a first chunk of it; `budget` = the tick's prefill tokens left,
        None = unlimited). A sequence is admitted only when what it can grow to fits beside the
        reservations of those already admitted, so the pool cannot run out of KV mid-generation
        (one that could never fit was refused at add_request)."""
        limit = self.config.max_num_seqs if self.exspec else self.config.max_batch_size
        room = min(limit - len(admitted), self.config.max_batch_size)
        kv_budget = self.config.max_num_kv_tokens
        reserved = sum(self.reservation(s) for s in admitted)
        chosen = []
        for seq in waiting:
            if len(chosen) >= room or (budget is not None and budget <= 0):
                break
            need = self.reservation(seq)
            if kv_budget is not None and reserved + need > kv_budget:
                break   # waits, in order, for finishing sequences to free their reservations
            reserved += need
            count = seq.num_prompt_tokens if budget is None else min(seq.num_prompt_tokens, budget)
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

    def observe(self, group: Group, k: int, result: StepResult, seconds: float) -> None:
        """A step planned at k ran result.k drafts (fewer when its round stopped early): its
        cost and acceptance count at result.k; the group keeps k as its current choice (a
        refresh's k excepted: that step only re-timed the runner-up)."""
        if self.adaptive is None or self.adaptive.refresh_k != k:
            group.k = k
        group.plain_steps_in_a_row = group.plain_steps_in_a_row + 1 if k == 0 else 0
        if self.adaptive is not None:
            self.adaptive.observe(len(group), result.k, seconds, result.num_accepted)
        if self.draft_stop is not None and result.confidence_bins is not None:
            caps = [s.drafts_at(result.k) for s in group.seqs]
            self.draft_stop.observe(result.confidence_bins, result.num_accepted, caps)
