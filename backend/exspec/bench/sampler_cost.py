"""`python -m exspec.bench.sampler_cost`: what the sampler costs per speculative step, outside
the model, at a Qwen3-8B-shaped vocabulary (151,936) on the CPU: one step's Gumbel noise for
positions m .. m+k, k draft picks on [B, 1, V] and the verification's picks on [B, k+1, V],
under each kind of sampling, as a ratio to a greedy step's sampler cost (argmaxes only).

Settings are interleaved within each round (greedy, temperature, top-k, ...), and each cell is
the median over rounds; one torch thread unless told otherwise. The script uses only the
sampler's public functions, so the same file measures another checkout of the engine:
`PYTHONPATH=OTHER/backend python backend/exspec/bench/sampler_cost.py`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exspec import SamplingParams
from exspec.sampling.noise import gumbel
from exspec.sampling.sampler import RowSampling, coupled_tokens

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "top_k=50,top_p=0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
}


def step_seconds(logits: torch.Tensor, rows: RowSampling, k: int) -> float:
    """One step's sampler work (runner.step's noise, k draft picks, the verification's picks)."""
    batch = logits.shape[0]
    start = time.perf_counter()
    noise = None
    if not rows.all_greedy:
        positions = torch.arange(100, 101 + k).expand(batch, -1)
        noise = gumbel(rows.seed, positions, logits.shape[-1])
    for j in range(k):
        coupled_tokens(logits[:, j:j + 1], rows, None if noise is None else noise[:, j:j + 1])
    coupled_tokens(logits, rows, noise)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, k {args.k}, torch threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds after {args.warmup} uncounted; seconds per step (ratio to greedy)")
    print("| B | " + " | ".join(SETTINGS) + " |")
    print("|---" * (len(SETTINGS) + 1) + "|")
    for batch in args.batch:
        logits = torch.randn(batch, args.k + 1, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
        rows = {name: RowSampling.from_params([SamplingParams(**params)] * batch, "cpu",
                                              list(range(batch))) for name, params in SETTINGS.items()}
        times = {name: [] for name in SETTINGS}
        for _ in range(args.warmup + args.rounds):
            for name, row in rows.items():
                times[name].append(step_seconds(logits, row, args.k))
        medians = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
        greedy = medians["greedy"]
        print(f"| {batch} | " + " | ".join(f"{s:.4f} ({s / greedy:.1f}x)" for s in medians.values()) + " |")


if __name__ == "__main__":
    main()
