"""NgramProposer: speculation without a draft model (prompt lookup; vLLM's "ngram" method).

A row's proposal is what followed the most recent earlier occurrence of its last n tokens in
its own prompt + output, n from prompt_lookup_max down to prompt_lookup_min, up to k tokens.
No model, no KV cache, no forward: it pays where outputs repeat their input (edits, answers from
a passage) and proposes nothing elsewhere. A proposal is only a proposal: the target verifies
it as it verifies a draft model's (design: "Proposers").

A host proposer: its proposals are known when the step is planned, so each row proposes its own
number of tokens, a constrained row only what its grammar accepts, and the verification input
([pending, proposal] per row, left-padded) goes up in the step's one upload.
"""
from __future__ import annotations

from .proposer import Plan, Proposal, Proposer, Runner, StepState


class NgramProposer(Proposer):
    name = "ngram"
    proposes = True

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix of
        `tokens` (n from max_n down to min_n); [] when none matches or k is 0."""
        if k <= 0:
            return []
        last = len(tokens)
        for n in range(min(self.max_n, last - 1), self.min_n - 1, -1):
            suffix = tokens[last - n:]
            # a match must end before the suffix does, so that something follows it
            for start in range(last - n - 1, -1, -1):
                if tokens[start + n - 1] == suffix[-1] and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def plan(self, runner: Runner, seqs, k: int) -> Plan:
        if k == 0:
            return Plan(0, [0] * len(seqs))
        with runner.stats.timer("draft"):
            proposals = [self.lookup(s.tokens, s.drafts_at(k)) for s in seqs]
            # a constrained row proposes only what its grammar accepts
            proposals = [p if s.grammar is None else p[:s.grammar.valid_prefix(p)]
                         for s, p in zip(seqs, proposals)]
        width = max(map(len, proposals))
        if width == 0:   # no row found a match: a plain step
            return Plan(0, [0] * len(seqs))
        return Plan(width, [len(p) for p in proposals], proposals)

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
