"""SequencePool: every admitted, unfinished sequence with its caches, and the tick
(design: "EXSPEC scheduling").

tick = choose a group and its k -> prefill short prompts (and a chunk that waited its bound)
within the tick's token budget -> [first tokens go out] -> step -> [its tokens go out] ->
the other chunks of long prompts with what the budget leaves.
The policy lives in `scheduler.py`; this module only holds state and carries plans out.
"""
from __future__ import annotations

import logging
import time
import traceback

import torch
from collections import deque

from ..config import EngineConfig
from ..outputs import TokenLogprob
from ..utils.stats import Stats
from .group import Group
from .prefix_caching import PrefixCaching
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger("exspec")

Touched = tuple[Sequence, list[int], "list[TokenLogprob] | None"]


class SequencePool:
    def __init__(self, config: EngineConfig, runner: ModelRunner, stats: Stats,
                 prefix: PrefixCaching | None = None):
        self.config = config
        self.prefix = prefix   # the block store's prefix cache, or None (off)
        self.runner = runner
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.groups: list[Group] = []
        # admitted sequences whose prompt is being fed in chunks, one row per group; each
        # joins `groups` once its last chunk produced its first token
        self.prefilling: list[Group] = []
        self.planned: tuple[Group, int] | None = None   # this tick's step (group, k), not yet run
        # this tick's chunks, not yet fed: the prompts under way due one and the budget they
        # share (None: unlimited); None when no chunk is due
        self.chunks_due: tuple[list[Group], int | None] | None = None
        self.scheduler = Scheduler(config, runner.proposer,
                                   entries_for=runner.kv_layout.entries_for,
                                   allocation_for=runner.kv_layout.allocation_for, prefix=prefix)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.admitted())

    def admitted(self) -> list[Sequence]:
        """Every sequence holding KV state: running, or with its prompt partly fed."""
        return [s for g in self.groups + self.prefilling for s in g.seqs]

    def kv_tokens(self) -> int:
        return sum(g.kv_tokens() for g in self.groups + self.prefilling)

    def kv_allocated(self) -> int:
        return sum(kv.allocated_tokens() for g in self.groups + self.prefilling for kv in g.caches())

    def kv_reserved(self) -> int:
        return self.scheduler.allocation(self.admitted())

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
        for group in self.groups + self.prefilling:
            hit = [s for s in group.seqs if s.request_id in request_ids]
            for seq in hit:
                seq.finish("abort")
                touched.append((seq, [], None))
        self._retire()
        return touched

    # -- the tick, in three parts --------------------------------------------------------------------
    # begin_tick chooses the step, then feeds the new prompts that fit the tick's token budget
    # (max_num_batched_tokens) whole; the engine sends their first tokens, finish_tick runs the
    # step, the engine sends its tokens, and only then feed_chunks spends what the budget leaves
    # on long prompts' chunks. A chunk thus never delays a short prompt's first token or a
    # step's tokens in its own tick, and chunks alternate with steps.
    def begin_tick(self) -> list[Touched]:
        with self.stats.timer("schedule"):
            plan = self.scheduler.choose(self.groups)
        if plan is not None:
            with self.stats.timer("step"):   # the step's time includes forming its group
                group = self._merge(plan.groups) if len(plan.groups) > 1 else plan.groups[0]
                self.planned = (group, self.scheduler.k_for(group))
        budget = self.scheduler.prefill_budget(*(self.planned or (None, 0)))
        # The prefill policy: the step's tokens are counted already; a prompt under way that has
        # waited max_skipped_ticks for its next chunk goes first, then new prompts that fit
        # whole, then (feed_chunks, after the step) the other prompts under way, oldest first.
        starved = [g for g in self.prefilling if g.seqs[0].skipped_ticks >= self.config.max_skipped_ticks]
        touched, budget = self._feed_chunks(starved, budget)
        with self.stats.timer("schedule"):
            admitted = self.scheduler.admit(self.waiting, self.admitted(), budget)
        whole = []
        for seq, count in admitted:
            self.waiting.remove(seq)
            if count:
                whole.append(seq)
            else:   # longer than what the tick has left: fed in chunks, from feed_chunks on
                group, failed = self._new_group([seq])
                touched += failed
                if group is not None:
                    self.prefilling.append(group)
        # short prompts (past any cached prefix): one batched forward; a row re-admitted
        # after a shared failure (`_isolate`) is prefilled on its own
        for seqs in [[s] for s in whole if s.isolated] + [[s for s in whole if not s.isolated]]:
            if not seqs:
                continue
            counts = [s.num_to_prefill - s.num_cached_target for s in seqs]
            budget = None if budget is None else budget - sum(counts)
            group, failed = self._new_group(seqs)
            touched += failed if group is None else self._prefill(group, counts)
        due = [g for g in self.prefilling if g not in starved]
        self.chunks_due = (due, budget) if due else None
        return touched

    def feed_chunks(self) -> list[Touched]:
        """The tick's last part: the prompts under way not fed yet, with what the budget left."""
        if self.chunks_due is None:
            return []
        (due, budget), self.chunks_due = self.chunks_due, None
        touched, _ = self._feed_chunks([g for g in due if g in self.prefilling], budget)  # not aborted since
        return touched

    def _feed_chunks(self, groups: list[Group], budget: int | None) -> tuple[list[Touched], int | None]:
        """Feed each prompt under way its next chunk, in order, while the budget lasts; one left
        without counts a tick more of waiting (skipped_ticks). Returns the budget left."""
        touched: list[Touched] = []
        for group in groups:
            seq = group.seqs[0]
            if budget is not None and budget <= 0:
                seq.skipped_ticks += 1
                continue
            left = seq.num_to_prefill - seq.num_cached_target
            count = left if budget is None else min(left, budget)
            budget = None if budget is None else budget - count
            seq.skipped_ticks = 0
            touched += self._prefill(group, [count])
        return touched, budget

    def _new_group(self, seqs: list[Sequence]) -> tuple[Group | None, list[Touched]]:
        """A group for admitted rows, or None and their outputs when its caches cannot be
        made (they have left `waiting` already: `_isolate` fails or re-queues them, so none is
        lost)."""
        try:
            group = self.runner.new_group(seqs)
        except Exception:
            if self.prefix is not None:
                self.prefix.drop_claims(seqs)
            return None, self._isolate(seqs, traceback.format_exc(limit=3))
        if self.prefix is not None:   # rows start from their cached prefix's blocks
            self.prefix.attach(group)
        return group, []

    def finish_tick(self) -> list[Touched]:
        if self.planned is None:
            return []
        (group, k), self.planned = self.planned, None
        if group not in self.groups:   # every row was retired meanwhile
            return []
        with self.stats.timer("step"):
            return self._step(group, k)

    def _prefill(self, group: Group, counts: list[int]) -> list[Touched]:
        """Feed a group the next counts[i] prompt tokens of its rows; the rows have either all
        finished their prompt after it (the group joins the running ones) or none."""
        before = [s.num_output_tokens for s in group.seqs]
        try:
            done = self.runner.prefill(group, counts)
        except Exception:
            if group in self.prefilling:
                self.prefilling.remove(group)
            return self._isolate(group.seqs, traceback.format_exc(limit=3), before)
        if self.prefix is not None:
            self.prefix.register(group)
        if not all(done):
            if group not in self.prefilling:
                self.prefilling.append(group)
            return []
        if group in self.prefilling:
            self.prefilling.remove(group)
        self.groups.append(group)
        touched = [self._since(s, n) for s, n in zip(group.seqs, before)
                   if s.num_output_tokens > n or s.finished]   # first tokens (a re-admitted row has none)
        self._retire()
        return touched

    def _merge(self, groups: list[Group]) -> Group:
        with self.stats.timer("realign"):
            merged, moved = Group.merge(groups, self.runner.target)
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
            start = time.perf_counter()
            catch_up, drafting = (self.stats.phase_seconds(p) for p in ("prefill", "draft"))
            result = self.runner.step(group, k, self.scheduler.stop_for(group, k),
                                      self.scheduler.pricing(group))
            # the step's cost at this k, without a one-off draft catch-up prefill
            seconds = time.perf_counter() - start - (self.stats.phase_seconds("prefill") - catch_up)
            self.scheduler.observe(group, k, result, seconds, self.stats.phase_seconds("draft") - drafting)
            group.steps += 1
            for seq in seqs:
                seq.isolated = False   # it stepped: it may share steps again
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
            return self._isolate(seqs, traceback.format_exc(limit=3), before)
        for other in self.groups:
            if other is not group:
                for s in other.seqs:
                    s.skipped_ticks += 1
        for seq in seqs:
            seq.skipped_ticks = 0
        return [self._since(s, n) for s, n in zip(seqs, before)]

    @staticmethod
    def _since(seq: Sequence, before: int) -> Touched:
        """A row's output tokens (and logprobs, if asked for) after its first `before`."""
        return seq, seq.output_ids[before:], seq.logprobs[before:] if seq.params.logprobs is not None else None

    def _retire(self) -> None:
        """Drop finished rows from their groups (and empty groups from the pool)."""
        self.groups = self._without_finished(self.groups)
        self.prefilling = self._without_finished(self.prefilling)

    def _without_finished(self, groups: list[Group]) -> list[Group]:
        kept = []
        for group in groups:
            rows = [i for i, s in enumerate(group.seqs) if not s.finished]
            if self.prefix is not None and len(rows) < len(group):   # leaving rows' blocks stay cached
                self.prefix.register(group)
            if rows:
                with self.stats.timer("realign"):
                    moved = group.keep(rows)
                self.stats.add("realign_bytes", moved)
                kept.append(group)
        return kept

    def _isolate(self, seqs: list[Sequence], error: str, before: list[int] | None = None) -> list[Touched]:
        """Making, prefilling or stepping the group of `seqs` raised `error` (`before`: their
        output counts before it; what they committed since is theirs and goes out now, once).
        A row alone ends with the error. Rows together may have met one row's fault (a request
        only it triggers) or a passing one (out of memory at that batch size), and which cannot
        be told: each unfinished row lets go of its caches and returns to the front of the
        queue, to be prefilled again (prompt and output, `Sequence.num_to_prefill`) and stepped
        on its own until a step succeeds (Scheduler.choose). So only a row that fails alone ends
        with the error, and the others stay exact: their KV is computed again from the same
        tokens, and a seeded row's noise is keyed by position (design: "Failure isolation")."""
        before = before or [s.num_output_tokens for s in seqs]
        alone = len(seqs) == 1
        touched, again = [], []
        for seq, n in zip(seqs, before):
            if alone:
                seq.finish("error", error)
            elif not seq.finished:
                seq.num_cached_target, seq.skipped_ticks, seq.isolated = 0, 0, True
                again.append(seq)
            if seq.num_output_tokens > n or seq.finished:
                touched.append(self._since(seq, n))
        self.waiting.extendleft(reversed(again))
        self.stats.add("isolated_rows", len(again))
        cause = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        if alone:
            log.warning("exspec: request %s failed on its own and ended with the error: %s",
                        seqs[0].request_id, cause)
        elif again:   # a counter alone would hide a bug that every shared step meets
            log.warning("exspec: a step shared by %d rows failed (%s); %d unfinished rows run on "
                        "their own until they step again", len(seqs), cause, len(again))
        return touched

    def _fail(self, seqs: list[Sequence], error: str) -> list[Touched]:
        for seq in seqs:
            seq.finish("error", error)
        return [(s, [], None) for s in seqs]

    def fail_all(self, error: str) -> list[Touched]:
        seqs = self.admitted() + list(self.waiting)
        self.groups, self.prefilling, self.waiting, self.planned = [], [], deque(), None
        self.chunks_due = None
        if self.prefix is not None:
            self.prefix.drop_claims()
        return self._fail(seqs, error)
