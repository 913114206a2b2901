"""`python -m exspec.bench.processing`: what vLLM's logits processing (penalties, min_p,
min_tokens, logit_bias, bad_words: logits_processing.py) costs per speculative step. Two engines
on one pair, one whose rows ask for every processing parameter and one whose rows are the same
sampled cell without them, each holding B running rows; their steps are timed interleaved
at a fixed k (the order turns each round), medians. Where processing is small beside the
models, step-time differences drown in the host's noise, so the processing a step runs (k
draft positions and the k + 1 verified ones, on the engine's own state) is also timed alone.
Torch threads: --threads (default 1), printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .. import EngineConfig, LLMEngine, SamplingParams
from .cli import DEMO_DIR

SAMPLED = dict(temperature=0.8, top_p=0.95, ignore_eos=True, max_tokens=4096)
PROCESSED = dict(SAMPLED, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3,
                 min_p=0.02, min_tokens=64, logit_bias={13: 1.0, 42: -2.0}, bad_words=["the end"])


def running_engine(pair: dict, method: str, k: int, batch: int, params: dict) -> LLMEngine:
    """An engine with `batch` rows prefilled and stepping (fixed k, no draft stop)."""
    engine = LLMEngine(EngineConfig(**pair, method=method, num_speculative_tokens=k,
                                    max_batch_size=batch, max_num_seqs=batch, adaptive_k=False))
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(5 + i, 37 + i)), SamplingParams(seed=100 + i, **params))
    for _ in range(3):   # prefill, then the first steps (one group of every row)
        engine.step()
    return engine


def processing_per_step(engine: LLMEngine, k: int, rounds: int) -> float:
    """Median seconds of one step's processing: k draft positions, then k + 1 verified ones."""
    runner, group = engine.runner, engine.pool.groups[0]
    processing = group.processing   # built by the group's steps
    rows, vocab = len(group), runner.logits_width
    logits = torch.randn(rows, k + 1, vocab)
    drafts = torch.randint(0, vocab, (rows, k))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for j in range(k):
            processing.apply(logits[:, :1], drafts[:, :j] if j else None, j)
        processing.apply(logits, drafts)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--methods", default="exspec,eqspec")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per engine and cell")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pair", choices=("demo", "smollm2"), default="demo",
                    help="the demo pair (4,096 tokens) or the real pair (SmolLM2, 49,152 tokens)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    if args.pair == "smollm2":
        from ..models.real_pair import ensure_pair
        root = ensure_pair()
        pair = dict(target_model=str(root / "target"), draft_model=str(root / "draft"),
                    tokenizer=str(root / "target"))
    else:
        pair = dict(target_model=str(DEMO_DIR / "target"), draft_model=str(DEMO_DIR / "draft"),
                    tokenizer=str(DEMO_DIR / "tokenizer"))
    print("| method | B | step ms, sampled | step ms, + processing | ratio | processing ms per step | share of the step |")
    print("|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            engines = {"off": running_engine(pair, method, args.k, batch, SAMPLED),
                       "on": running_engine(pair, method, args.k, batch, PROCESSED)}
            times = {name: [] for name in engines}
            for r in range(args.steps):
                for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    engine = engines[name]
                    start = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - start)
            ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
            alone = 1000 * processing_per_step(engines["on"], args.k, args.steps)
            print(f"| {method} | {batch} | {ms['off']:.2f} | {ms['on']:.2f} | {ms['on'] / ms['off']:.3f} "
                  f"| {alone:.2f} | {alone / ms['on']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
