"""SequencePool: every admitted, unfinished sequence with its caches, and the tick (DESIGN §3.5).

tick = admit (batched prefill) -> choose a group and its k -> step -> realign -> retire.
The policy lives in `scheduler.py`; this module only holds state and carries plans out.
"""
from __future__ import annotations

import time
import traceback

import torch
from collections import deque

from .config import EngineConfig
from .group import Group
from .outputs import TokenLogprob
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import Stats

Touched = tuple[Sequence, list[int], "list[TokenLogprob] | None"]


class SequencePool:
    def __init__(self, config: EngineConfig, runner: ModelRunner, stats: Stats):
        self.config = config
        self.runner = runner
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.groups: list[Group] = []
        self.scheduler = Scheduler(config, has_draft=runner.draft is not None)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(len(g) for g in self.groups)

    def kv_tokens(self) -> int:
        return sum(g.kv_tokens() for g in self.groups)

    # -- intake -------------------------------------------------------------------------------------
    def enqueue(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def abort(self, request_ids: set[str]) -> list[Touched]:
        touched = []
        if not request_ids:
            return touched
        for seq in [s for s in self.waiting if s.request_id in request_ids]:
            self.waiting.remove(seq)
            seq.finish("abort")
            touched.append((seq, [], None))
        for group in self.groups:
            hit = [s for s in group.seqs if s.request_id in request_ids]
            for seq in hit:
                seq.finish("abort")
                touched.append((seq, [], None))
        self._retire()
        return touched

    # -- the tick -----------------------------------------------------------------------------------
    def tick(self) -> list[Touched]:
        touched: list[Touched] = []
        with self.stats.timer("schedule"):
            admitted = self.scheduler.admit(self.waiting, self.groups)
        if admitted:
            touched += self._prefill(admitted)
        with self.stats.timer("schedule"):
            plan = self.scheduler.choose(self.groups)
        if plan is None:
            return touched
        with self.stats.timer("step"):   # the step's time includes forming its group
            group = self._merge(plan.groups) if len(plan.groups) > 1 else plan.groups[0]
            k = self.scheduler.k_for(group)
            touched += self._step(group, k)
        return touched

    def _prefill(self, seqs: list[Sequence]) -> list[Touched]:
        for seq in seqs:
            self.waiting.remove(seq)
        try:
            group = self.runner.prefill(seqs)
        except Exception:
            return self._fail(seqs, traceback.format_exc(limit=3))
        self.groups.append(group)
        touched = [(s, s.output_ids[-1:], s.logprobs[-1:] if s.params.logprobs is not None else None)
                   for s in seqs]
        self._retire()
        return touched

    def _merge(self, groups: list[Group]) -> Group:
        with self.stats.timer("realign"):
            merged, moved = Group.merge(groups, self.runner.target, self.runner.draft)
        self.stats.add("realign_bytes", moved)
        self.groups = [g for g in self.groups if g not in groups] + [merged]
        return merged

    def _step(self, group: Group, k: int) -> list[Touched]:
        seqs = list(group.seqs)
        before = [s.num_output_tokens for s in seqs]
        if group.equal_length:
            self.stats.add("equal_length_steps")
        if group.steps:   # stepped before with the same batched caches: nothing re-stacked
            self.stats.add("sticky_steps")
        try:
            # No device sync around it: the step ends in its one device-to-host copy, so
            # by the time it returns its GPU work is done.
            start, catch_up = time.perf_counter(), self.stats.seconds["prefill"]
            result = self.runner.step(group, k)
            # the step's cost at this k, without a one-off draft catch-up prefill
            seconds = time.perf_counter() - start - (self.stats.seconds["prefill"] - catch_up)
            self.scheduler.observe(group, k, seconds, result.num_accepted)
            group.steps += 1
            self._retire()
            if group in self.groups:   # EQSPEC realigns now; EXSPEC's layout has nothing to move
                with self.stats.timer("realign"):
                    moved = group.realign()
                self.stats.add("realign_bytes", moved)
                if moved:
                    self.stats.add("realign_steps")
        except Exception as exc:
            self.groups = [g for g in self.groups if g is not group]
            if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()   # the failed group's caches are gone; give memory back
            return self._fail(seqs, traceback.format_exc(limit=3))
        for other in self.groups:
            if other is not group:
                for s in other.seqs:
                    s.skipped_ticks += 1
        out = []
        for seq, n_before, new in zip(seqs, before, result.committed):
            seq.skipped_ticks = 0
            lp = seq.logprobs[n_before:] if seq.params.logprobs is not None else None
            out.append((seq, new, lp))
        return out

    def _retire(self) -> None:
        """Drop finished rows from their groups (and empty groups from the pool)."""
        kept = []
        for group in self.groups:
            rows = [i for i, s in enumerate(group.seqs) if not s.finished]
            if rows:
                with self.stats.timer("realign"):
                    moved = group.keep(rows)
                self.stats.add("realign_bytes", moved)
                kept.append(group)
        self.groups = kept

    def _fail(self, seqs: list[Sequence], error: str) -> list[Touched]:
        for seq in seqs:
            seq.finish("error", error)
        return [(s, [], None) for s in seqs]

    def fail_all(self, error: str) -> list[Touched]:
        seqs = [s for g in self.groups for s in g.seqs] + list(self.waiting)
        self.groups, self.waiting = [], deque()
        return self._fail(seqs, error)
