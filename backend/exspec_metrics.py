"""The DESIGN §3.8 Prometheus metrics, published through Triton's custom-metrics API.

Updated only on the adapter's send thread, off the engine's tick: request events come from the
outputs the send thread handles, engine counters from the stats snapshot the engine thread
attaches to each tick's outputs (counters advance by the snapshot's delta, so nothing is counted
twice and nothing is read from two threads). Labelled {model, version}.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

STEP_KINDS = {"equal_length": "equal_length_steps", "realign": "realign_steps",
              "plain": "plain_steps", "sticky": "sticky_steps"}
PHASES = ("schedule", "prefill", "draft", "verify", "realign", "step")
OUTCOMES = ("stop", "length", "abort", "cancelled", "error", "rejected")
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
PHASE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]


class Metrics:
    def __init__(self, model: str, version: str):
        labels = {"model": model, "version": str(version)}
        self._families = []

        def family(name, kind, description, buckets=None, **extra):
            fam = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families.append(fam)
            kwargs = {"buckets": buckets} if buckets is not None else {}
            return lambda **more: fam.Metric(labels={**labels, **extra, **more}, **kwargs)

        C, G, H = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
        requests = family("exspec:requests_total", C, "Finished requests by outcome")
        self.requests = {o: requests(outcome=o) for o in OUTCOMES}
        self.prompt_tokens = family("exspec:prompt_tokens_total", C, "Prompt tokens of finished requests")()
        self.generation_tokens = family("exspec:generation_tokens_total", C, "Generated tokens")()
        self.draft_tokens = family("exspec:draft_tokens_total", C, "Draft tokens proposed")()
        self.accepted_tokens = family("exspec:accepted_draft_tokens_total", C,
                                      "Draft tokens accepted by the target")()
        steps = family("exspec:steps_total", C, "Engine steps by kind (all = every step)")
        self.steps = {kind: steps(kind=kind) for kind in ("all", *STEP_KINDS)}
        self.realign_bytes = family("exspec:realign_bytes_total", C,
                                    "Bytes copied to form, split or realign groups")()
        self.running = family("exspec:num_requests_running", G, "Sequences in the pool")()
        self.waiting = family("exspec:num_requests_waiting", G, "Requests waiting for the pool")()
        self._kv_family = family("exspec:kv_cache_tokens", G, "KV cache entries held in the pool")
        self._kv = {}
        self.engine_up = family("exspec:engine_up", G,
                                "1 while the engine runs ticks; 0 once it died or a tick ran past "
                                "tick_timeout_s (every request then gets UNAVAILABLE)")()
        self.engine_up.set(1)
        self.k = family("exspec:num_speculative_tokens", G,
                        "Configured speculation length k (0: speculation off)")()
        self.ttft = family("exspec:time_to_first_token_seconds", H, "Time to first token",
                           LATENCY_BUCKETS)()
        self.tpot = family("exspec:time_per_output_token_seconds", H,
                           "Mean time per output token after the first, per request", LATENCY_BUCKETS)()
        self.e2e = family("exspec:e2e_request_latency_seconds", H, "Request latency, end to end",
                          LATENCY_BUCKETS)()
        phase = family("exspec:step_phase_seconds", H, "Time per engine step and phase", PHASE_BUCKETS)
        self.phase = {p: phase(phase=p) for p in PHASES}
        self._last: dict = {}

    # -- request events (send thread) ------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, outcome: str, prompt_tokens: int, output_tokens: int, e2e_s: float,
                 first_token_s: float | None) -> None:
        self.requests[outcome if outcome in self.requests else "error"].increment(1)
        self.prompt_tokens.increment(prompt_tokens)
        self.generation_tokens.increment(output_tokens)
        self.e2e.observe(e2e_s)
        if first_token_s is not None and output_tokens > 1:
            self.tpot.observe((e2e_s - first_token_s) / (output_tokens - 1))

    def rejected(self) -> None:
        self.requests["rejected"].increment(1)

    # -- engine snapshot after each tick (send thread) ---------------------------------------
    def tick(self, stats: dict, k: int) -> None:
        last = self._last or dict.fromkeys(stats, 0)
        delta = lambda key: (stats.get(key) or 0) - (last.get(key) or 0)   # noqa: E731
        self.steps["all"].increment(max(delta("steps"), 0))
        for kind, key in STEP_KINDS.items():
            self.steps[kind].increment(max(delta(key), 0))
        self.draft_tokens.increment(max(delta("draft_tokens"), 0))
        self.accepted_tokens.increment(max(delta("accepted_tokens"), 0))
        self.realign_bytes.increment(max(delta("realign_bytes"), 0))
        if delta("steps") > 0:
            for p in PHASES:
                spent = delta(f"time_{p}_s")
                if spent > 0:
                    self.phase[p].observe(spent)
        self.running.set(stats.get("pool_seqs", 0))
        self.waiting.set(stats.get("queue_len", 0))
        roles = {r: stats[f"pool_kv_tokens_{r}"] for r in ("target", "draft")
                 if f"pool_kv_tokens_{r}" in stats} or {"all": stats.get("pool_kv_tokens", 0)}
        for role, value in roles.items():
            if role not in self._kv:
                self._kv[role] = self._kv_family(role=role)
            self._kv[role].set(value)
        self.k.set(k)
        self._last = dict(stats)

    def idle(self) -> None:
        """Nothing in flight: the gauges say so even if no tick reported it."""
        self.running.set(0)
        self.waiting.set(0)
