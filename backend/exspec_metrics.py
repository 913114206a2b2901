"""The Prometheus metrics (design: "Names other parts rely on"), published through Triton's custom-metrics API.

Updated only on the adapter's send thread, off the engine's tick: request events come from the
outputs the send thread handles, engine counters from the stats snapshot the engine thread
attaches to each tick's outputs (counters advance by the snapshot's delta, so nothing is counted
twice and nothing is read from two threads). Labelled {model, version}.
"""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

STEP_KINDS = {"equal_length": "equal_length_steps", "realign": "realign_steps",
              "plain": "plain_steps", "sticky": "sticky_steps",
              "draft_stopped": "draft_stopped_steps"}
PHASES = ("schedule", "prefill", "draft", "verify", "realign", "step")
OUTCOMES = ("stop", "length", "abort", "cancelled", "error", "rejected")
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
PHASE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
# The vLLM backend's buckets for its vllm: families (its src/utils/metrics.py)
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


def _kinds():
    """Counter, gauge, histogram: pb_utils has MetricFamily only once the stub runs the model."""
    return pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM


class _Families:
    """Metric families labelled {model, version}; kept alive as long as their metrics."""

    def __init__(self, model: str, version: str):
        self.labels = {"model": model, "version": str(version)}
        self.families = []

    def __call__(self, name, kind, description, buckets=None, **extra):
        fam = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self.families.append(fam)
        kwargs = {"buckets": buckets} if buckets is not None else {}
        return lambda **more: fam.Metric(labels={**self.labels, **extra, **more}, **kwargs)


class VllmMetrics:
    """The vLLM backend's `vllm:` families with its meaning and buckets, published when
    config.pbtxt sets REPORT_CUSTOM_METRICS (as for that backend), so its dashboards and alerts
    work unchanged. Time per output token is one observation per token after the first."""

    def __init__(self, family: _Families, max_model_len: int):
        C, _, H = _kinds()
        self.prompt_tokens = family("vllm:prompt_tokens_total", C, "Number of prefill tokens processed.")()
        self.generation_tokens = family("vllm:generation_tokens_total", C,
                                        "Number of generation tokens processed.")()
        self.ttft = family("vllm:time_to_first_token_seconds", H,
                           "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS)()
        self.tpot = family("vllm:time_per_output_token_seconds", H,
                           "Histogram of time per output token in seconds.", VLLM_TPOT_BUCKETS)()
        self.e2e = family("vllm:e2e_request_latency_seconds", H,
                          "Histogram of end to end request latency in seconds.", VLLM_E2E_BUCKETS)()
        self.request_prompt_tokens = family("vllm:request_prompt_tokens", H,
                                            "Number of prefill tokens processed.",
                                            one_two_five_buckets(max_model_len))()
        self.request_generation_tokens = family("vllm:request_generation_tokens", H,
                                                "Number of generation tokens processed.",
                                                one_two_five_buckets(max_model_len))()
        self.request_n = family("vllm:request_params_n", H, "Histogram of the n request parameter.",
                                [1, 2, 5, 10, 20])()
        # vLLM counts both in prompt tokens: looked up, and found cached (as scraped, with _total)
        self.prefix_cache = {
            "queries": family("vllm:prefix_cache_queries_total", C,
                              "Prefix cache queries, in terms of number of queried tokens.")(),
            "hits": family("vllm:prefix_cache_hits_total", C,
                           "Prefix cache hits, in terms of number of cached tokens.")()}

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.increment(prompt_tokens)

    def tokens(self, count: int, since_last_s: float | None) -> None:
        """`count` tokens reached the adapter together, `since_last_s` after the request's
        previous ones (None: the first output, whose first token has no predecessor)."""
        self.generation_tokens.increment(count)
        gaps = [0.0] * (count - 1) if since_last_s is None else [since_last_s / count] * count
        for gap in gaps:
            self.tpot.observe(gap)

    def finished(self, prompt_tokens: int, output_tokens: int, e2e_s: float, n: int) -> None:
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(output_tokens)
        self.request_n.observe(n)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's request-size buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model: str, version: str, vllm_max_model_len: int | None = None):
        """vllm_max_model_len: also publish the vLLM backend's families (REPORT_CUSTOM_METRICS)."""
        family = _Families(model, version)
        self._families = family   # never read: holds the families as long as their metrics
        C, G, H = _kinds()
        self.vllm = VllmMetrics(family, vllm_max_model_len) if vllm_max_model_len else None
        requests = family("exspec:requests_total", C, "Finished requests by outcome")
        self.requests = {o: requests(outcome=o) for o in OUTCOMES}
        self.prompt_tokens = family("exspec:prompt_tokens_total", C, "Prompt tokens of finished requests")()
        self.generation_tokens = family("exspec:generation_tokens_total", C, "Generated tokens")()
        # the engine's draft_tokens / accepted_tokens: what the responses' total_draft_tokens
        # and total_accepted_draft_tokens count (Sequence.count_drafts)
        self.draft_tokens = family("exspec:draft_tokens_total", C,
                                   "Draft tokens verified, at positions the output reached")()
        self.accepted_tokens = family("exspec:accepted_draft_tokens_total", C,
                                      "Draft tokens accepted by the target and kept in the output")()
        steps = family("exspec:steps_total", C, "Engine steps by kind (all = every step)")
        self.steps = {kind: steps(kind=kind) for kind in ("all", *STEP_KINDS)}
        self.realign_bytes = family("exspec:realign_bytes_total", C,
                                    "Bytes copied to form, split or realign groups")()
        self.isolated_rows = family("exspec:isolated_rows_total", C,
                                    "Rows prefilled again and stepped alone after a prefill or "
                                    "step they shared with other rows raised")()
        self.prefix_cache = {
            "queries": family("exspec:prefix_cache_queries_total", C,
                              "Prompt tokens of admitted requests looked up in the prefix cache")(),
            "hits": family("exspec:prefix_cache_hits_total", C,
                           "Of them, tokens found cached: neither model prefilled them")()}
        self.prefix_cache_blocks = family("exspec:prefix_cache_blocks", G,
                                          "KV blocks in the prefix cache, all models (held or not)")()
        self.running = family("exspec:num_requests_running", G, "Sequences in the pool")()
        self.waiting = family("exspec:num_requests_waiting", G, "Requests waiting for the pool")()
        self._kv_family = family("exspec:kv_cache_tokens", G, "KV cache entries in the pool, by role: "
                                 "all (used), allocated, reserved")
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
    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        if self.vllm:
            self.vllm.first_token(seconds, prompt_tokens)

    def tokens(self, count: int, since_last_s: float | None) -> None:
        if self.vllm:
            self.vllm.tokens(count, since_last_s)

    def finished(self, outcome: str, prompt_tokens: int, output_tokens: int, e2e_s: float,
                 first_token_s: float | None, n: int = 1) -> None:
        """One request ended; `output_tokens` counts all its `n` samples' tokens, which are
        decoded side by side: the time per output token is per sample."""
        self.prompt_tokens.increment(prompt_tokens)
        self.generation_tokens.increment(output_tokens)
        self.e2e.observe(e2e_s)
        per_sample = output_tokens / n
        if first_token_s is not None and per_sample > 1:
            self.tpot.observe((e2e_s - first_token_s) / (per_sample - 1))
        if self.vllm:
            self.vllm.finished(prompt_tokens, output_tokens, e2e_s, n)
        # last: a scrape that sees the request counted sees everything else it recorded
        self.requests[outcome if outcome in self.requests else "error"].increment(1)

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
        self.isolated_rows.increment(max(delta("isolated_rows"), 0))
        for kind in ("queries", "hits"):
            grown = max(delta(f"prefix_cache_{kind}"), 0)
            self.prefix_cache[kind].increment(grown)
            if self.vllm:
                self.vllm.prefix_cache[kind].increment(grown)
        self.prefix_cache_blocks.set(stats.get("prefix_cache_blocks") or 0)
        if delta("steps") > 0:
            for p in PHASES:
                spent = delta(f"time_{p}_s")
                if spent > 0:
                    self.phase[p].observe(spent)
        self.running.set(stats.get("pool_seqs", 0))
        self.waiting.set(stats.get("queue_len", 0))
        # all: entries held for real tokens; allocated: what the cache tensors hold room for;
        # reserved: what admitted requests may grow to (admission keeps it within the budget)
        roles = {"all": stats.get("pool_kv_tokens", 0)}
        roles.update({r: stats[f"pool_kv_tokens_{r}"] for r in ("allocated", "reserved")
                      if f"pool_kv_tokens_{r}" in stats})
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
