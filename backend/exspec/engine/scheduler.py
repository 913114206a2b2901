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

from ..config import EngineConfig
from ..spec.draft_stop import DraftStop
from ..spec.proposer import Proposer
from .adaptive_k import AdaptiveK, StepPricing
from .group import Group
from .prefix_caching import PrefixCaching
from .sequence import Sequence

if TYPE_CHECKING:
    from .runner import StepResult


@dataclass
class Plan:
    groups: list[Group]   # stepped as one group (merged first when more than one)


class Scheduler:
    def __init__(self, config: EngineConfig, proposer: Proposer, entries_for=lambda n: n,
                 allocation_for=lambda reservations, models: sum(reservations),
                 prefix: PrefixCaching | None = None):
        """`proposer`: what the scheduler reads of it is its capabilities (proposer.py)."""
        self.config = config
        self.prefix = prefix   # shared blocks count once (prefix_caching.py)
        self.speculative = proposer.proposes and config.speculative
        self.per_step = proposer.proposes_on_host   # adaptive k prices each step's proposals
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
            left = seq.num_to_prefill - seq.num_cached_target
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
        alone = [g for g in groups if g.isolated]
        if alone:   # a row re-admitted after a shared failure: stepped on its own (pool.py)
            return Plan(alone[:1])
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
        # Verification feeds positions up to len-1+k, which must exist in both models.
        k = max(0, min(k, min(s.max_model_len - s.num_tokens for s in group.seqs)))
        # Each row drafts no more than the tokens it has left (Sequence.drafts_at), so the group
        # needs no more than its rows' most. Only under gumbel: its noise is keyed by position,
        # so a row's samples do not depend on k; rejection sampling draws a row's uniforms per
        # step width, and a cap there would make its samples depend on its neighbours' lengths.
        if self.config.sampling_coupling == "gumbel":
            k = min(k, max(s.tokens_left for s in group.seqs))
        if self.adaptive is not None and k > 0:
            k = self.adaptive.choose(group, k, self.per_step)
        return k

    def pricing(self, group: Group) -> StepPricing | None:
        """How a step prices what its proposer plans (StepPricing), or None: fixed k, or the
        first speculative step after a plain one (adaptive k's probe: it is there to measure,
        so it verifies the proposals whole)."""
        if self.adaptive is None or group.k == 0:
            return None
        return self.adaptive.pricing(len(group))

    def stop_for(self, group: Group, k: int):
        """The step's draft stop (draft_stop.RoundStop; None: no stop)."""
        if self.draft_stop is None or k < 2:
            return None
        batch = len(group)
        hazards = self.adaptive.hazards(group.acceptance(self.adaptive.acceptance))
        return self.draft_stop.round(k, hazards, lambda j: self.adaptive.cost(batch, j))

    def observe(self, group: Group, k: int, result: StepResult, seconds: float,
                draft_seconds: float) -> None:
        """A step planned at k ran result.k drafts (fewer when its round stopped early) in
        `seconds`, `draft_seconds` of them drafting: its cost and acceptance count at result.k;
        the group keeps k as its current choice."""
        group.k = k
        group.plain_steps_in_a_row = group.plain_steps_in_a_row + 1 if k == 0 else 0
        if self.adaptive is not None:
            self.adaptive.observe(len(group), result.k, seconds, draft_seconds, result.num_accepted,
                                  result.proposed, result.lengths)
        if self.draft_stop is not None and result.confidence_bins is not None:
            self.draft_stop.observe(result.confidence_bins, result.num_accepted, result.verified)
