"""The engine alone, in process, under the same closed loop locust drives through the server:
CONCURRENCY requests in flight, a new one as soon as one finishes, prompts from the same file,
the same sampling. Prints output tokens/s, TTFT and ITL p50/p95 per (concurrency, k), so the
cost of serving through Triton is the difference to the locust table.

    python load_tests/engine_baseline.py --model-repository model_repository \
        --concurrency 1,4,8 --num-speculative-tokens 5,0 --max-tokens 64 --run-time 40

Engine arguments come from <repo>/exspec/1/model.json, as the server reads them (device cpu).
Needs the project's environment (torch, transformers), not just the client.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "backend"))
sys.path.insert(0, str(HERE.parent / "client"))

from exspec_client.prompts import load_prompts  # noqa: E402


def engine_from_repository(repository: Path, model: str):
    from exspec import EngineConfig
    from exspec.engine.llm_engine import LLMEngine
    folder = repository / model / "1"
    values = json.loads((folder / "model.json").read_text())
    for key in ("target_model", "draft_model", "tokenizer"):
        if isinstance(values.get(key), str) and (folder / values[key]).exists():
            values[key] = str((folder / values[key]).resolve())
    values["device"] = "cpu"
    return LLMEngine(EngineConfig.from_dict(values)), values


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def closed_loop(engine, prompts, params, concurrency: int, run_time_s: float) -> dict:
    """Keep `concurrency` requests in flight for run_time_s (in-flight ones then finish)."""
    ids = itertools.count()
    order = itertools.cycle(range(len(prompts)))
    live: dict[str, dict] = {}
    finished = []
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        while len(live) < concurrency and now - start < run_time_s:
            rid = f"r{next(ids)}"
            engine.add_request(rid, prompts[next(order)], params)
            live[rid] = {"sent": now, "chunks": []}
        if not live:
            break
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = live.get(out.request_id)
            if record is None:
                continue
            if out.new_token_ids:
                record["chunks"].append((now - record["sent"], len(out.new_token_ids)))
            if out.finished:
                record["latency"] = now - record["sent"]
                finished.append(live.pop(out.request_id))
    wall = time.perf_counter() - start
    tokens = sum(n for r in finished for _, n in r["chunks"])
    ttfts = [r["chunks"][0][0] for r in finished if r["chunks"]]
    itls = []
    for r in finished:
        for (t0, _), (t1, n) in zip(r["chunks"], r["chunks"][1:]):
            itls += [(t1 - t0) / n] * n
    ms = lambda v: None if v is None else v * 1000   # noqa: E731
    return {"requests": len(finished), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "ttft_p50_ms": ms(percentile(ttfts, 0.5)), "ttft_p95_ms": ms(percentile(ttfts, 0.95)),
            "itl_p50_ms": ms(percentile(itls, 0.5)), "itl_p95_ms": ms(percentile(itls, 0.95)),
            "latency_p50_ms": ms(percentile([r["latency"] for r in finished], 0.5))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="load_tests/engine_baseline.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-repository", default=str(HERE.parent / "model_repository"))
    p.add_argument("--model", default="exspec")
    p.add_argument("--prompts-file", default=str(
        HERE.parent / "model_repository" / "exspec" / "1" / "demo" / "prompts.jsonl"))
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--num-speculative-tokens", default="5,0")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--run-time", type=float, default=40.0, help="seconds per cell")
    p.add_argument("--out", default=None, help="write the cells as JSON here")
    args = p.parse_args(argv)

    from exspec import SamplingParams
    engine, config = engine_from_repository(Path(args.model_repository), args.model)
    prompts = load_prompts(args.prompts_file)
    print(f"engine: {args.model_repository}/{args.model} (k={config.get('num_speculative_tokens')}, "
          f"adaptive_k={config.get('adaptive_k', True)}, max_batch_size="
          f"{config.get('max_batch_size')}), {len(prompts)} prompts", flush=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))   # warm up
    cells = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for k in (int(k) for k in args.num_speculative_tokens.split(",")):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    ignore_eos=args.ignore_eos, num_speculative_tokens=k)
            before = engine.stats()
            cell = {"concurrency": concurrency, "k": k,
                    **closed_loop(engine, prompts, params, concurrency, args.run_time)}
            after = engine.stats()
            drafted = after["draft_tokens"] - before["draft_tokens"]
            cell["acceptance_rate"] = ((after["accepted_tokens"] - before["accepted_tokens"])
                                       / drafted if drafted else None)
            cells.append(cell)
            f = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
            print(f"c={concurrency} k={k}: {cell['requests']} requests, "
                  f"{cell['output_tokens_per_s']:.1f} tokens/s, TTFT p50/p95 "
                  f"{f(cell['ttft_p50_ms'])}/{f(cell['ttft_p95_ms'])} ms, ITL p50/p95 "
                  f"{f(cell['itl_p50_ms'])}/{f(cell['itl_p95_ms'])} ms, acceptance "
                  f"{cell['acceptance_rate'] if cell['acceptance_rate'] is None else round(cell['acceptance_rate'], 2)}",
                  flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
