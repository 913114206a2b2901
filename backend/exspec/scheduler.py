"""Scheduler: the policy half of the tick: whom to admit, which rows to step, with which k."""
from __future__ import annotations

from dataclasses import dataclass

from .config import EngineConfig
from .group import Group
from .sequence import Sequence


@dataclass
class Plan:
    groups: list[Group]   # stepped as one group (merged first when more than one)
    k: int


class Scheduler:
    def __init__(self, config: EngineConfig, has_draft: bool):
        self.config = config
        self.speculative = has_draft and config.speculative

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, waiting, groups: list[Group]) -> list[Sequence]:
        """Waiting sequences to prefill now, in arrival order, within the pool's bounds."""
        running = sum(len(g) for g in groups)
        if self.config.method == "exspec":
            room = self.config.max_num_seqs - running
        else:   # eqspec / autoregressive: one running batch
            room = self.config.max_batch_size - running
        room = min(room, self.config.max_batch_size)
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
        # EQSPEC: every running row in one group, realigned after every step.
        return Plan(list(groups), 0)

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
        k = min(k, min(s.max_model_len - s.num_tokens for s in group.seqs))
        return max(k, 0)

    def realign_after_step(self, group: Group) -> bool:
        return True
