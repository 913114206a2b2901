"""Engine statistics (keys: design: "Names other parts rely on") and phase timers.

On a CPU a phase is wall time. On a GPU the work of a phase is only queued when its Python code
returns, and synchronising to time it would stall the device at every phase (16 host round
trips per step, counted). So a GPU phase records a pair of CUDA events on the stream instead,
and their elapsed times are read later, once the step's own device-to-host copy has made them
complete; `snapshot()` settles whatever is still outstanding."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

COUNTERS = ("steps", "equal_length_steps", "realign_steps", "plain_steps", "sticky_steps",
            "draft_stopped_steps",
            "draft_tokens", "accepted_tokens", "committed_tokens", "row_steps",
            "prefill_tokens_target", "prefill_tokens_draft", "realign_bytes", "isolated_rows",
            "cut_proposal_tokens", "draft_forwards", "indexed_tokens")
PHASES = ("schedule", "prefill", "draft", "verify", "realign", "step")


class Stats:
    def __init__(self, devices):
        """`devices`: every device the models use (a target spread by device_map has several)."""
        gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
        self.gpu = gpus[0] if gpus else None    # events on the engine's stream (its first GPU)
        self._pending: list[tuple[str, object, object]] = []   # (phase, start, end) events
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps_by_shape: dict[tuple[int, int], int] = {}   # (rows, k) -> steps
        # draft depth j (1-based) -> [row-drafts at depth j verified, of them kept]
        self.by_depth: dict[int, list[int]] = {}

    def add(self, key: str, value: int = 1) -> None:
        self.counts[key] += value

    def add_step(self, rows: int, k: int) -> None:
        self.steps_by_shape[rows, k] = self.steps_by_shape.get((rows, k), 0) + 1

    def add_depths(self, verified: list[int], accepted: list[int]) -> None:
        """Per row, its drafts verified and kept this step: counted by draft depth."""
        for v, a in zip(verified, accepted):
            for depth in range(1, v + 1):
                counts = self.by_depth.setdefault(depth, [0, 0])
                counts[0] += 1
                counts[1] += a >= depth

    @contextmanager
    def timer(self, phase: str):
        if self.gpu is not None:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(torch.cuda.current_stream(self.gpu))
            try:
                yield
            finally:
                end.record(torch.cuda.current_stream(self.gpu))
                self._pending.append((phase, start, end))
                self._settle(wait=False)
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start_s

    def _settle(self, wait: bool) -> None:
        """Add the elapsed time of every timed GPU phase whose end event has completed (all of
        them when `wait`), without waiting on the device otherwise."""
        still = []
        for phase, start, end in self._pending:
            if wait:
                end.synchronize()
            if wait or end.query():
                self.seconds[phase] += start.elapsed_time(end) / 1000.0
            else:
                still.append((phase, start, end))
        self._pending = still

    def phase_seconds(self, phase: str) -> float:
        """A phase's seconds so far, counting every timed GPU phase that has completed (after
        a step's device-to-host copy: all of that step's phases) without waiting on the device."""
        if self._pending:
            self._settle(wait=False)
        return self.seconds[phase]

    def snapshot(self, pool_seqs: int, pool_kv_tokens: int, queue_len: int,
                 pool_kv_tokens_allocated: int = 0, pool_kv_tokens_reserved: int = 0) -> dict:
        self._settle(wait=True)   # once per tick, after the step's own sync: nothing waits here
        c = self.counts
        out = {k: v for k, v in c.items() if k != "row_steps"}
        out["acceptance_rate"] = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None
        out["mean_accepted_length"] = c["committed_tokens"] / c["row_steps"] if c["row_steps"] else None
        out.update({f"time_{k}_s": v for k, v in self.seconds.items()})
        out.update(pool_seqs=pool_seqs, pool_kv_tokens=pool_kv_tokens, queue_len=queue_len,
                   pool_kv_tokens_allocated=pool_kv_tokens_allocated,
                   pool_kv_tokens_reserved=pool_kv_tokens_reserved)
        out["realign_share"] = (self.seconds["realign"] / self.seconds["step"]
                                if self.seconds["step"] else None)
        # for the benchmark's analytic ideal: how many steps ran at each (rows, k)
        out["steps_by_shape"] = [{"rows": r, "k": k, "steps": n}
                                 for (r, k), n in sorted(self.steps_by_shape.items())]
        # acceptance per draft position: of the row-drafts verified at depth j, those kept
        out["drafts_by_depth"] = [{"depth": d, "verified": v, "kept": kept}
                                  for d, (v, kept) in sorted(self.by_depth.items())]
        return out
