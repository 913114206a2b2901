"""What reading the block store in place (attention_backend "FLEX_ATTENTION", kv/in_place.py)
costs and saves against the gather, per decode step of the engine's compiled path: B rows of
the real pair's target (SmolLM2-135M-Instruct, `make real-pair`) decoding alone (k = 0) at
each context length, both engines in one process on the same weights, their steps timed in
alternation.

    python scripts/in_place_cost.py                          # batch 8, contexts 256 and 2048
    python scripts/in_place_cost.py --contexts 256,1024 --rounds 9 --threads 1

Prints the processor, then per context each read's median step time and what the gather
copies per step (every row's blocks, keys and values, every layer: computed from the shapes,
since torch's profiler does not see what inductor's C++ wrappers allocate; the read in place
copies none), and writes them as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def engine_for(path: str, backend: str | None, rows: int, max_context: int, pair=None):
    from exspec import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(
        target_model=path, method="exspec", num_speculative_tokens=0, max_batch_size=rows,
        max_num_seqs=rows, enforce_eager=False, enable_prefix_caching=False,
        attention_backend=backend, max_num_kv_tokens=rows * (max_context + 64) + 16), pair=pair)


def rows_at(engine, rows: int, context: int, chunk: int = 256):
    """A group of `rows` rows prefilled to `context` tokens, through the engine's runner."""
    from exspec import SamplingParams
    runner = engine.runner
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    group = runner.new_group([engine._sequence(f"{context}-{i}", [(7 * i + j) % 5000 + 100 for j in range(context)],
                                               params) for i in range(rows)])
    for start in range(0, context, chunk):
        runner.prefill(group, [min(chunk, context - start)] * rows)
    runner.step(group, 0)
    return group


def gathered_bytes(engine, group) -> int:
    """What the gather copies in one decode step: each row's table width (the bucket) of slots,
    keys and values, in every layer."""
    from exspec.kv.blocks import BLOCK_SIZE
    kv = group.target_kv
    layer = kv.store.cache.layers[0]
    slot = layer.keys[0].numel() * layer.keys.element_size()
    width = len(kv.host_table()[0]) * BLOCK_SIZE
    return 2 * kv.batch * width * slot * len(kv.store.cache.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench_out/in_place_cost.json")
    args = parser.parse_args()
    import torch
    from exspec.models.real_pair import PAIR_DIR
    from exspec.utils.machine import processor_name
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    path = str(PAIR_DIR / "target")
    engines = {"gather": engine_for(path, None, args.rows, max(contexts))}
    engines["in place"] = engine_for(path, "FLEX_ATTENTION", args.rows, max(contexts), engines["gather"].pair)
    print(f"{processor_name()}, {args.threads} torch thread(s), batch {args.rows}, target alone, compiled")
    for name, engine in engines.items():
        print(f"  {name}: {engine.warm_up.summary()}")
    print("context | gather ms/step | in place ms/step | in place / gather | gathered per step")
    results = []
    for context in contexts:
        groups = {name: rows_at(engine, args.rows, context) for name, engine in engines.items()}
        times = {name: [] for name in engines}
        for _ in range(args.rounds):   # alternating, so both see the same machine
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.runner.step(groups[name], 0)
                times[name].append((time.perf_counter() - start) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        copied = gathered_bytes(engines["gather"], groups["gather"])
        for name, group in groups.items():
            for kv in group.caches():
                kv.select([])
        results.append({"context": context, "ms": ms, "gathered_bytes": copied})
        print(f"{context} | {ms['gather']:.1f} | {ms['in place']:.1f} | {ms['in place'] / ms['gather']:.2f} | "
              f"{copied / 1e6:.0f} MB", flush=True)
    with open(args.out, "w") as f:
        json.dump({"processor": processor_name(), "threads": args.threads, "rows": args.rows,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
