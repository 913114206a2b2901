"""The compiled decode path's start-up and per-forward cost, one engine: the warm-up (seconds,
graphs, what was compiled) from a cold inductor cache (a fresh cache folder unless --cache-dir),
then one decode forward of each model eager against compiled at B = 1 and 8 (the benchmark's
forward_costs: same KV store, same inputs, interleaved, medians).

    python scripts/warm_up_cost.py                        # demo pair, regional compilation
    python scripts/warm_up_cost.py --whole-model          # the whole model compiled instead
    python scripts/warm_up_cost.py --pair deep-narrow
"""
from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=("demo", "deep-narrow"), default="demo")
    ap.add_argument("--whole-model", action="store_true", help="compile whole models, not layers")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--cache-dir", help="inductor's cache folder (default: a fresh one, i.e. cold)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="inductor-")

    import torch
    from exspec import EngineConfig, LLMEngine
    from exspec.models import compiled
    from exspec.bench.cli import DEMO_DIR, build_deep_narrow_pair
    from exspec.bench.paths import forward_costs

    torch.set_num_threads(args.threads)
    compiled.COMPILE_BACKEND = args.backend
    if args.whole_model:
        compiled.decoder_layers = lambda model: None
    pair = DEMO_DIR if args.pair == "demo" else build_deep_narrow_pair(tempfile.mkdtemp())
    engine = LLMEngine(EngineConfig(target_model=str(pair / "target"), draft_model=str(pair / "draft"),
                                    tokenizer=str(pair / "tokenizer"), method="exspec",
                                    num_speculative_tokens=args.k, max_batch_size=8,
                                    adaptive_k=False, enforce_eager=False))
    print(f"{args.pair} pair, backend {args.backend}, torch threads {torch.get_num_threads()}, "
          f"inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    print(f"warm-up: {engine.warm_up.describe()}")
    for row in forward_costs(engine, [1, 8], args.k, args.repeats):
        print(f"{row['model']} B={row['batch_size']} x {row['tokens']} tokens: eager "
              f"{row['eager_ms']:.2f} ms, compiled {row['compiled_ms']:.2f} ms, "
              f"{row['eager_ms'] / row['compiled_ms']:.2f}x")


if __name__ == "__main__":
    main()
