"""`python -m exspec.demo.engine`: the engine on a model pair, speculative vs target-only, side by side.

With --real, the real pair (SmolLM2-135M-Instruct with the EAGLE-3 head trained for it, else its
trained draft; exspec.models.real_pair) on chat questions through its own chat template. Otherwise
the toy pair, a tiny code model for fast tests: the shipped demo pair
(model_repository/exspec/1/demo) when present, else a small seeded pair built locally.

It runs on the compiled decode path (`--path compiled`, enforce_eager false: torch.compile with
inductor, warmed up before anything is timed, its compile cache reused by the next run; a
machine whose compiler fails falls back to the eager path and says why), or with `--path eager`
on Hugging Face's own forward. It names the processor, then measures what verifying 2 .. k + 1
tokens costs here against one on that path (check_cost.py): those ratios decide whether a given
proposer pays. Then two cases, each against
the target alone, the two engines timed tick by tick in turn (the benchmark's run_interleaved)
over the same prompts, --repeats times, the speed-up the median of the repeats (case.py):
1. the pair's own proposer (the EAGLE-3 head or the draft) on chat questions;
2. suffix decoding (`"proposer": "suffix"`, no draft model) on repeated asks: two-turn chats whose
   second turn asks for the first answer again with a change (bench/prompts/multiturn.jsonl, the
   first turn answered by the target, greedy), where speculation pays even where a wide check
   costs much more than one token.
Each case prints its outputs, whether they match target-only token for token in every repeat,
the acceptance rate (accepted / drafted tokens), tokens per step and tokens/s; and it exits 1
unless every output is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from .. import EngineConfig, LLMEngine, SamplingParams
from ..models.loading import ModelPair, load_pair
from ..utils.machine import processor_name
from . import check_cost
from .case import CaseResult, run_case

DEMO_DIR = Path(__file__).resolve().parents[3] / "model_repository" / "exspec" / "1" / "demo"
REPEATED_ASKS = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "multiturn.jsonl"
FALLBACK_PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n\n", "for i in range(10):\n"]
REAL_PAIR = {"eagle3": "real pair: SmolLM2-135M-Instruct (float32) with the EAGLE-3 head trained "
                       "for it (scripts/train_smollm2_eagle3.py)",
             "draft_model": "real pair: SmolLM2-135M-Instruct (float32) with the draft trained for "
                            "it (6 layers, hidden 256: scripts/train_smollm2_draft.py)"}
TOY_PAIR = "toy pair: a tiny code model for fast tests, not an assistant"
SUFFIX = "suffix"   # case 2's proposer: suffix decoding, no draft model
PROPOSER_NAMES = {"eagle3": "the EAGLE-3 head", "draft_model": "the draft model",
                  SUFFIX: "suffix decoding"}


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


class _Engines:
    """The pair loaded once (each loaded model prints one "Loading weights" bar) and the engines
    over it: the target alone, and one speculative engine per proposer, each warmed up (one-off
    costs untimed). `proposer` "eagle3" reads the pair's eagle3/ head, "draft_model" its draft/."""

    def __init__(self, pair: Path, args, proposer: str):
        self.pair, self.args = pair, args
        self.common = dict(target_model=str(pair / "target"), tokenizer=str(_tokenizer_dir(pair)),
                           max_batch_size=args.batch_size, enforce_eager=args.path == "eager")
        self.models: ModelPair = load_pair(self._config(proposer))
        try:
            self.target_only = self._target_only()
        except Exception as exc:   # noqa: BLE001  (inductor: no C++ compiler, say)
            if args.path == "eager":
                raise
            print(f"the compiled path failed here ({type(exc).__name__}: {str(exc)[:200]}); "
                  "running on the eager path instead (--path eager)")
            args.path, self.common["enforce_eager"] = "eager", True
            self.target_only = self._target_only()

    def _target_only(self) -> LLMEngine:
        return self._warm(LLMEngine(
            EngineConfig(**self.common, method="autoregressive", num_speculative_tokens=0),
            pair=dataclasses.replace(self.models, draft=None, head=None)))

    def _config(self, proposer: str) -> EngineConfig:
        folder = {"eagle3": "eagle3", "draft_model": "draft"}.get(proposer)
        return EngineConfig(**self.common, method=self.args.method, proposer=proposer,
                            num_speculative_tokens=self.args.k,
                            draft_model=str(self.pair / folder) if folder else None)

    def speculative(self, proposer: str) -> LLMEngine:
        models = (dataclasses.replace(self.models, draft=None, head=None) if proposer == SUFFIX
                  else self.models)
        return self._warm(LLMEngine(self._config(proposer), pair=models))

    @staticmethod
    def _warm(engine: LLMEngine) -> LLMEngine:
        if engine.warm_up is not None:   # the compiled path: what its warm-up built, and how fast
            print(engine.warm_up.summary())
        engine.generate(["Hello"], SamplingParams(max_tokens=4))
        return engine


def _repeated_asks(base: LLMEngine, count: int, max_tokens: int) -> tuple[list[str], list[str]]:
    """`count` two-turn chats spread over the set's categories, each first turn answered by the
    target alone, greedy (what a client that keeps the conversation sends), and their second
    asks."""
    rows = [json.loads(line) for line in REPEATED_ASKS.read_text().splitlines() if line.strip()]
    rows = [rows[i * len(rows) // count] for i in range(min(count, len(rows)))]
    tok = base.tokenizer
    first = [[{"role": "user", "content": r["turns"][0]}] for r in rows]
    answers = base.generate([tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                             for m in first], SamplingParams(max_tokens=max_tokens))
    chats = [tok.apply_chat_template(m + [{"role": "assistant", "content": a.text.strip()},
                                          {"role": "user", "content": r["turns"][1]}],
                                     add_generation_prompt=True, tokenize=False)
             for m, a, r in zip(first, answers, rows)]
    return chats, [r["turns"][1] for r in rows]


def _print_outputs(result: CaseResult, shown: list[str], label: str) -> None:
    for i, (s, b) in enumerate(zip(result.speculative, result.target_only)):
        print(f"\n=== prompt {i}: {shown[i][-80:]!r}")
        print(f"--- {label} ---\n{s.text}")
        print(f"--- target only ---\n{b.text}")
        print(f"[identical token ids: {s.token_ids == b.token_ids}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", help="folder with tokenizer/, target/, draft/")
    parser.add_argument("--real", action="store_true",
                        help="the real pair (SmolLM2-135M-Instruct) on chat questions")
    parser.add_argument("--method", default="exspec", choices=["exspec", "eqspec"])
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts in each case")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=5, help="the most tokens one step proposes")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each case; its speed-up is their median")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--path", choices=("compiled", "eager"), default="compiled",
                        help="the decode path: compiled (torch.compile, warmed up first; a "
                             "minute or two the first time) or eager")
    args = parser.parse_args(argv)
    for flag in ("num_prompts", "max_tokens", "k", "batch_size", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    pair, prompts = _pair_dir(args)
    proposer = "draft_model"
    if args.real:
        from ..models.real_pair import demo_proposer
        proposer = demo_proposer(pair)
    print(f"{REAL_PAIR[proposer] if args.real else 'given pair' if args.pair else TOY_PAIR} ({pair})")
    engines = _Engines(pair, args, proposer)
    speculative = engines.speculative(proposer)
    print(f"on {processor_name()}, {torch.get_num_threads()} torch thread(s) (--threads), the "
          f"{args.path} decode path (--path); the speed-up depends on the processor:")
    cost = check_cost.measure(speculative, args.k + 1)
    print(cost.line())
    params = SamplingParams(max_tokens=args.max_tokens)
    label = lambda p: f"{args.method}, {PROPOSER_NAMES[p]}, k <= {args.k}"   # noqa: E731

    questions = prompts[:args.num_prompts]
    own = run_case(speculative, engines.target_only, questions, params, args.repeats)
    _print_outputs(own, questions, label(proposer))
    chats, asks = _repeated_asks(engines.target_only, args.num_prompts, args.max_tokens)
    suffix = run_case(engines.speculative(SUFFIX), engines.target_only, chats, params,
                      args.repeats)
    _print_outputs(suffix, asks, label(SUFFIX))

    what = "chat questions" if args.real else "code prompts"
    print(f"\ncase 1, {own.summary(f'{label(proposer)} on {len(questions)} {what}')}")
    asked = f"{len(chats)} repeated asks (two-turn chats)"
    print(f"case 2, {suffix.summary(f'{label(SUFFIX)} on {asked}')}")
    widths = cost.widths
    ratios = [cost.ratio(w) for w in widths]
    exact = own.exact and suffix.exact
    print(f"why they differ: a step pays where it commits more tokens than its check costs "
          f"({min(ratios):.2f}-{max(ratios):.2f}x a token here for {widths[0]}-{widths[-1]} "
          f"tokens); {PROPOSER_NAMES[proposer]} committed {own.tokens_per_step:.2f} tokens a step, "
          f"suffix decoding {suffix.tokens_per_step:.2f}; "
          f"{'every output exact' if exact else 'NOT every output exact (see above)'}; batch size "
          f"{args.batch_size}, {time.perf_counter() - started:.0f} s in all")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
