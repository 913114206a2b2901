"""`python -m exspec.demo.engine`: the engine on a model pair, speculative vs target-only, side by side.

With --real, the real pair (SmolLM2-135M-Instruct with the EAGLE-3 head trained for it, else its
trained draft; exspec.models.real_pair) on chat questions through its own chat template. Otherwise
the toy pair, a
tiny code model for fast tests: the shipped demo pair (model_repository/exspec/1/demo) when
present, else a small seeded pair built locally. Prints which pair it runs, both outputs,
whether they match token for token, the acceptance rate (accepted / drafted tokens), tokens/s
of each and the speed-up, the two engines timed tick by tick in turn over the same prompts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from .. import EngineConfig, LLMEngine, SamplingParams
from ..bench.methods import Method, run_interleaved, stats_delta
from ..models.loading import load_pair
from ..utils.machine import processor_name

DEMO_DIR = Path(__file__).resolve().parents[3] / "model_repository" / "exspec" / "1" / "demo"
FALLBACK_PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n\n", "for i in range(10):\n"]
REAL_PAIR = {"eagle3": "real pair: SmolLM2-135M-Instruct (float32) with the EAGLE-3 head trained "
                       "for it (scripts/train_smollm2_eagle3.py)",
             "draft_model": "real pair: SmolLM2-135M-Instruct (float32) with the draft trained for "
                            "it (6 layers, hidden 256: scripts/train_smollm2_draft.py)"}
TOY_PAIR = "toy pair: a tiny code model for fast tests, not an assistant"


def _pair_dir(args) -> tuple[Path, list[str]]:
    if args.real:
        from ..models.real_pair import ensure_pair
        pair = ensure_pair()
        rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()]
        return pair, [r["turns"][0] for r in rows]
    if args.pair:
        return Path(args.pair), FALLBACK_PROMPTS
    if (DEMO_DIR / "target" / "config.json").exists():
        prompts_file = DEMO_DIR / "prompts.jsonl"
        prompts = FALLBACK_PROMPTS
        if prompts_file.exists():
            prompts = [json.loads(line)["turns"][0] for line in prompts_file.read_text().splitlines()
                       if line.strip()]
        return DEMO_DIR, prompts
    from .tiny import build_demo_pair
    out = Path(tempfile.mkdtemp(prefix="exspec-demo-"))
    print(f"no trained demo pair found; building a small seeded pair in {out}")
    return build_demo_pair(out), FALLBACK_PROMPTS


def _tokenizer_dir(pair: Path) -> Path:
    """The toy pairs keep the tokenizer apart; the real pair's is in target/."""
    return pair / "tokenizer" if (pair / "tokenizer").exists() else pair / "target"


def _engines(pair: Path, method: str, k: int, batch: int,
             proposer: str = "draft_model") -> list[LLMEngine]:
    """The speculative engine and the target-only one, sharing the models loaded once (each
    loaded model prints one "Loading weights" bar), each warmed up: one-off costs untimed.
    `proposer`: the pair's draft/ or, "eagle3", its eagle3/ head."""
    common = dict(target_model=str(pair / "target"), tokenizer=str(_tokenizer_dir(pair)),
                  max_batch_size=batch)
    speculative = EngineConfig(**common, method=method, num_speculative_tokens=k, proposer=proposer,
                               draft_model=str(pair / ("eagle3" if proposer == "eagle3" else "draft")))
    models = load_pair(speculative)
    engines = [LLMEngine(speculative, pair=models),
               LLMEngine(EngineConfig(**common, method="autoregressive", num_speculative_tokens=0),
                         pair=dataclasses.replace(models, draft=None, head=None))]
    for engine in engines:
        engine.generate(["Hello"], SamplingParams(max_tokens=4))
    return engines


class _Workload(Method):
    """One engine's generate of the prompts, a tick at a time: `run_interleaved` times two of
    them tick by tick (A B A B), so both meet the same moments of the host, as the demo's served
    part alternates its requests. A bench Method, so it has what run_interleaved calls."""
    device = "cpu"

    def __init__(self, engine: LLMEngine, params: SamplingParams):
        self.engine, self.params = engine, params

    def ticks(self, prompts, max_tokens):
        before = self.engine.stats()
        outs = yield from self.engine.generate_ticks(prompts, self.params)
        return outs, stats_delta(before, self.engine.stats())


def _side_by_side(engines: list[LLMEngine], prompts, params: SamplingParams):
    """Per engine: its outputs, tokens/s over its own ticks, and accepted / drafted tokens."""
    runs = run_interleaved([_Workload(e, params) for e in engines], prompts, params.max_tokens, "cpu")
    results = []
    for run in runs:
        tokens = sum(len(o.token_ids) for o in run.outputs)
        drafted = run.stats["draft_tokens"]
        results.append((run.outputs, tokens / run.seconds,
                        run.stats["accepted_tokens"] / drafted if drafted else None))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", help="folder with tokenizer/, target/, draft/")
    parser.add_argument("--real", action="store_true",
                        help="the real pair (SmolLM2-135M-Instruct) on chat questions")
    parser.add_argument("--method", default="exspec", choices=["exspec", "eqspec"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair, prompts = _pair_dir(args)
    proposer = "draft_model"
    if args.real:
        from ..models.real_pair import demo_proposer
        proposer = demo_proposer(pair)
    print(f"{REAL_PAIR[proposer] if args.real else 'given pair' if args.pair else TOY_PAIR} ({pair})")
    print(f"on {processor_name()}, {torch.get_num_threads()} torch thread(s) (--threads); the "
          "speed-up depends on the processor: where verifying a few tokens costs much more than "
          "one, adaptive k decodes mostly plainly")
    prompts = prompts[:args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    engines = _engines(pair, args.method, args.k, args.batch_size, proposer)
    (spec, spec_tps, acceptance), (base, base_tps, _) = _side_by_side(engines, prompts, params)
    same = 0
    for i, (s, b) in enumerate(zip(spec, base)):
        same += s.token_ids == b.token_ids
        print(f"\n=== prompt {i}: {prompts[i][-80:]!r}")
        print(f"--- {args.method} (k={args.k}) ---\n{s.text}")
        print(f"--- target only ---\n{b.text}")
        print(f"[identical token ids: {s.token_ids == b.token_ids}]")
    print(f"\n{args.method}: {spec_tps:.1f} tokens/s, acceptance rate "
          f"{acceptance if acceptance is None else round(acceptance, 3)}; target only: "
          f"{base_tps:.1f} tokens/s; speed-up {spec_tps / base_tps:.2f}x; batch size {args.batch_size}; "
          f"{same}/{len(prompts)} outputs identical to target-only greedy")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
