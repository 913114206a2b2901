"""The offline replay's count (`python -m exspec.bench.replay`, whose doc says what it measures
and why it holds): a recorded output replayed through a host proposer, step by step, as the
greedy target produced it; decode steps, committed tokens, tokens proposed and kept. Also
`exspec-bench --tokens-per-step`'s figures for the lookup proposers (tokens_per_step.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig
from ..spec.lookup import StandaloneRow
from ..spec.registry import proposer_for
from ..vllm_args import translate


@dataclass
class Trace:
    prompt_ids: list[int]
    output_ids: list[int]
    category: str = ""


@dataclass
class Tally:
    """One replay's counts (of a category, or all): decode steps, the tokens they committed,
    tokens proposed and kept."""
    steps: int = 0
    tokens: int = 0
    proposed: int = 0
    kept: int = 0

    def add(self, other: "Tally") -> None:
        self.steps += other.steps
        self.tokens += other.tokens
        self.proposed += other.proposed
        self.kept += other.kept

    @property
    def tokens_per_step(self) -> float | None:
        return self.tokens / self.steps if self.steps else None

    @property
    def kept_share(self) -> float | None:
        return self.kept / self.proposed if self.proposed else None


def proposer_of(spec: dict):
    """vLLM's speculative_config (method ngram or suffix, their keys) -> (the engine's proposer,
    k); refused as model.json would refuse it."""
    if spec.get("method") not in ("ngram", "suffix"):
        raise ValueError(f"speculative_config method must be 'ngram' or 'suffix' (host "
                         f"proposers: a draft model or head needs the target), got {spec!r}")
    keys, _ = translate({"model": "replay", "speculative_config": spec})
    config = EngineConfig(**{k: v for k, v in keys.items() if k != "default_max_tokens"},
                          method="exspec")
    if config.num_speculative_tokens < 1:   # the engine's plain steps: nothing to replay
        raise ValueError(f"num_speculative_tokens must be >= 1 (k = 0 proposes nothing), "
                         f"got {spec!r}")
    return proposer_for(config, None, 0), config.num_speculative_tokens


def replay_one(proposer, trace: Trace, k: int) -> Tally:
    """One request, served alone at fixed k: its decode steps and what they committed."""
    # the prefill committed the first output token
    row = StandaloneRow(trace.prompt_ids + trace.output_ids[:1], len(trace.prompt_ids))
    out = trace.output_ids
    tally = Tally()
    while row.num_tokens - row.num_prompt_tokens < len(out):
        at = row.num_tokens - row.num_prompt_tokens   # output tokens committed
        proposal = proposer.propose_row(row, row.drafts_at(k))
        kept = 0
        while kept < len(proposal) and at + kept < len(out) and proposal[kept] == out[at + kept]:
            kept += 1
        new = out[at:at + kept + 1]   # the kept proposal and the target's next token
        row.tokens += new
        tally.steps += 1
        tally.tokens += len(new)
        # as the engine counts drafts (Sequence.count_drafts): in the step that ends the output,
        # only those at positions it reached
        ended = at + len(new) == len(out)
        tally.proposed += min(len(proposal), len(new)) if ended else len(proposal)
        tally.kept += kept
    proposer.request_done(row, "stop")
    return tally


def replay(spec: dict, traces: list[Trace], warm: int = 0) -> dict[str, Tally]:
    """Every trace in order through one proposer; the first `warm` are served (suffix decoding
    learns from them) but not counted. Tallies per category, and "all"."""
    proposer, k = proposer_of(spec)
    tallies: dict[str, Tally] = {}
    for i, trace in enumerate(traces):
        tally = replay_one(proposer, trace, k)
        if i >= warm:
            for key in {"all", trace.category} - {""}:
                tallies.setdefault(key, Tally()).add(tally)
    return tallies
