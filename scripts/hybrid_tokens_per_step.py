"""Tokens per target step of the EAGLE-3 head, suffix decoding and the two together
(proposer "eagle3_suffix", spec/hybrid.py) on the real pair, per prompt category of
exspec-bench's sets: batch 1, greedy, fixed k, each category's first N prompts served one
after another by one engine (suffix decoding learns from the category's earlier answers, as in
exspec-bench, and forgets between categories). Also checks that the three give the same tokens
and reports the hybrid's host time choosing against its step time.

    .venv/bin/python scripts/hybrid_tokens_per_step.py --prompts 4 --max-tokens 64 -k 4
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.bench.cli import chat_of_turns, read_prompts
from exspec.models.loading import load_pair
from exspec.models.real_pair import PAIR_DIR

CATEGORIES = ("open", "agentic", "grounded", "multiturn", "code_edit", "repeated")
PROMPTS = Path(__file__).resolve().parents[1] / "backend" / "exspec" / "bench" / "prompts"
PROPOSERS = ("eagle3", "suffix", "eagle3_suffix")


def engine_for(proposer: str, pair, args) -> LLMEngine:
    config = EngineConfig(
        target_model=str(PAIR_DIR / "target"), tokenizer=str(PAIR_DIR / "target"),
        draft_model=None if proposer == "suffix" else str(PAIR_DIR / "eagle3"),
        proposer=proposer, method="exspec", num_speculative_tokens=args.k, adaptive_k=False,
        max_batch_size=1, max_num_seqs=64)
    return LLMEngine(config, pair=pair)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4, help="per category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    args = ap.parse_args()
    pair = load_pair(EngineConfig(target_model=str(PAIR_DIR / "target"), tokenizer=str(PAIR_DIR / "target"),
                                  draft_model=str(PAIR_DIR / "eagle3"), proposer="eagle3"))
    engines = {p: engine_for(p, pair, args) for p in PROPOSERS}
    tok = pair.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens)

    def generate(ids_list, max_tokens):   # bench's HFModels.generate, target greedy
        outs = engines["eagle3"].generate(ids_list, SamplingParams(max_tokens=max_tokens))
        return [o.token_ids for o in outs]

    hf = SimpleNamespace(tokenizer=tok, generate=generate)
    print(f"| category | prompts | head | suffix | hybrid | hybrid rows: suffix / head | choice / step |")
    print("|---|---|---|---|---|---|---|")
    for category in args.categories.split(","):
        prompts = read_prompts(PROMPTS / f"{category}.jsonl", args.prompts)
        ids = []
        for p in prompts:
            text = chat_of_turns(hf, p.turns, args.max_tokens) if len(p.turns) > 1 else \
                tok.apply_chat_template([{"role": "user", "content": p.text}],
                                        add_generation_prompt=True, tokenize=False)
            ids.append(tok.encode(text, add_special_tokens=False))
        rates, outputs = {}, {}
        for name, engine in engines.items():
            engine.proposer.forget()
            before, start = engine.stats(), time.perf_counter()
            chosen0 = dict(getattr(engine.proposer, "chosen", {}))
            choice0 = getattr(engine.proposer, "choice_seconds", 0.0)
            outputs[name] = [o.token_ids for ids_ in ids for o in engine.generate([ids_], params)]
            after, seconds = engine.stats(), time.perf_counter() - start
            steps = after["steps"] - before["steps"]
            rates[name] = (after["committed_tokens"] - before["committed_tokens"]) / steps
            if name == "eagle3_suffix":
                chosen = {s: engine.proposer.chosen[s] - chosen0.get(s, 0) for s in ("suffix", "head")}
                choice = (engine.proposer.choice_seconds - choice0) / steps
                step = seconds / steps
        same = outputs["eagle3"] == outputs["suffix"] == outputs["eagle3_suffix"]
        print(f"| {category} | {len(ids)} | {rates['eagle3']:.2f} | {rates['suffix']:.2f} | "
              f"{rates['eagle3_suffix']:.2f} | {chosen['suffix']} / {chosen['head']} | "
              f"{1e3 * choice:.3f} ms / {1e3 * step:.1f} ms ({100 * choice / step:.2f}%) |"
              + ("" if same else " OUTPUTS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
