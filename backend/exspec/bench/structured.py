"""`python -m exspec.bench.structured`: what structured outputs (structured_output.py) cost.

1. The grammar library, alone: compile time of a 30-property JSON schema and mask time per
   token (the mask of each state along a valid output) with llguidance, at the pair's
   vocabulary (SmolLM2: 49,152 tokens) and the demo pair's (4,096).
2. The engine: B running rows, each step timed, with and without a JSON schema on every row
   (the same greedy prompts; every row ignores EOS, so the batch stays whole: a schema's row
   runs on EOS alone once its JSON is complete, max_tokens ends them), medians; tokens/s is committed tokens over the measured steps' time. Masks fill
   on a grammar thread while the forwards run (structured_output.StepMasks): per step, the
   median host time they cost the step's own thread (starting parts, waiting for them,
   copying them up: `masks ms, step thread`) and the time making them took on the grammar
   thread (llguidance filling, numpy unpacking: `made ms, beside`), both timed in place.
Torch threads: --threads (default 1, deliberately: the mask work is host work beside the
forwards, and one thread keeps the comparison steady on a shared machine), printed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from .. import EngineConfig, LLMEngine, SamplingParams
from ..sampling.structured_output import Grammars, StructuredOutput
from .cli import DEMO_DIR


def wide_schema(properties: int = 30) -> dict:
    """A flat object of `properties` typed fields (strings, integers, booleans, enums), all required."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["low", "mid", "high"]}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


# the engine part's schema: short, bounded values, so rows step on until max_tokens
ROW_SCHEMA = {"type": "array", "items": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "population": {"type": "integer"},
                                     "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"], "additionalProperties": False}}


def library(tokenizer_dir: str, label: str, rounds: int = 20) -> None:
    """Compile and per-token mask times of llguidance at this tokenizer's vocabulary."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammars = Grammars(tokenizer, {tokenizer.eos_token_id}, len(tokenizer))
    start = time.perf_counter()
    grammars.tokenizer   # built once per tokenizer
    tokenizer_s = time.perf_counter() - start
    schema = StructuredOutput("json", json.dumps(wide_schema()))
    compiles = []
    for _ in range(rounds):
        start = time.perf_counter()
        row = grammars.compile(schema)
        compiles.append(time.perf_counter() - start)
    # a valid output: walk the grammar with the tokens of a valid instance
    instance = {f"field_{i:02d}": ["abc", 7, True, "mid"][i % 4] for i in range(30)}
    tokens = tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
    tokens = tokens[:row.valid_prefix(tokens)]
    out = np.zeros((1, row.words), dtype=np.int32)
    start = time.perf_counter()
    for token in tokens:
        row.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)   # llguidance alone
        row.consume([token])
    per_token = (time.perf_counter() - start) / max(1, len(tokens))
    print(f"| {label} | {len(tokenizer):,} | {tokenizer_s * 1e3:.0f} | {statistics.median(compiles) * 1e3:.2f} "
          f"({min(compiles) * 1e3:.2f}-{max(compiles) * 1e3:.2f}) | {per_token * 1e6:.1f} | {len(tokens)} |")


def running_engine(pair: dict, method: str, k: int, batch: int, constrained: bool) -> LLMEngine:
    engine = LLMEngine(EngineConfig(**pair, method=method, num_speculative_tokens=k,
                                    max_batch_size=batch, max_num_seqs=batch, adaptive_k=False))
    schema = {"json": ROW_SCHEMA} if constrained else None
    for i in range(batch):
        engine.add_request(f"r{i}", f"List {3 + i} cities as JSON:", SamplingParams(
            max_tokens=4096, ignore_eos=True, structured_outputs=schema))
    for _ in range(3):
        engine.step()
    return engine


class MaskTimer:
    """Host seconds of grammar masks: `waited` on the step's thread (StepMasks' extend and
    forbidden: starting parts, waiting for them, copying them up), `filled` on the grammar
    thread (StepMasks._forbidden: llguidance filling, numpy unpacking), each by wrapping the
    function in place."""

    def __init__(self):
        from ..sampling import structured_output
        self.waited = self.filled = 0.0
        for owner, name, total in ((structured_output.StepMasks, "extend", "waited"),
                                   (structured_output.StepMasks, "forbidden", "waited"),
                                   (structured_output.StepMasks, "_forbidden", "filled")):
            setattr(owner, name, self._timed(getattr(owner, name), total))

    def _timed(self, function, total: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)
        return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--method", default="exspec")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per engine and cell")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true", help="only the library measurement")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    from ..models.real_pair import ensure_pair
    root = ensure_pair()
    print("| tokenizer | vocabulary | llguidance tokenizer ms (once) | compile ms, 30-property schema, median (min-max) | mask us per token | tokens walked |")
    print("|---|---|---|---|---|---|")
    library(str(root / "target"), "SmolLM2 (real pair)")
    library(str(DEMO_DIR / "tokenizer"), "demo pair")
    if args.skip_engine:
        return
    pair = dict(target_model=str(root / "target"), draft_model=str(root / "draft"),
                tokenizer=str(root / "target"))
    print(f"\nmethod {args.method}, k {args.k}, greedy, {args.steps} steps per cell")
    print("| B | step ms, free | step ms, JSON schema | ratio | masks ms, step thread | made ms, beside | "
          "tokens/step, free | tokens/step, schema | tokens/s, free | tokens/s, JSON schema |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    masks = MaskTimer()
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        engines = {name: running_engine(pair, args.method, args.k, batch, name == "schema")
                   for name in ("free", "schema")}
        times = {name: [] for name in engines}
        tokens = {name: 0 for name in engines}
        mask_times, fill_times = [], []
        for i in range(args.steps):
            for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                engine = engines[name]
                start, waited, filled = time.perf_counter(), masks.waited, masks.filled
                outputs = engine.step()
                times[name].append(time.perf_counter() - start)
                if name == "schema":
                    mask_times.append(masks.waited - waited)
                    fill_times.append(masks.filled - filled)
                # from the outputs: a row that finished has left the pool's groups
                tokens[name] += sum(len(o.new_token_ids) for o in outputs)
        free, schema = (statistics.median(times[n]) for n in ("free", "schema"))
        rate = {n: tokens[n] / sum(times[n]) for n in engines}
        mask, fill = statistics.median(mask_times), statistics.median(fill_times)
        per_step = {n: tokens[n] / args.steps for n in engines}
        print(f"| {batch} | {free * 1e3:.1f} | {schema * 1e3:.1f} | {schema / free:.2f} | "
              f"{mask * 1e3:.2f} | {fill * 1e3:.2f} | {per_step['free']:.1f} | {per_step['schema']:.1f} | "
              f"{rate['free']:.0f} | {rate['schema']:.0f} |")


if __name__ == "__main__":
    main()
