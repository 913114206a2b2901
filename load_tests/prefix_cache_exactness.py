"""Prefix caching on vs off on one pair: equal outputs, and how often the logits are bit-identical.

    python load_tests/prefix_cache_exactness.py [--pair tiny|real] [--requests 8] [--max-tokens 24]
        [--k 4] [--out runs/prefix_cache/exactness.json]

Two engines on the same loaded pair (method exspec, fixed k, float32, CPU, one torch thread),
one with enable_prefix_caching, one without, run the same chat workload: a first turn of
--requests prompts sharing a system prompt, then a second turn per request that resends the
history (prompt + the first answer + a follow-up), so the second turn's prompts start from cached
blocks of both prompts and outputs. Each turn runs greedy and seeded (temperature 0.8, the gumbel
coupling). Per request: are the tokens equal; per token both runs produced: is the chosen token's
logprob (from the target's logits) bit-identical. A cached block's entries came from another
forward's shape, so bits may differ where outputs do not. --pair real: SmolLM2-135M-Instruct with
its trained draft and the ChatML prompts of ~/.cache/exspec/smollm2-135m-instruct; tiny: a
random Llama pair with a 40-token system prompt.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.models.loading import ModelPair, load_pair

FOLLOW_UP = "<|im_start|>user\nTell me more.<|im_end|>\n<|im_start|>assistant\n"


def tiny_pair() -> tuple[ModelPair, list[list[int]], list[int]]:
    from exspec.demo.tiny import build_tokenizer, llama, noisy_copy
    tok = build_tokenizer()
    target = llama(len(tok), seed=1, layers=2, hidden=64, heads=4, kv_heads=2, max_positions=512)
    pair = ModelPair(tok, target.eval(), noisy_copy(target, 3, scale=0.02).eval(), set(), 512)
    rng = random.Random(0)
    system = [rng.randrange(1, 250) for _ in range(40)]
    prompts = [system + [rng.randrange(1, 250) for _ in range(rng.randint(1, 30))] for _ in range(64)]
    return pair, prompts, [rng.randrange(1, 250) for _ in range(12)]


def real_pair() -> tuple[ModelPair, list[list[int]], list[int]]:
    root = Path.home() / ".cache/exspec/smollm2-135m-instruct"
    pair = load_pair(EngineConfig(target_model=str(root / "target"), draft_model=str(root / "draft")))
    lines = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    encode = lambda text: pair.tokenizer.encode(text, add_special_tokens=False)   # noqa: E731
    return pair, [encode(line["turns"][0]) for line in lines], encode("<|im_end|>\n" + FOLLOW_UP)


def run(engine, prompts, params):
    return engine.generate(prompts, params)


def compare(on, off) -> dict:
    equal = sum(a.token_ids == b.token_ids for a, b in zip(on, off))
    same_bits = compared = 0
    for a, b in zip(on, off):
        for x, y, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            if ta != tb:
                break
            compared += 1
            same_bits += x.logprob == y.logprob
    return {"requests": len(on), "equal_outputs": equal, "tokens_compared": compared,
            "bit_identical_logprobs": same_bits}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pair, prompts, follow_up = (tiny_pair if args.pair == "tiny" else real_pair)()
    prompts = prompts[:args.requests]
    engines = {caching: LLMEngine(EngineConfig(
        target_model=args.pair, draft_model=args.pair, method="exspec", num_speculative_tokens=args.k,
        adaptive_k=False, max_batch_size=4, enable_prefix_caching=caching), pair=pair)
        for caching in (True, False)}
    sampling = {"greedy": lambda i: SamplingParams(max_tokens=args.max_tokens, logprobs=0),
                "seeded": lambda i: SamplingParams(max_tokens=args.max_tokens, logprobs=0,
                                                   temperature=0.8, seed=1000 + i)}
    report = {"pair": args.pair, "k": args.k, "rows": []}
    for mode, make in sampling.items():
        params = [make(i) for i in range(len(prompts))]
        first = {c: run(e, prompts, params) for c, e in engines.items()}
        # the second turn resends the history (the cache-off run's answer, the same for both)
        second_prompts = [p + o.token_ids + follow_up for p, o in zip(prompts, first[False])]
        second = {c: run(e, second_prompts, params) for c, e in engines.items()}
        for turn, outs in (("first", first), ("second", second)):
            row = {"mode": mode, "turn": turn, **compare(outs[True], outs[False])}
            report["rows"].append(row)
            print(row, flush=True)
    stats = {c: e.stats() for c, e in engines.items()}
    report["prefix_cache_hit_rate"] = stats[True]["prefix_cache_hit_rate"]
    report["prefill_tokens_target"] = {"on": stats[True]["prefill_tokens_target"],
                                       "off": stats[False]["prefill_tokens_target"]}
    print({k: report[k] for k in ("prefix_cache_hit_rate", "prefill_tokens_target")})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
