"""`python -m exspec.bench.suffix_cost`: suffix decoding's host time per row-step against the
context's length (spec/suffix.py), with a global tree warm from earlier requests' outputs.

A row grows by `--step-tokens` committed tokens between proposals, as a step commits them. Two
histories: `random` (a large vocabulary: few matches, every suffix walked until it fails) and
`repetitive` (passages of a few hundred tokens repeated with edits: long matches, long
proposals). Prints microseconds per row-step (its own tree extended, both trees searched),
milliseconds to index the prompt (once a request) and tree nodes per indexed token, medians of
`--repeats`.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from ..spec.lookup import StandaloneRow
from ..spec.suffix import SuffixProposer, SuffixTree


def history(kind: str, length: int, vocab: int, rng: random.Random) -> list[int]:
    if kind == "random":
        return [rng.randrange(vocab) for _ in range(length)]
    passage = [rng.randrange(vocab) for _ in range(300)]
    out: list[int] = []
    while len(out) < length:   # the passage again, a few tokens edited
        copy = list(passage)
        for _ in range(10):
            copy[rng.randrange(len(copy))] = rng.randrange(vocab)
        out += copy
    return out[:length]


def nodes(tree: SuffixTree) -> int:
    count, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        count += 1
        if not node.lazy:
            stack.extend(node.children.values())
    return count


def per_row_step(kind: str, context: int, steps: int, step_tokens: int, k: int, depth: int,
                 cached: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    proposer = SuffixProposer(max_tree_depth=depth)
    for _ in range(cached):   # earlier requests' outputs, 256 tokens each
        done = StandaloneRow(history(kind, 256, vocab, rng), 0)
        proposer.request_done(done, "stop")
    tokens = history(kind, context + steps * step_tokens, vocab, rng)
    row = StandaloneRow(tokens[:context], context)
    start = time.perf_counter()
    proposer.propose_row(row, k)   # the prompt, indexed once
    build = time.perf_counter() - start
    seconds, proposed = 0.0, 0
    for step in range(steps):
        row.tokens += tokens[context + step * step_tokens:context + (step + 1) * step_tokens]
        start = time.perf_counter()
        proposed += len(proposer.propose_row(row, k))
        seconds += time.perf_counter() - start
    return {"step": seconds / steps, "build": build, "proposed": proposed / steps,
            "nodes": nodes(proposer.local[row]) / len(row.tokens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exspec.bench.suffix_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--kinds", default="random,repetitive")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-tokens", type=int, default=2)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--max-tree-depth", type=int, default=24)
    ap.add_argument("--cached-requests", type=int, default=200,
                    help="earlier outputs (256 tokens each) in the global tree")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print("| history | context | us per row-step | tokens proposed per row-step | "
          "indexing the prompt, ms (once a request) | nodes per token |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for context in map(int, args.contexts.split(",")):
            runs = [per_row_step(kind, context, args.steps, args.step_tokens, args.k,
                                 args.max_tree_depth, args.cached_requests, args.vocab, seed)
                    for seed in range(args.repeats)]
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(f"| {kind} | {context} | {med['step'] * 1e6:.0f} | {med['proposed']:.1f} | "
                  f"{med['build'] * 1e3:.1f} | {med['nodes']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
