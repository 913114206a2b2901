"""Engine statistics (DESIGN §3.8 keys) and phase timers that synchronise the device."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

COUNTERS = ("steps", "equal_length_steps", "realign_steps", "plain_steps", "sticky_steps",
            "draft_tokens", "accepted_tokens", "committed_tokens", "row_steps",
            "prefill_tokens_target", "prefill_tokens_draft", "realign_bytes")
PHASES = ("schedule", "prefill", "draft", "verify", "realign", "step")


class Stats:
    def __init__(self, devices):
        """`devices`: every device the models use (a target spread by device_map has several)."""
        gpus = [d for d in devices if torch.device(d).type == "cuda"]
        self.sync = lambda: [torch.cuda.synchronize(d) for d in gpus]
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps_by_shape: dict[tuple[int, int], int] = {}   # (rows, k) -> steps

    def add(self, key: str, value: int = 1) -> None:
        self.counts[key] += value

    def add_step(self, rows: int, k: int) -> None:
        self.steps_by_shape[rows, k] = self.steps_by_shape.get((rows, k), 0) + 1

    @contextmanager
    def timer(self, phase: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[phase] += time.perf_counter() - start

    def snapshot(self, pool_seqs: int, pool_kv_tokens: int, queue_len: int) -> dict:
        c = self.counts
        out = {k: v for k, v in c.items() if k != "row_steps"}
        out["acceptance_rate"] = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None
        out["mean_accepted_length"] = c["committed_tokens"] / c["row_steps"] if c["row_steps"] else None
        out.update({f"time_{k}_s": v for k, v in self.seconds.items()})
        out.update(pool_seqs=pool_seqs, pool_kv_tokens=pool_kv_tokens, queue_len=queue_len)
        out["realign_share"] = (self.seconds["realign"] / self.seconds["step"]
                                if self.seconds["step"] else None)
        # for the benchmark's analytic ideal: how many steps ran at each (rows, k)
        out["steps_by_shape"] = [{"rows": r, "k": k, "steps": n}
                                 for (r, k), n in sorted(self.steps_by_shape.items())]
        return out
