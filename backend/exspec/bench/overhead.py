"""`python -m exspec.bench.overhead`: the engine's own forward against a plain Hugging Face
forward of the same tokens: one decoding token per row on a cache of the same
length, for each model of the pair, each layout (EQSPEC's padded cache, EXSPEC's row-offset
cache) and batch size. Rows are copies of one prompt, so they stay uniform and the engine
passes no mask, as HF's own decoding does. Interleaved rounds (HF, eqspec, exspec, HF, ...),
medians; torch threads set by the server's rule and printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .. import EngineConfig, LLMEngine, SamplingParams
from ..utils.threads import apply_threads, choose_threads
from .cli import DEMO_DIR


@torch.inference_mode()
def hf_forward(model, context: int, batch: int):
    """A closure doing one HF decoding forward at `context` cached tokens, rolled back after."""
    ids = torch.randint(5, 200, (batch, context))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    token = torch.full((batch, 1), 7)
    pos = torch.full((batch, 1), context)

    def run():
        with torch.inference_mode():
            model(input_ids=token, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)
    return run


@torch.inference_mode()
def engine_forward(method: str, role: str, context: int, batch: int, pair: dict):
    """A closure doing the engine's forward (runner.forward on a real group's cache) of one
    token per row at `context` cached tokens, rolled back after (a rejected draft, as it were)."""
    engine = LLMEngine(EngineConfig(**pair, method=method, num_speculative_tokens=1,
                                    max_batch_size=batch, max_num_seqs=batch, adaptive_k=False))
    prompt = list(range(5, 5 + context))
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
    engine.step()   # prefill (every row identical, so the group stays uniform)
    runner, group = engine.runner, engine.pool.groups[0]
    model = runner.target if role == "target" else runner.proposer.model
    kv = group.target_kv if role == "target" else group.proposer_state.kv
    n = kv.lengths[0]
    ids = torch.full((batch, 1), 7)
    pos = torch.full((batch, 1), n)
    valid = torch.ones(batch, 1, dtype=torch.bool)

    def run():
        with torch.inference_mode():
            runner.forward(model, kv, ids, pos, valid, [1] * batch, keep=1)
            kv.drop_tail([1] * batch)
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=64, help="cached tokens per row")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    threads = apply_threads(choose_threads(args.threads))
    print(f"torch threads: {threads.intra_op} ({threads.source})")
    pair = dict(target_model=str(DEMO_DIR / "target"), draft_model=str(DEMO_DIR / "draft"),
                tokenizer=str(DEMO_DIR / "tokenizer"))
    models = {role: AutoModelForCausalLM.from_pretrained(pair[f"{role}_model"]).eval()
              for role in ("target", "draft")}
    print(f"| model | B | HF forward ms | eqspec forward ms | exspec forward ms | eqspec ÷ HF | exspec ÷ HF |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for role, model in models.items():
            runs = {"hf": hf_forward(model, args.context, batch),
                    "eqspec": engine_forward("eqspec", role, args.context, batch, pair),
                    "exspec": engine_forward("exspec", role, args.context, batch, pair)}
            times = {name: [] for name in runs}
            for r in range(args.rounds + 3):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    if r >= 3:   # the first rounds warm up
                        times[name].append(time.perf_counter() - start)
            ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
            print(f"| {role} | {batch} | {ms['hf']:.2f} | {ms['eqspec']:.2f} | {ms['exspec']:.2f} "
                  f"| {ms['eqspec'] / ms['hf']:.2f} | {ms['exspec'] / ms['hf']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
