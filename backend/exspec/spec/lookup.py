"""LookupProposer: the shared step of proposers that look their proposals up on the host (n-gram,
suffix decoding): no model, no KV cache, no forward.

Their proposals are known when the step is planned, so each row proposes its own number of
tokens, a constrained row only what its grammar accepts, and the verification input ([pending,
proposal] per row, left-padded) goes up in the step's one upload. A subclass says only how a row's
tokens are indexed (`index`), how it proposes from them (`propose_indexed`) and what it keeps per
request.

Each step a row's index takes in the tokens the row committed since the last one, and a new
row's prompt a share of `index_budget` tokens a step across the group (each row may always index
what one step commits), timed as prefill, not as drafting. Indexed at once, a 16k-token prompt
stalled its whole group ~0.8 s (suffix tree) at its first step, and, timed as drafting, priced
speculation out of adaptive k for a thousand steps. Until its prompt is indexed, a row proposes
from the part that is.
"""
from __future__ import annotations

from .proposer import Plan, Pricing, Proposal, Proposer, Row, Runner, StepState


def priced(runner: Runner, proposals: list[list[int]], pricing: Pricing | None,
           drafted: bool = True) -> list[list[int]]:
    """Host proposals cut to the width adaptive k prices as paying (`pricing.width`; `drafted`:
    whether a draft price comes with each verified width), the tokens cut counted; without
    pricing, or with nothing proposed, as they are."""
    lengths = [len(p) for p in proposals]
    if pricing is None or not any(lengths):
        return proposals
    width = pricing.width(lengths, drafted)
    runner.stats.add("cut_proposal_tokens", sum(max(0, n - width) for n in lengths))
    return [p[:width] for p in proposals]


class StandaloneRow:
    """A row outside the engine (the cost benches', the replay's), as a lookup proposer reads it
    (proposer.Row): its tokens, prompt then output, the last pending; no grammar, no own cap."""
    grammar = None

    def __init__(self, tokens: list[int], num_prompt_tokens: int):
        self.tokens, self.num_prompt_tokens = tokens, num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def pending_token(self) -> int:
        return self.tokens[-1]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    def drafts_at(self, k: int) -> int:
        return k


class LookupProposer(Proposer):
    proposes = True
    proposes_on_host = True
    index_budget = 1024   # tokens a step indexes across its rows (subclasses scale it by cost)

    def index(self, row: Row, budget: int | None = None) -> int:
        """Index up to `budget` more of the row's tokens (None: all of them); returns how many."""
        raise NotImplementedError

    def propose_indexed(self, row: Row, k: int) -> list[int]:
        """Up to k tokens for this row from what is indexed of it; [] for none."""
        raise NotImplementedError

    def propose_row(self, row: Row, k: int) -> list[int]:
        """Up to k tokens for this row, its tokens all indexed first (public: the cost benches
        and the replay call it outside a step)."""
        self.index(row)
        return self.propose_indexed(row, k)

    def index_rows(self, runner: Runner, seqs, k: int) -> None:
        """Each row's index takes its new tokens, a new prompt a share of `index_budget` (module
        doc); timed as prefill: one-off work, bounded a step, left out of the step's price."""
        with runner.stats.timer("prefill"):
            budget, indexed = self.index_budget, 0
            for s in seqs:   # each row indexes at least what a step commits, to stay current
                done = self.index(s, max(budget, k + 1))
                budget, indexed = budget - done, indexed + done
        runner.stats.add("indexed_tokens", indexed)

    def plan(self, runner: Runner, seqs, k: int, pricing=None) -> Plan:
        if k == 0:
            return Plan(0, [0] * len(seqs))
        self.index_rows(runner, seqs, k)
        with runner.stats.timer("draft"):
            proposals = [self.propose_indexed(s, s.drafts_at(k)) for s in seqs]
            # a constrained row proposes only what its grammar accepts
            proposals = [p if s.grammar is None else p[:s.grammar.valid_prefix(p)]
                         for s, p in zip(seqs, proposals)]
        lengths = [len(p) for p in proposals]
        proposals = priced(runner, proposals, pricing)   # what pays of the rows' proposals
        width = max(map(len, proposals))
        if width == 0:   # no row found a match, or none that pays: a plain step
            return Plan(0, [0] * len(seqs))
        return Plan(width, [len(p) for p in proposals], proposals, lengths)

    def stage(self, runner: Runner, state, seqs, plan: Plan, upload):
        """The verification's input: [pending, proposal] per row, left-padded."""
        if plan.tokens is None:
            return None, {}
        tails = [[s.pending_token] + p for s, p in zip(seqs, plan.tokens)]
        return (tails, runner.stage_ragged(upload, tails, [s.num_tokens - 1 for s in seqs])), {}

    def propose(self, runner: Runner, state, seqs, plan: Plan, staged, sent, step: StepState) -> Proposal:
        if staged is None:
            return Proposal(0, masks=step.masks)
        tails, at = staged
        return Proposal(plan.width, verify_input=runner.read_ragged(sent[at], tails), masks=step.masks)
