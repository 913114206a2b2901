"""Fault injection for reliability tests, off unless model.json's `fault_injection` asks.

Nothing a client sends can turn it on. Keys (all optional):
  forward_error_every: N    every N-th model forward raises RuntimeError
  forward_oom_every: N      every N-th model forward raises torch.OutOfMemoryError
  tick_delay_s: S           every tick sleeps S seconds first (trips the adapter's tick_timeout_s)
  crash_after_ticks: N      the N-th tick raises EngineCrash, which no tick handler catches
  row_error_token: T        a step of a group holding a row whose prompt contains token id T
                            raises RuntimeError on reaching that row's commit, after the rows
                            before it committed theirs (a bug only one request triggers)
  row_prefill_error_token: T  the same in a prefill, after the target's forward
  admission_delay_s: S      add_request sleeps S seconds for a request whose prompt holds
                            admission_delay_token (a stand-in for a heavy grammar compile)
  admission_delay_token: T
"""
from __future__ import annotations

import time

import torch

KEYS = {"forward_error_every", "forward_oom_every", "tick_delay_s", "crash_after_ticks",
        "row_error_token", "row_prefill_error_token", "admission_delay_s", "admission_delay_token"}


class EngineCrash(BaseException):
    """An injected fault that kills the engine thread (BaseException: nothing catches it)."""


class Faults:
    def __init__(self, spec: dict | None):
        spec = dict(spec or {})
        unknown = set(spec) - KEYS
        if unknown:
            raise ValueError(f"unknown fault_injection keys: {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(KEYS))})")
        for key, value in spec.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"fault_injection.{key} must be a positive number, got {value!r}")
        self.spec = spec
        self.forwards = 0
        self.ticks = 0

    def before_forward(self) -> None:
        if not self.spec:
            return
        self.forwards += 1
        every = self.spec.get("forward_oom_every")
        if every and self.forwards % every == 0:
            raise torch.OutOfMemoryError("injected fault: out of memory in a model forward")
        every = self.spec.get("forward_error_every")
        if every and self.forwards % every == 0:
            raise RuntimeError("injected fault: exception in a model forward")

    def before_row(self, row, key: str = "row_error_token") -> None:
        token = self.spec.get(key)
        if token is not None and token in row.tokens[:row.num_prompt_tokens]:
            raise RuntimeError(f"injected fault: exception on a row whose prompt holds token {token}")

    def before_admission(self, prompt_ids: list[int]) -> None:
        """On the caller's thread (the adapter's submit threads), not the engine's."""
        if self.spec.get("admission_delay_token") in prompt_ids:
            time.sleep(self.spec.get("admission_delay_s", 0))

    def before_tick(self) -> None:
        if not self.spec:
            return
        self.ticks += 1
        if "tick_delay_s" in self.spec:
            time.sleep(self.spec["tick_delay_s"])
        if self.ticks == self.spec.get("crash_after_ticks"):
            raise EngineCrash("injected fault: the engine thread dies")
