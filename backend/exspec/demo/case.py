"""CaseResult: one demo case, a speculative engine against the target alone on the same prompts,
timed tick by tick in turn (the benchmark's run_interleaved) over a few repeats."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .. import LLMEngine, SamplingParams
from ..bench.methods import Method, run_interleaved, stats_delta


class _Workload(Method):
    """One engine's generate of the prompts, a tick at a time: `run_interleaved` times two of
    them tick by tick (A B A B, each round in a seeded order), so both meet the same moments of
    the host, as the demo's served part alternates its requests."""
    device = "cpu"

    def __init__(self, engine: LLMEngine, params: SamplingParams):
        self.engine, self.params = engine, params

    def before_run(self, max_tokens: int) -> None:
        # a repeat learns only from its own earlier requests (suffix decoding's global tree),
        # not from the same prompts' answers in the repeat before
        self.engine.proposer.forget()

    def ticks(self, prompts, max_tokens):
        before = self.engine.stats()
        outs = yield from self.engine.generate_ticks(prompts, self.params)
        return outs, stats_delta(before, self.engine.stats())


@dataclass
class CaseResult:
    speculative: list          # the first repeat's outputs (CompletionOutput), per prompt
    target_only: list
    identical: int             # prompts whose token ids equal target-only's in every repeat
    speedups: list[float]      # per repeat: speculative tokens/s over target-only tokens/s
    spec_tps: float            # tokens/s, medians over the repeats
    base_tps: float
    acceptance: float | None   # accepted / drafted tokens over all repeats; None: none drafted
    tokens_per_step: float     # tokens a row commits per decoding step, over all repeats
    plain_share: float         # the speculative engine's steps that verified no proposal

    @property
    def speedup(self) -> float:
        return statistics.median(self.speedups)

    @property
    def exact(self) -> bool:
        return self.identical == len(self.speculative)

    def summary(self, label: str) -> str:
        acceptance = "n/a" if self.acceptance is None else f"{self.acceptance:.2f}"
        spread = (f" (median of {len(self.speedups)}: {min(self.speedups):.2f}-"
                  f"{max(self.speedups):.2f})" if len(self.speedups) > 1 else "")
        return (f"{label}: {self.spec_tps:.1f} tokens/s against target only's {self.base_tps:.1f}; "
                f"speed-up {self.speedup:.2f}x{spread}; {self.tokens_per_step:.2f} tokens a step, "
                f"{self.plain_share:.0%} of steps plain, acceptance rate {acceptance}; "
                f"{self.identical}/{len(self.speculative)} outputs identical to target-only greedy")


def run_case(spec: LLMEngine, base: LLMEngine, prompts: list[str], params: SamplingParams,
             repeats: int) -> CaseResult:
    """`repeats` interleaved runs of both engines over the prompts (each round of ticks in a new
    seeded order); every repeat's outputs are compared, the first's are kept."""
    runs = [run_interleaved([_Workload(spec, params), _Workload(base, params)], prompts,
                            params.max_tokens, "cpu", seed=repeat) for repeat in range(repeats)]
    identical = sum(all(s.outputs[i].token_ids == b.outputs[i].token_ids for s, b in runs)
                    for i in range(len(prompts)))
    tps = [[sum(len(o.token_ids) for o in run.outputs) / run.seconds for run in pair]
           for pair in runs]
    stats = [s.stats for s, _ in runs]
    total = lambda key: sum(s[key] for s in stats)   # noqa: E731
    drafted = total("draft_tokens")
    shapes = [(rows, k, n) for s in stats for (rows, k), n in s["steps_by_shape"].items()]
    steps = sum(n for _, _, n in shapes)
    return CaseResult(
        speculative=runs[0][0].outputs, target_only=runs[0][1].outputs, identical=identical,
        speedups=[s / b for s, b in tps], spec_tps=statistics.median(s for s, _ in tps),
        base_tps=statistics.median(b for _, b in tps),
        acceptance=total("accepted_tokens") / drafted if drafted else None,
        tokens_per_step=total("committed_tokens") / max(1, sum(rows * n for rows, _, n in shapes)),
        plain_share=sum(n for _, k, n in shapes if k == 0) / max(1, steps))
