"""Scheduler: the policy half of the tick: whom to admit, which rows to step, with which k.

EQSPEC: all running rows form one batch (up to max_batch_size), realigned after every step.
EXSPEC: the pool holds up to max_num_seqs sequences in sticky groups; each tick steps one
group (topped up by merging smaller groups, equal lengths first, while the batch fits), never
leaving a sequence unstepped for more than max_skipped_ticks ticks. Ragged groups need no
realignment in EXSPEC's cache layout, so a group stays together until its rows finish.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineConfig
from .group import Group
from .sequence import Sequence


@dataclass
class Plan:
    groups: list[Group]   # stepped as one group (merged first when more than one)


class AdaptiveK:
    """k per group from measured acceptance and measured step cost, with hysteresis.

    Expected committed tokens per row-step at per-token acceptance a and k drafts:
    (1 - a^(k+1)) / (1 - a). The acceptance a is estimated per sequence (and pool-wide, as the
    prior for new sequences) as accepted / (accepted + rejections) over recent steps: each
    step accepts a run of drafts and ends in at most one rejection. Step cost per (batch size,
    k) is an exponential moving average of measured step times; an unmeasured (batch size, k)
    is tried once (an optimistic prior), so the table fills itself.
    """

    GAIN_TO_SWITCH = 1.10   # hysteresis: change k only for a 10% better expected rate
    PROBE_EVERY = 8         # plain steps before speculation is tried again
    EMA = 0.2
    DECAY = 0.9             # of the pool-wide acceptance counts, per speculative step

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.step_time: dict[tuple[int, int], float] = {}
        self.recent_accepted, self.recent_rejections = 7.0, 3.0   # prior: acceptance 0.7

    @property
    def acceptance(self) -> float:
        return self.recent_accepted / (self.recent_accepted + self.recent_rejections)

    def expected_tokens(self, acceptance: float, k: int) -> float:
        a = min(max(acceptance, 0.0), 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def rate(self, batch: int, k: int, acceptance: float) -> float:
        cost = self.step_time.get((batch, k))
        if cost is None:
            return float("inf")   # never measured: try it
        return batch * self.expected_tokens(acceptance, k) / cost

    def choose(self, group: Group, cap: int) -> int:
        acceptance = group.acceptance(self.acceptance)
        batch = len(group)
        current = min(group.k if group.k is not None else cap, cap)
        if current == 0 and group.plain_steps_in_a_row >= self.PROBE_EVERY:
            return cap   # re-measure acceptance now and then
        rates = {k: self.rate(batch, k, acceptance) for k in range(cap + 1)}
        best = max(rates, key=rates.get)
        if rates[best] > rates[current] * self.GAIN_TO_SWITCH:
            return best
        return current

    def observe(self, batch: int, k: int, seconds: float, accepted: list[int]) -> None:
        key = (batch, k)
        old = self.step_time.get(key)
        self.step_time[key] = seconds if old is None else old + self.EMA * (seconds - old)
        if k > 0:
            self.recent_accepted = self.DECAY * self.recent_accepted + sum(accepted)
            self.recent_rejections = (self.DECAY * self.recent_rejections
                                      + sum(a < k for a in accepted))


class Scheduler:
    def __init__(self, config: EngineConfig, has_draft: bool):
        self.config = config
        self.speculative = has_draft and config.speculative
        self.exspec = config.method == "exspec"
        self.adaptive = AdaptiveK(config.num_speculative_tokens) if (
            self.speculative and config.adaptive_k) else None

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, waiting, groups: list[Group]) -> list[Sequence]:
        """Waiting sequences to prefill now, in arrival order, within the pool's bounds."""
        running = sum(len(g) for g in groups)
        limit = self.config.max_num_seqs if self.exspec else self.config.max_batch_size
        room = min(limit - running, self.config.max_batch_size)
        budget = self.config.max_num_kv_tokens
        kv = sum(g.kv_tokens() for g in groups)
        models = 2 if self.speculative else 1
        chosen = []
        for seq in waiting:
            if len(chosen) >= room:
                break
            need = models * seq.num_tokens
            if budget is not None and kv + need > budget and (chosen or running):
                break   # wait for room (a lone request is admitted so it cannot starve)
            kv += need
            chosen.append(seq)
        return chosen

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

    def observe(self, group: Group, k: int, seconds: float, accepted: list[int]) -> None:
        group.k = k
        group.plain_steps_in_a_row = group.plain_steps_in_a_row + 1 if k == 0 else 0
        if self.adaptive is not None:
            self.adaptive.observe(len(group), k, seconds, accepted)

    def realign_after_step(self, group: Group) -> bool:
        return True
