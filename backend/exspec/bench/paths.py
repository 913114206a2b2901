"""Eager against compiled, forward by forward: the cost of one decode forward of each model on
each path, at a few batch sizes, measured on one compiled engine's runner (the same KV store,
the same inputs, only the forward swapped), interleaved eager / compiled, median of repeats."""
from __future__ import annotations

import statistics
import time

import torch

from ..params import SamplingParams
from .methods import sync

CONTEXT = 64   # committed tokens per row before the timed forwards


@torch.inference_mode()
def forward_costs(engine, batch_sizes: list[int], k: int, repeats: int = 20) -> list[dict]:
    """Rows {model, batch_size, tokens, eager_ms, compiled_ms}: the draft's one-token forward and
    the target's k + 1 verification. Each timed forward is rolled back (a length change), so
    every repeat sees the same cache."""
    runner, compiled = engine.runner, engine.runner.decode_forwards
    rows = []
    for batch in batch_sizes:
        seqs = [engine._sequence(f"cost-{batch}-{i}", [(5 * i + j) % 97 + 1 for j in range(CONTEXT)],
                                 SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(batch)]
        group = runner.new_group(seqs)
        runner.prefill(group, [CONTEXT] * batch)
        drafts = [("draft", m, kv, 1) for m, kv in zip(runner.proposer.kv_models,
                                                      group.proposer_state.caches())]
        for name, model, kv, width in drafts + [("target", runner.target, group.target_kv, k + 1)]:
            ids = torch.ones((batch, width), dtype=torch.long, device=runner.device)
            pos = (CONTEXT + torch.arange(width, device=runner.device)).expand(batch, width)
            valid = torch.ones_like(ids, dtype=torch.bool)
            seconds = {"eager": [], "compiled": []}
            for r in range(repeats + 1):                  # the first round warms caches up
                for path in ("eager", "compiled"):
                    runner.decode_forwards = compiled if path == "compiled" else {}
                    sync(str(runner.device))
                    start = time.perf_counter()
                    runner.forward(model, kv, ids, pos, valid, [width] * batch, keep=width)
                    sync(str(runner.device))
                    if r:
                        seconds[path].append(time.perf_counter() - start)
                    kv.drop_tail([width] * batch)
            rows.append({"model": name, "batch_size": batch, "tokens": width,
                         **{f"{p}_ms": 1000 * statistics.median(s) for p, s in seconds.items()}})
    runner.decode_forwards = compiled
    return rows
