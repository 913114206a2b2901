"""`python -m exspec.bench.ngram_cost`: the n-gram proposer's host time per row-step against the
context's length, its per-row index (spec/ngram.py: NgramIndex) beside a rescan of the whole
history (the proposer before the index, kept here as the baseline).

A row grows by `--step-tokens` committed tokens between proposals, as a step commits them; the
history is random over a large vocabulary (prompt lookup finds little: a rescan's worst case,
every n scanned to the start). Prints microseconds per row-step, median of `--repeats`.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from ..spec.ngram import NgramIndex


def rescan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposal by scanning the history backwards (the old NgramProposer.lookup)."""
    last = len(tokens)
    for n in range(min(max_n, last - 1), min_n - 1, -1):
        suffix = tokens[last - n:]
        for start in range(last - n - 1, -1, -1):
            if tokens[start + n - 1] == suffix[-1] and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def per_row_step(context: int, steps: int, step_tokens: int, k: int, min_n: int, max_n: int,
                 vocab: int, seed: int) -> dict:
    """Seconds per proposal of each way, over `steps` steps of a row that starts at `context`
    tokens (the index is built on the prompt first, as a row's first step does)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(context)]
    index = NgramIndex(min_n, max_n)
    start = time.perf_counter()
    index.lookup(tokens, k)   # the prompt, indexed once
    build = time.perf_counter() - start
    times = {"index": 0.0, "rescan": 0.0}
    for _ in range(steps):
        tokens += [rng.randrange(vocab) for _ in range(step_tokens)]
        start = time.perf_counter()
        a = index.lookup(tokens, k)
        times["index"] += time.perf_counter() - start
        start = time.perf_counter()
        b = rescan(tokens, k, min_n, max_n)
        times["rescan"] += time.perf_counter() - start
        assert a == b, "the index and the rescan disagree"
    return {"build": build, **{way: seconds / steps for way, seconds in times.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exspec.bench.ngram_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-tokens", type=int, default=2)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print("| context | index, us per row-step | rescan, us per row-step | rescan / index | "
          "indexing the prompt, ms (once a request) |")
    print("|---|---|---|---|---|")
    for context in map(int, args.contexts.split(",")):
        runs = [per_row_step(context, args.steps, args.step_tokens, args.k, args.prompt_lookup_min,
                             args.prompt_lookup_max, args.vocab, seed) for seed in range(args.repeats)]
        index = statistics.median(r["index"] for r in runs) * 1e6
        scan = statistics.median(r["rescan"] for r in runs) * 1e6
        build = statistics.median(r["build"] for r in runs) * 1e3
        print(f"| {context} | {index:.1f} | {scan:.1f} | {scan / index:.0f}x | {build:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
