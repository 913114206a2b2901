"""ModelRunner: prefill a group, and one speculative (or plain) step on a group
(design: "One speculative step").

step = draft k tokens with the draft's own cache -> verify [pending, d1..dk] in one target pass
-> accept -> commit per row -> cut both caches back to I3. The acceptance rules are in sampler.py:
greedy rows and the gumbel coupling accept while the draft's token equals the target's; the
rejection coupling runs speculative rejection sampling.
Positions are explicit per row (I1) and the attention mask comes from the caches' validity (I2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_stop import confidence_bins
from .faults import Faults
from .group import Group
from .kv import PaddedKV
from .logits_processing import RowProcessing, processes_logits
from .logprobs import token_logprobs
from .noise import gumbel
from .sampler import RowSampling, accept, coupled_tokens, probs_from_logits, sample
from .sequence import Sequence
from .stats import Stats
from .transfer import Transfers
from .vocab import PaddedVocab, logit_rows


@dataclass
class StepResult:
    committed: list[list[int]]   # per row, after stop truncation
    num_accepted: list[int]      # per row, accepted drafts (before stop truncation)
    k: int                       # drafts per row this step ran (fewer than planned if stopped)
    confidence_bins: list[list[int]] | None = None   # per row, its drafts' (with `stop`)


class ModelRunner:
    def __init__(self, target, draft, pad_id: int, device: str, stats: Stats, kv_layout=PaddedKV,
                 faults: Faults | None = None, vocab: PaddedVocab | None = None,
                 coupling: str = "gumbel"):
        self.faults = faults or Faults(None)
        self.vocab = vocab           # set when draft and target differ by padding rows
        self.coupling = coupling     # "gumbel" or "rejection" (sampler.py)
        # Gumbel noise covers the wider vocabulary of the two (a padded target's, say)
        self.noise_width = max(logit_rows(m) for m in (target, draft) if m is not None)
        self.logits_width = logit_rows(target)   # the draft's logits come widened to it (vocab.py)
        self.kv_layout = kv_layout   # PaddedKV (EQSPEC, realigned) or kv_blocks.BlockStores (EXSPEC)
        self.target = target
        self.draft = draft
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.stats = stats
        self.transfers = Transfers(device)
        self.decode_forwards: dict = {}   # model -> its compiled forward (compiled.py), if used

    # -- building blocks ----------------------------------------------------------------------
    def _ragged_input(self, tails: list[list[int]], starts: list[int], extra: list[list[int]] = ()):
        """Left-padded ids, positions and validity for rows feeding different token counts, plus
        `extra` per-row host ints ([E][B]), built on the host and sent in one copy."""
        width = max(len(t) for t in tails)
        ids, pos, valid = [], [], []
        for tail, start in zip(tails, starts):
            pad = width - len(tail)
            ids += [self.pad_id] * pad + tail
            pos += [0] * pad + list(range(start, start + len(tail)))
            valid += [0] * pad + [1] * len(tail)
        rows = len(tails)
        flat = self.transfers.ints_to_device(ids + pos + valid + [v for row in extra for v in row])
        inputs = flat[:3 * rows * width].view(3, rows, width)
        counts = [len(t) for t in tails]
        return inputs[0], inputs[1], inputs[2].bool(), counts, flat[3 * rows * width:].view(len(extra), rows)

    def _forward(self, model, kv, ids, pos, valid, counts: list[int], keep: int, decode=True):
        """decode: a forward of a step (compiled on the compiled path); a prefill is not."""
        self.faults.before_forward()
        to_target_vocab = self.vocab is not None and model is self.draft
        if to_target_vocab:
            ids = self.vocab.draft_ids(ids)
        forward = self.decode_forwards.get(model, model) if decode else model
        if forward is not model:   # compiled: inputs of one stride pattern (a copy on EQSPEC's views)
            self.stats.add("realign_bytes", kv.make_contiguous())
            if ids.shape[1] == 1 and kv.free_pads:
                # fed as two tokens, a pad first (its entry goes to scratch): torch compiles a
                # width of 1 apart, so this halves the graphs the warm-up compiles
                ids, pos, valid = (torch.cat([torch.full_like(t[:, :1], fill), t], dim=1)
                                   for t, fill in ((ids, self.pad_id), (pos, 0), (valid, False)))
        mask = kv.attention_mask(valid, counts, pos, always=forward is not model)
        out = forward(input_ids=ids, attention_mask=mask, position_ids=pos,
                      cache=kv.cache, use_cache=True, logits_to_keep=keep)
        kv.appended(valid, counts)
        # a target spread over GPUs ends on its last GPU; sampling lives on the engine's device
        logits = out.logits.to(self.device)
        return self.vocab.draft_logits(logits) if to_target_vocab else logits

    def _uniforms(self, seqs: list[Sequence], count: int) -> torch.Tensor:
        """[B, count] uniforms: each sampled row draws from its own seeded generator, in order,
        so a request's output does not depend on what else is in the batch."""
        u = torch.full((len(seqs), count), 0.5)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                u[row] = torch.rand(count, generator=seq.generator)
        return self.transfers.to_device(u)

    def _noise(self, rows: RowSampling, first: torch.Tensor, count: int) -> torch.Tensor | None:
        """[B, count, V] Gumbel noise of each row's positions first .. first+count-1 (`first` [B],
        on the device), computed once per step and shared by the draft's proposals and the
        target's verification; None when no row needs it (all greedy, or rejection sampling)."""
        if rows.all_greedy or self.coupling != "gumbel":
            return None
        positions = first[:, None] + torch.arange(count, device=self.device)
        return gumbel(rows.seed, positions, self.noise_width)

    # -- prefill --------------------------------------------------------------------------------
    def new_group(self, seqs: list[Sequence]) -> Group:
        """A group for sequences about to be prefilled: empty caches for both models."""
        target_kv = self.kv_layout.empty(self.target, len(seqs), self.device)
        draft_kv = None if self.draft is None else self.kv_layout.empty(self.draft, len(seqs), self.device)
        return Group(seqs, target_kv, draft_kv)

    @torch.inference_mode()
    def prefill(self, group: Group, counts: list[int]) -> list[bool]:
        """Feed row i its next counts[i] prompt tokens, batched, for both models (one chunk of
        a chunked prefill, or the whole prompt). A row that has now fed its whole prompt
        commits its first token; returns, per row, whether it did. The logits kept are the
        last column's: every row's last fed token (inputs are left-padded)."""
        seqs = group.seqs
        with self.stats.timer("prefill"):
            starts = [s.num_cached_target for s in seqs]
            chunks = [s.tokens[n:n + c] for s, n, c in zip(seqs, starts, counts)]
            ids, pos, valid, fed, _ = self._ragged_input(chunks, starts)
            logits = self._forward(self.target, group.target_kv, ids, pos, valid, fed, keep=1,
                                   decode=False)
            if self.draft is not None:
                self._forward(self.draft, group.draft_kv, ids, pos, valid, fed, keep=1, decode=False)
            for seq, chunk in zip(seqs, chunks):
                seq.num_cached_target += len(chunk)
                seq.num_cached_draft += len(chunk)
            done = [s.num_cached_target == s.num_prompt_tokens for s in seqs]
            rows = [i for i, d in enumerate(done) if d]
            if rows:   # each row's last fed token is in the last column: the next position follows
                self._first_tokens(group, logits, rows, pos[:, -1] + 1)
            n = sum(fed)
            self.stats.add("prefill_tokens_target", n)
            if self.draft is not None:
                self.stats.add("prefill_tokens_draft", n)
        return done

    def _first_tokens(self, group: Group, logits: torch.Tensor, rows: list[int],
                      next_pos: torch.Tensor) -> None:
        """Commit the first token of the given rows from their last prompt token's logits
        (next_pos [B]: each row's next position, on the device)."""
        seqs = [group.seqs[i] for i in rows]
        sampling = group.sampling(self.device, self.transfers.to_device)
        if len(rows) < len(group):
            sampling = RowSampling.from_params([s.params for s in seqs], self.device,
                                               [s.seed for s in seqs], self.transfers.to_device)
            index = self.transfers.ints_to_device(rows)
            logits, next_pos = logits[index], next_pos[index]
        scores = logits[:, :1]
        if any(processes_logits(s.params) for s in seqs):   # the history is the prompt alone
            scores = RowProcessing(seqs, self.logits_width, self.device,
                                   self.transfers.to_device).apply(scores)
        first, _ = self._pick(scores[:, 0], sampling, seqs, self._noise(sampling, next_pos, 1))
        lp = token_logprobs(logits[:, :1], first[:, None], [s.params.logprobs for s in seqs])
        for row, (seq, token) in enumerate(zip(seqs, self.transfers.to_host(first))):
            seq.append([token], lp[row])

    def catch_up_draft(self, group: Group) -> None:
        """After plain steps the draft lags; feed it what it missed (one batched prefill)."""
        lags = [s.num_tokens - s.num_cached_draft for s in group.seqs]
        if max(lags) <= 2:
            return  # the first draft forward of the next step feeds up to two tokens anyway
        with self.stats.timer("prefill"):
            tails = [s.tokens[s.num_cached_draft:-1] for s in group.seqs]
            ids, pos, valid, counts, _ = self._ragged_input(tails, [s.num_cached_draft for s in group.seqs])
            self._forward(self.draft, group.draft_kv, ids, pos, valid, counts, keep=1)
            for seq, tail in zip(group.seqs, tails):
                seq.num_cached_draft += len(tail)
            self.stats.add("prefill_tokens_draft", sum(len(t) for t in tails))

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, group: Group, k: int, stop: list[float] | None = None) -> StepResult:
        """One speculative step at k (0: plain): draft, verify, accept, commit. `stop`
        (draft_stop.py), per draft depth 1 .. k-1: a confidence below which, in every row, the
        round ends after that draft; with it the draft's confidences are measured and returned
        (a host read per draft token)."""
        seqs = group.seqs
        rows = group.sampling(self.device, self.transfers.to_device)
        coupled = self._coupled(rows)
        # rejection sampling: one uniform per draft token, per acceptance test, and for the final token
        u = None if coupled else self._uniforms(seqs, 2 * k + 1)
        if k > 0:
            self.catch_up_draft(group)
        draft_in, pending, start, caps = self._upload_step_inputs(group, k)
        processing = group.processing(self.logits_width, self.device, self.transfers.to_device)
        noise = self._noise(rows, start + 1, k + 1)   # gumbel: positions m .. m+k, draft and target alike

        draft_tokens = q = bins = None
        if k > 0:
            with self.stats.timer("draft"):
                draft_tokens, q, bins = self._draft(group, k, rows, processing, u, noise, draft_in,
                                                    start + 1, stop if coupled else None)
            if draft_tokens.shape[1] < k:   # the round stopped at an unsure draft
                self.stats.add("draft_stopped_steps")
                k = draft_tokens.shape[1]
                noise = None if noise is None else noise[:, :k + 1]

        with self.stats.timer("verify"):
            num_accepted, tokens, lp = self._verify(group, k, rows, processing, coupled, u, noise,
                                                    pending, start, draft_tokens, q)
            # the step's one device-to-host copy
            host = self.transfers.to_host(torch.cat([num_accepted[:, None], tokens]
                                                    + ([] if bins is None else [bins]), dim=1))
        lengths = [s.num_tokens for s in seqs]
        kept = torch.minimum(num_accepted, caps)
        committed, accepted = self._commit(group, k, host, lp, kept)
        if processing is not None:   # the device's own committed tokens: no copy back up
            processing.advance(tokens, kept, [m + a + 1 for m, a in zip(lengths, accepted)])
        self._count(seqs, k, accepted, committed)
        return StepResult(committed, accepted, k,
                          None if bins is None else [row[k + 2:] for row in host])

    def _upload_step_inputs(self, group: Group, k: int):
        """The step's one host-to-device copy: the draft's first input (what its cache lacks:
        1-2 tokens per row), per row the pending token, its position and the row's k cap, and
        the block table of a cache whose rows just took new blocks (as columns). Returns the
        draft's first input (ids, positions, validity, counts) and the pending tokens, their
        positions and the k caps, all on the device."""
        seqs = group.seqs
        per_row = [[s.pending_token for s in seqs], [s.num_tokens - 1 for s in seqs],
                   [s.drafts_at(k) for s in seqs]]
        tables = [(kv, table) for kv in (group.target_kv, group.draft_kv if k > 0 else None)
                  if kv is not None and (table := kv.table_rows_for(k + 1)) is not None]
        per_row += [list(column) for _, table in tables for column in zip(*table)]
        tails = [s.tokens[s.num_cached_draft:] for s in seqs] if k > 0 else [[]] * len(seqs)
        draft_in = self._ragged_input(tails, [s.num_cached_draft for s in seqs], per_row)
        pending, start, caps = draft_in[-1][:3]
        at = 3
        for kv, table in tables:
            kv.use_table(draft_in[-1][at:at + len(table[0])].T.contiguous())
            at += len(table[0])
        return draft_in[:4], pending, start, caps

    def _verify(self, group: Group, k: int, rows: RowSampling, processing: RowProcessing | None,
                coupled: bool, u, noise, pending, start, draft_tokens, q):
        """One target forward over [pending, d1..dk] per row; returns the accepted draft counts
        [B], the step's tokens [B, k+1] (row b commits tokens[b, :accepted + 1]) and the
        logprobs asked for."""
        seqs = group.seqs
        ids = pending[:, None] if k == 0 else torch.cat([pending[:, None], draft_tokens], dim=1)
        pos = start[:, None] + torch.arange(k + 1, device=self.device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        logits = self._forward(self.target, group.target_kv, ids, pos, valid, [k + 1] * len(seqs), keep=k + 1)
        # position j's processing sees the drafts before it, as a target-only run would
        scores = logits if processing is None else processing.apply(logits, draft_tokens)
        if coupled:   # the target's token at every position; accept while the draft agrees
            tokens = coupled_tokens(scores, rows, noise)
            matches = draft_tokens == tokens[:, :k] if k else tokens[:, :0].bool()
            num_accepted = matches.long().cumprod(-1).sum(-1)
        elif k == 0:
            num_accepted = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
            tokens = self._pick(scores[:, 0], rows, seqs, u=u[:, 0])[0].unsqueeze(1)
        else:
            p = probs_from_logits(scores, rows)
            num_accepted, tokens = accept(draft_tokens, q, p, u[:, k:2 * k], u[:, 2 * k])
        return num_accepted, tokens, token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])

    def _commit(self, group: Group, k: int, host, lp, kept: torch.Tensor):
        """Per row: commit the accepted drafts and the bonus token (stop rules apply, I5), then
        cut both caches back to I3 on the host and, from the device's own counts (`kept`, the
        accepted drafts within each row's cap), on the device: no copy back up."""
        committed, accepted = [], []
        target_cut, draft_cut = [], []
        for row, seq in enumerate(group.seqs):
            a = min(host[row][0], seq.drafts_at(k))
            m = seq.num_tokens
            accepted.append(a)
            committed.append(seq.append(host[row][1:a + 2], lp[row] and lp[row][:a + 1]))
            target_cut.append(k - a)                       # target holds m+k, keeps m+a
            seq.num_cached_target = m + a
            if k > 0:
                draft_cut.append(max(0, k - 1 - a))        # draft holds m+k-1, keeps <= m+a
                seq.num_cached_draft = min(m + k - 1, m + a)
                seq.observe_acceptance(a, k)
        group.target_kv.drop_tail(target_cut, k - kept)
        if k > 0:
            group.draft_kv.drop_tail(draft_cut, (k - 1 - kept).clamp_min(0))
        return committed, accepted

    def _draft(self, group: Group, k: int, rows: RowSampling, processing: RowProcessing | None,
               u: torch.Tensor | None, noise: torch.Tensor | None, first_input,
               next_pos: torch.Tensor, stop: list[float] | None = None):
        """k draft tokens per row (their distributions when sampling, and with `stop` their
        confidence bins), feeding the draft only what its cache lacks (`first_input`: ids,
        positions, validity, counts). With `stop`, maybe fewer: the round ends after draft j
        once every row's draft gives its token less than stop[j - 1] of its probability; the
        verification's answer does not depend on how many drafts it checks."""
        seqs = group.seqs
        ids, pos, valid, counts = first_input
        tokens, probs, logits_seen = [], [], []
        for j in range(k):
            logits = self._forward(self.draft, group.draft_kv, ids, pos, valid, counts, keep=1)
            if processing is not None:   # the target's rule, on the drafts so far
                logits = processing.apply(logits, torch.stack(tokens, 1) if tokens else None, j)
            token, q = self._pick(logits[:, 0], rows, seqs, None if noise is None else noise[:, j:j + 1],
                                  None if u is None else u[:, j])
            tokens.append(token)
            probs.append(q)
            if stop is not None:
                logits_seen.append(logits)
                # a host read only where this depth may end the round
                if j + 1 < k and stop[j] > 0 and bool((confidence_bins(logits[:, 0])[0] < stop[j]).all()):
                    break
            if j + 1 < k:
                ids, pos = token[:, None], (next_pos + j)[:, None]
                valid, counts = torch.ones_like(ids, dtype=torch.bool), [1] * len(seqs)
        # every draft's confidence bin at once (the calibration's input): one op per step, not per draft
        bins = confidence_bins(torch.cat(logits_seen, dim=1))[1] if logits_seen else None
        return (torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1), bins)

    def _coupled(self, rows: RowSampling) -> bool:
        """True when tokens are argmaxes (greedy, or gumbel noise) and acceptance is agreement."""
        return self.coupling == "gumbel" or rows.all_greedy

    def _pick(self, logits: torch.Tensor, rows: RowSampling, seqs, noise=None, u=None):
        """Next token per row from [B, V] logits: under the gumbel coupling (or greedy) the
        argmax, with noise [B, 1, V] of that position, no distribution built; else a sample on
        uniforms u [B] with its distribution q."""
        if self._coupled(rows):
            return coupled_tokens(logits[:, None], rows, noise)[:, 0], None
        q = probs_from_logits(logits[:, None], rows)[:, 0]
        u = self._uniforms(seqs, 1)[:, 0] if u is None else u
        return sample(q, u), q

    def _count(self, seqs, k, accepted, committed) -> None:
        s = self.stats
        s.add("steps")
        s.add_step(len(seqs), k)
        s.add("row_steps", len(seqs))
        s.add("committed_tokens", sum(len(c) for c in committed))
        if k == 0:
            s.add("plain_steps")
        else:
            s.add("draft_tokens", k * len(seqs))
            s.add("accepted_tokens", sum(accepted))
