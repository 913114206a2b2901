"""DraftModelProposer: a smaller LLM drafts k tokens per row with its own KV cache (vLLM's
"draft_model" method; design: "Proposers").

Its cache follows the target's rows (a KVState in the group): it is fed every prompt chunk the
target is fed, then, per step, what it lacks (the pending token, and after plain steps the tokens
it missed, in one catch-up forward), and drafts autoregressively. It may lag the target by one
entry after a fully accepted step (I3); `commit` cuts it back to what each row kept.
"""
from __future__ import annotations

import torch

from ..models.loading import load_model
from ..sampling.structured_output import apply_masks
from ..speculative import SpeculativeConfig, SpeculativeMethod
from .draft_stop import confidence_bin, confidences
from .proposer import KVState, Plan, Proposal, Proposer, Runner, StepState
from .vocab import PaddedVocab


class DraftModelProposer(Proposer):
    speculative_method = SpeculativeMethod(
        "draft_model", usage="with a draft model (method 'draft_model' and 'model')",
        model="the draft model's path or name")
    proposes = True
    gives_confidences = True

    def __init__(self, model, vocab: PaddedVocab | None = None):
        self.model = model
        self.models = self.kv_models = (model,)
        self.vocab = vocab   # set when draft and target differ by padding rows

    @classmethod
    def load_draft(cls, config):
        """The draft LLM (none for k = 0 without one: the method's layout alone)."""
        return load_model(config.draft_model, config, "draft") if config.draft_model else None

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair, pad_id: int) -> "DraftModelProposer":
        return cls(pair.draft, PaddedVocab.of(pair.target, pair.draft, pair.tokenizer, pad_id))

    def new_state(self, layout, batch: int, device) -> KVState:
        return KVState(layout.empty(self.model, batch, device), self.model)

    def _forward(self, runner: Runner, kv, ids, pos, valid, counts, decode: bool = True):
        """The draft's forward in the target's vocabulary (vocab.py)."""
        if self.vocab is not None:
            ids = self.vocab.draft_ids(ids)
        logits = runner.forward(self.model, kv, ids, pos, valid, counts, keep=1, decode=decode)
        return logits if self.vocab is None else self.vocab.draft_logits(logits)

    def prefill(self, runner: Runner, state: KVState, ragged: tuple) -> None:
        ids, pos, valid, fed = ragged
        self._forward(runner, state.kv, ids, pos, valid, fed, decode=False)
        runner.stats.add("prefill_tokens_draft", sum(fed))

    def stage(self, runner: Runner, state: KVState, seqs, plan: Plan, upload):
        """Its first forward's input (what its cache lacks: 1-2 tokens per row) and, after plain
        steps, a catch-up input for what it missed before that; room for it and k - 1 drafts."""
        if plan.width == 0:
            return None, {}
        cached = [state.cached(i) for i in range(len(seqs))]
        tails, starts = [s.tokens[n:] for s, n in zip(seqs, cached)], cached
        catch_up = None
        if max(len(t) for t in tails) > 2:   # more than a first draft forward feeds anyway
            behind = [t[:-1] for t in tails]
            catch_up = (behind, runner.stage_ragged(upload, behind, starts))
            tails, starts = [t[-1:] for t in tails], [s.num_tokens - 1 for s in seqs]
        first = (tails, runner.stage_ragged(upload, tails, starts))
        room = {state.kv: [s.num_tokens - n + plan.width - 1 for s, n in zip(seqs, cached)]}
        return (catch_up, first), room

    def propose(self, runner: Runner, state: KVState, seqs, plan: Plan, staged,
                sent: list[torch.Tensor], step: StepState) -> Proposal:
        catch_up, (tails, at) = staged
        if catch_up is not None:
            self.catch_up(runner, state, runner.read_ragged(sent[catch_up[1]], catch_up[0]))
        with runner.stats.timer("draft"):
            return self._draft(runner, state, len(seqs), plan.width, step,
                               runner.read_ragged(sent[at], tails))

    def catch_up(self, runner: Runner, state: KVState, ragged: tuple) -> None:
        """After plain steps the draft lags; feed it what it missed in one batched forward
        (`ragged`: its input, which came up with the step's other inputs)."""
        ids, pos, valid, counts = ragged
        with runner.stats.timer("prefill"):
            self._forward(runner, state.kv, ids, pos, valid, counts)
            runner.stats.add("prefill_tokens_draft", sum(counts))

    def _draft(self, runner: Runner, state: KVState, batch: int, k: int, step: StepState,
               first_input) -> Proposal:
        """k draft tokens per row (their distributions when sampling, and with `step.stop` their
        confidence bins), feeding the draft only what its cache lacks (`first_input`: ids,
        positions, validity, counts). With `stop` (draft_stop.RoundStop), maybe fewer: the
        round ends after a draft where the rows' confidences say drafting on does not pay; the
        verification's answer does not depend on how many drafts it checks.
        With grammars (`step.masks`, their first position's started), each draft is proposed
        under its position's mask and, after it, the next position's mask is started from the
        drafts so far; it fills on the host while the next forward (draft, or the verification)
        runs (one copy down, one up per draft: a constrained group's price)."""
        rows, u, noise, masks = step.rows, step.uniforms, step.noise, step.masks
        stop = step.stop if step.coupled else None
        drafted: list[list[int]] = [[] for _ in range(batch)]
        ids, pos, valid, counts = first_input
        tokens, probs, seen = [], [], []
        for j in range(k):
            logits = self._forward(runner, state.kv, ids, pos, valid, counts)
            if step.processing is not None:   # the target's rule, on the drafts so far
                logits = step.processing.apply(logits, torch.stack(tokens, 1) if tokens else None, j)
            logits = apply_masks(logits, masks, j)
            token, q = runner.pick(logits[:, 0], rows, None if noise is None else noise[:, j:j + 1],
                                   None if u is None else u[:, j])
            tokens.append(token)
            probs.append(q)
            if masks is not None:   # the grammars' state after this draft: its mask
                for row, t in zip(drafted, runner.transfers.to_host(token)):
                    row.append(t)
                masks.extend(drafted, j + 2)
            if stop is not None:
                seen.append(confidences(logits[:, 0]))
                # one host read per draft that may end the round (draft_stop.RoundStop)
                if j + 1 < k and stop.ends_after(j + 1, runner.transfers.to_host(seen[-1])):
                    break
            if j + 1 < k:
                ids, pos = token[:, None], (step.next_pos + j)[:, None]
                valid, counts = torch.ones_like(ids, dtype=torch.bool), [1] * batch
        runner.stats.add("draft_forwards", len(tokens))
        # the drafts' confidence bins, the calibration's input, come down with the step's copy
        bins = confidence_bin(torch.stack(seen, 1)) if seen else None
        return Proposal(len(tokens), torch.stack(tokens, 1),
                        None if probs[0] is None else torch.stack(probs, 1),
                        masks=masks, confidence_bins=bins)

    def commit(self, state: KVState, width: int, accepted: list[int], kept: torch.Tensor) -> None:
        """The draft holds m + width - 1 entries of a row (its last draft was never fed) and
        keeps at most m + a."""
        if width > 0:
            state.kv.drop_tail([max(0, width - 1 - a) for a in accepted],
                               (width - 1 - kept).clamp_min(0))

    def commit_undrafted(self, state: KVState, width: int, accepted: list[int],
                         kept: torch.Tensor) -> None:
        """A step verified drafts it did not make (a hybrid's all-suffix step): its cache holds
        what it held, and its next drafting step catches up what it lacks (`stage`)."""
