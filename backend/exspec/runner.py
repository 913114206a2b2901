"""ModelRunner: prefill a group, and one speculative (or plain) step on a group
(design: "One speculative step").

step = draft k tokens with the draft's own cache -> verify [pending, d1..dk] in one target pass
-> accept -> commit per row -> cut both caches back to I3. The acceptance rules are in sampler.py:
greedy rows and the gumbel coupling accept while the draft's token equals the target's; the
rejection coupling runs speculative rejection sampling.
Proposals come from the draft model or, with no draft, from an n-gram proposer (ngram.py): then
each row proposes its own number of tokens, and verification feeds each row only its own.
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
from .ngram import NgramProposer
from .noise import gumbel
from .sampler import RowSampling, accept, coupled_tokens, probs_from_logits, sample
from .sequence import Sequence
from .stats import Stats
from .structured_output import StepMasks, apply_masks
from .transfer import Transfers, Upload, floats_from_bits
from .vocab import PaddedVocab, logit_rows


@dataclass
class StepInputs:
    """What a step's one upload brought to the device (`ModelRunner._upload_step_inputs`)."""
    catch_up: tuple | None   # the draft's catch-up forward: (ids, positions, validity, counts)
    draft: tuple             # the draft's first forward: (ids, positions, validity, counts)
    pending: torch.Tensor    # [B] each row's pending token
    start: torch.Tensor      # [B] its position
    caps: torch.Tensor       # [B] the row's k cap
    uniforms: torch.Tensor | None   # [B, 2k + 1] rejection sampling's
    masks: StepMasks | None  # the grammars' allowed tokens per verified position, being filled


@dataclass
class StepResult:
    committed: list[list[int]]   # per row, after stop truncation
    num_accepted: list[int]      # per row, accepted drafts (before stop truncation)
    k: int                       # drafts per row this step ran (fewer than planned if stopped)
    confidence_bins: list[list[int]] | None = None   # per row, its drafts' (with `stop`)
    proposed: list[int] | None = None   # per row, drafts verified when rows differ (n-gram)


class ModelRunner:
    def __init__(self, target, draft, pad_id: int, device: str, stats: Stats, kv_layout=PaddedKV,
                 faults: Faults | None = None, vocab: PaddedVocab | None = None,
                 coupling: str = "gumbel", proposer: NgramProposer | None = None):
        self.faults = faults or Faults(None)
        self.vocab = vocab           # set when draft and target differ by padding rows
        self.coupling = coupling     # "gumbel" or "rejection" (sampler.py)
        # Gumbel noise covers the wider vocabulary of the two (a padded target's, say)
        self.noise_width = max(logit_rows(m) for m in (target, draft) if m is not None)
        self.logits_width = logit_rows(target)   # the draft's logits come widened to it (vocab.py)
        self.kv_layout = kv_layout   # PaddedKV (EQSPEC, realigned) or kv_blocks.BlockStores (EXSPEC)
        self.target = target
        self.draft = draft
        self.proposer = proposer     # proposes instead of a draft model (then draft is None)
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.stats = stats
        self.transfers = Transfers(device)
        self.decode_forwards: dict = {}   # model -> its compiled forward (compiled.py), if used

    # -- building blocks ----------------------------------------------------------------------
    def _ragged_rows(self, tails: list[list[int]], starts: list[int]):
        """Left-padded ids, positions and validity ([B][W] each, on the host) for rows feeding
        different token counts: row i's tokens at positions starts[i], starts[i] + 1, ..."""
        width = max(len(t) for t in tails)
        ids, pos, valid = [], [], []
        for tail, start in zip(tails, starts):
            pad = width - len(tail)
            ids.append([self.pad_id] * pad + tail)
            pos.append([0] * pad + list(range(start, start + len(tail))))
            valid.append([0] * pad + [1] * len(tail))
        return ids, pos, valid

    def _stage_ragged(self, upload: Upload, tails: list[list[int]], starts: list[int]) -> int:
        """`_ragged_rows` as one [3, B, W] section of an upload (`_ragged` reads it back)."""
        parts = self._ragged_rows(tails, starts)
        return upload.add([v for part in parts for row in part for v in row],
                          3, len(tails), max(len(t) for t in tails))

    @staticmethod
    def _ragged(section: torch.Tensor, tails: list[list[int]]):
        """A sent `_stage_ragged` section: ids, positions, validity (device) and counts (host)."""
        return section[0], section[1], section[2].bool(), [len(t) for t in tails]

    @staticmethod
    def _stage_tables(upload: Upload, extra: dict) -> list[tuple]:
        """Room for extra[kv][i] more entries in row i of each cache, and, as sections, the
        block tables of those whose rows took new blocks (EXSPEC's; `_use_tables` installs
        them), so no forward sends a table of its own."""
        staged = []
        for kv, more in extra.items():
            table = kv.table_rows_for(more)
            if table is not None:
                staged.append((kv, upload.add([b for row in table for b in row], len(table), len(table[0]))))
        return staged

    @staticmethod
    def _use_tables(staged: list[tuple], sent: list[torch.Tensor]) -> None:
        for kv, at in staged:
            kv.use_table(sent[at])

    def _stage_sampling(self, upload: Upload, seqs: list[Sequence]) -> int | None:
        """The rows' sampling settings as a section (None when all are greedy: none to send)."""
        columns = RowSampling.host_columns([s.params for s in seqs], [s.seed for s in seqs])
        return None if columns is None else upload.add(columns, RowSampling.COLUMNS, len(seqs))

    def _stage_processing(self, upload: Upload, seqs: list[Sequence]) -> dict | None:
        """The rows' logits processing as sections (None when no row asks for any)."""
        if not any(processes_logits(s.params) for s in seqs):
            return None
        return RowProcessing.stage(upload, seqs, self.logits_width)

    @staticmethod
    def _sampling_sent(sent: list[torch.Tensor], at: int | None, seqs: list[Sequence]) -> RowSampling:
        """The settings `_stage_sampling` staged at `at`, as they arrived on the device."""
        return RowSampling.from_columns(None if at is None else sent[at], [s.params for s in seqs])

    def _stage_uniforms(self, upload: Upload, seqs: list[Sequence], count: int) -> int:
        """[B, count] uniforms as a section (float bits): each sampled row draws from its own
        seeded generator, in order, so a request's output does not depend on what else is in
        the batch (rejection sampling's; gumbel's noise needs none)."""
        u = torch.full((len(seqs), count), 0.5)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                u[row] = torch.rand(count, generator=seq.generator)
        return upload.add(u.view(torch.int32).reshape(-1).tolist(), len(seqs), count)

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
            done = [n + c == s.num_prompt_tokens for s, n, c in zip(seqs, starts, counts)]
            rows = [i for i, d in enumerate(done) if d]
            # one copy up: the chunks, and for rows that finish their prompt what picking
            # their first token needs
            upload = Upload()
            at = self._stage_ragged(upload, chunks, starts)
            first = self._stage_first_tokens(upload, group, rows)
            tables = self._stage_tables(upload, {kv: counts for kv in group.caches()})
            sent = upload.send(self.transfers)
            self._use_tables(tables, sent)
            ids, pos, valid, fed = self._ragged(sent[at], chunks)
            logits = self._forward(self.target, group.target_kv, ids, pos, valid, fed, keep=1,
                                   decode=False)
            if self.draft is not None:
                self._forward(self.draft, group.draft_kv, ids, pos, valid, fed, keep=1, decode=False)
            for seq, chunk in zip(seqs, chunks):
                seq.num_cached_target += len(chunk)
                seq.num_cached_draft += len(chunk)
            if rows:   # each row's last fed token is in the last column: the next position follows
                self._first_tokens(group, logits, rows, pos[:, -1] + 1, first, sent)
            n = sum(fed)
            self.stats.add("prefill_tokens_target", n)
            if self.draft is not None:
                self.stats.add("prefill_tokens_draft", n)
        return done

    def _stage_first_tokens(self, upload: Upload, group: Group, rows: list[int]):
        """What picking the first token of `rows` needs, staged: their sampling settings (the
        group's, kept, when every row finishes), the rows' index when only some do, and under
        rejection sampling their uniforms. Returns the sections' indices."""
        if not rows:
            return None, None, None, None, None
        seqs = [group.seqs[i] for i in rows]
        whole = len(rows) == len(group)
        sampling = None if (whole and group.sampling is not None) else self._stage_sampling(upload, seqs)
        index = None if whole else upload.add(rows, len(rows))
        u = None if self._coupled_params(seqs) else self._stage_uniforms(upload, seqs, 1)
        # the grammars' start masks fill while the prompt's forward runs (their own copy up)
        return (sampling, index, u, self._stage_processing(upload, seqs),
                StepMasks.start(seqs, self.transfers, self.logits_width, None, 1))

    def _first_tokens(self, group: Group, logits: torch.Tensor, rows: list[int],
                      next_pos: torch.Tensor, staged, sent: list[torch.Tensor]) -> None:
        """Commit the first token of the given rows from their last prompt token's logits
        (next_pos [B]: each row's next position, on the device; `staged`: the sections of
        `_stage_first_tokens` in `sent`)."""
        seqs = [group.seqs[i] for i in rows]
        sampling_at, index_at, u_at, processing_at, masks = staged
        if index_at is None:   # every row: the group's settings, kept for its steps
            if group.sampling is None:
                group.sampling = self._sampling_sent(sent, sampling_at, seqs)
            sampling = group.sampling
        else:
            sampling = self._sampling_sent(sent, sampling_at, seqs)
            logits, next_pos = logits[sent[index_at]], next_pos[sent[index_at]]
        u = None if u_at is None else floats_from_bits(sent[u_at])[:, 0]
        scores = logits[:, :1]
        if processing_at is not None:   # the history is the prompt alone
            scores = RowProcessing(sent, processing_at, seqs, self.logits_width).apply(scores)
        scores = apply_masks(scores, masks)   # the grammar's start state
        first, _ = self._pick(scores[:, 0], sampling, self._noise(sampling, next_pos, 1), u)
        lp = token_logprobs(logits[:, :1], first[:, None], [s.params.logprobs for s in seqs])
        for row, (seq, token) in enumerate(zip(seqs, self.transfers.to_host(first))):
            seq.append([token], lp[row])

    def _catch_up_draft(self, group: Group, catch_up) -> None:
        """After plain steps the draft lags; feed it what it missed in one batched forward
        (`catch_up`: its input, which came up with the step's other inputs)."""
        ids, pos, valid, counts = catch_up
        with self.stats.timer("prefill"):
            self._forward(self.draft, group.draft_kv, ids, pos, valid, counts, keep=1)
            for seq, count in zip(group.seqs, counts):
                seq.num_cached_draft += count
            self.stats.add("prefill_tokens_draft", sum(counts))

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, group: Group, k: int, stop: list[float] | None = None) -> StepResult:
        """One speculative step at k (0: plain): draft, verify, accept, commit. `stop`
        (draft_stop.py), per draft depth 1 .. k-1: a confidence below which, in every row, the
        round ends after that draft; with it the draft's confidences are measured and returned
        (a host read per draft token)."""
        seqs = group.seqs
        proposals = None
        if self.proposer is not None and k > 0:
            with self.stats.timer("draft"):
                proposals = [self.proposer.propose(s.tokens, s.drafts_at(k)) for s in seqs]
                # a constrained row proposes only what its grammar accepts
                proposals = [p if s.grammar is None else p[:s.grammar.valid_prefix(p)]
                             for s, p in zip(seqs, proposals)]
            k = max(map(len, proposals))
            if k == 0:   # no row found a match: a plain step
                proposals = None
        inputs = self._upload_step_inputs(group, k, proposals)
        rows = group.sampling
        coupled = self._coupled(rows)
        u = inputs.uniforms   # rejection sampling: one per draft token, per acceptance test, and for the final token
        if inputs.catch_up is not None:
            self._catch_up_draft(group, inputs.catch_up)
        pending, start, caps = inputs.pending, inputs.start, inputs.caps
        noise = self._noise(rows, start + 1, k + 1)   # gumbel: positions m .. m+k, draft and target alike

        draft_tokens = q = bins = None
        masks = inputs.masks
        if k > 0 and proposals is None:
            with self.stats.timer("draft"):
                draft_tokens, q, bins, masks = self._draft(group, k, rows, u, noise, inputs.draft,
                                                           start + 1, stop if coupled else None, masks)
            if draft_tokens.shape[1] < k:   # the round stopped at an unsure draft
                self.stats.add("draft_stopped_steps")
                k = draft_tokens.shape[1]
                noise = None if noise is None else noise[:, :k + 1]

        with self.stats.timer("verify"):
            if proposals is None:
                num_accepted, tokens, lp = self._verify(group, k, rows, coupled, u, noise, pending,
                                                        start, draft_tokens, q, masks)
            else:
                num_accepted, tokens, lp = self._verify_ragged(group, k, rows, coupled, u, noise,
                                                               inputs.draft, caps, masks)
            # the step's one device-to-host copy
            host = self.transfers.to_host(torch.cat([num_accepted[:, None], tokens]
                                                    + ([] if bins is None else [bins]), dim=1))
        proposed = None if proposals is None else [len(p) for p in proposals]
        lengths = [s.num_tokens for s in seqs]
        kept = torch.minimum(num_accepted, caps)
        committed, accepted = self._commit(group, k, host, lp, kept, proposed, caps)
        if group.processing is not None:   # the device's own committed tokens: no copy back up
            group.processing.advance(tokens, kept, [m + a + 1 for m, a in zip(lengths, accepted)])
        self._count(seqs, k, accepted, committed, proposed)
        return StepResult(committed, accepted, k,
                          None if bins is None else [row[k + 2:] for row in host], proposed)

    def _upload_step_inputs(self, group: Group, k: int,
                            proposals: list[list[int]] | None = None) -> "StepInputs":
        """The step's one host-to-device copy: the draft's catch-up input after plain steps, its
        first input (what its cache lacks: 1-2 tokens per row), per row the pending token, its
        position and the row's k cap, the block table of a cache whose rows take new blocks
        this step, the rows' sampling settings when the group is new or lost rows, and
        rejection sampling's uniforms. With `proposals` (no draft model) the first input is
        instead the verification's: [pending, proposal] per row, left-padded, and a row's cap
        is its proposal's length."""
        seqs = group.seqs
        upload = Upload()
        tails, starts = [[]] * len(seqs), [s.num_cached_draft for s in seqs]
        catch_up = None   # (what the draft lacks but the pending token, its section)
        caps = [s.drafts_at(k) for s in seqs]
        if proposals is not None:
            tails = [[s.pending_token] + p for s, p in zip(seqs, proposals)]
            starts, caps = [s.num_tokens - 1 for s in seqs], [len(p) for p in proposals]
        elif k > 0:
            tails = [s.tokens[s.num_cached_draft:] for s in seqs]
            if max(len(t) for t in tails) > 2:   # more than a first draft forward feeds anyway
                behind = [t[:-1] for t in tails]
                catch_up = (behind, self._stage_ragged(upload, behind, starts))
                tails, starts = [t[-1:] for t in tails], [s.num_tokens - 1 for s in seqs]
        draft_at = self._stage_ragged(upload, tails, starts)
        per_row = [s.pending_token for s in seqs] + [s.num_tokens - 1 for s in seqs] + caps
        per_row_at = upload.add(per_row, 3, len(seqs))
        # room for what each model is fed this step: the target k + 1 per row, the draft what it
        # lacks and k - 1 more drafts
        extra = {group.target_kv: [k + 1] * len(seqs)}
        if k > 0 and group.draft_kv is not None:
            extra[group.draft_kv] = [s.num_tokens - s.num_cached_draft + k - 1 for s in seqs]
        tables = self._stage_tables(upload, extra)
        sampling_at = self._stage_sampling(upload, seqs) if group.sampling is None else None
        if group.processing is not None and group.processing.lengths != [s.num_tokens for s in seqs]:
            group.processing = None   # a row's history moved on without it (a first token)
        processing_at = self._stage_processing(upload, seqs) if group.processing is None else None
        coupled = self._coupled_params(seqs)
        u_at = None if coupled else self._stage_uniforms(upload, seqs, 2 * k + 1)
        # the grammars' masks, filled while the forwards run: at every verified position for
        # proposals known here (n-gram), at the first for a draft model's (the rest follow its
        # drafts, `_draft`)
        masks = StepMasks.start(seqs, self.transfers, self.logits_width, proposals,
                                k + 1 if proposals is not None else 1)
        sent = upload.send(self.transfers)

        if group.sampling is None:
            group.sampling = self._sampling_sent(sent, sampling_at, seqs)
        if processing_at is not None:
            group.processing = RowProcessing(sent, processing_at, seqs, self.logits_width)
        columns = sent[per_row_at]
        self._use_tables(tables, sent)
        return StepInputs(
            catch_up=None if catch_up is None else self._ragged(sent[catch_up[1]], catch_up[0]),
            draft=self._ragged(sent[draft_at], tails), pending=columns[0], start=columns[1],
            caps=columns[2], uniforms=None if u_at is None else floats_from_bits(sent[u_at]),
            masks=masks)

    def _verify(self, group: Group, k: int, rows: RowSampling, coupled: bool, u, noise,
                pending, start, draft_tokens, q, masks=None):
        """One target forward over [pending, d1..dk] per row; returns the accepted draft counts
        [B], the step's tokens [B, k+1] (row b commits tokens[b, :accepted + 1]) and the
        logprobs asked for."""
        seqs = group.seqs
        ids = pending[:, None] if k == 0 else torch.cat([pending[:, None], draft_tokens], dim=1)
        pos = start[:, None] + torch.arange(k + 1, device=self.device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        logits = self._forward(self.target, group.target_kv, ids, pos, valid, [k + 1] * len(seqs), keep=k + 1)
        return self._accept(group, k, rows, coupled, u, noise, logits, draft_tokens, q, masks)

    def _verify_ragged(self, group: Group, k: int, rows: RowSampling, coupled: bool, u, noise,
                       verify_in, proposed, masks=None):
        """One target forward over each row's own [pending, proposal] (left-padded to k + 1;
        `proposed` [B]: each row's proposal length, on the device): a row without a proposal
        feeds one real token, and its pads are invalid inputs, as in a ragged prefill (never
        attended to; EXSPEC writes them to scratch, EQSPEC's realignment drops their hole).
        Row b's logits are then shifted left by its padding, so column j is its j-th verified
        position as in `_verify`; columns past its proposal repeat its last one and are never
        committed, as `proposed` caps its accepted count. A proposal is a point mass: under the
        gumbel coupling it is accepted while equal to the target's token; under rejection
        sampling q is one-hot at the proposed token, which also makes the token drawn at the
        cap (against a repeated filler) an exact sample of p there."""
        ids, pos, valid, counts = verify_in
        logits = self._forward(self.target, group.target_kv, ids, pos, valid, counts, keep=k + 1)
        shifted = ((k - proposed)[:, None] + torch.arange(k + 1, device=self.device)).clamp_max(k)
        logits = logits.gather(1, shifted[..., None].expand(-1, -1, logits.shape[-1]))
        draft_tokens = ids.gather(1, shifted)[:, 1:]
        q = None if coupled else torch.nn.functional.one_hot(draft_tokens, logits.shape[-1]).float()
        return self._accept(group, k, rows, coupled, u, noise, logits, draft_tokens, q, masks)

    def _accept(self, group: Group, k: int, rows: RowSampling, coupled: bool, u, noise, logits,
                draft_tokens, q, masks=None):
        """The accepted draft counts [B], the step's tokens [B, k+1] and the logprobs asked for,
        from the target's logits [B, k+1, V] at each row's verified positions (`masks`: the
        tokens each row's grammar allows there)."""
        seqs, processing = group.seqs, group.processing
        # position j's processing and grammar see the drafts before it, as a target-only run would
        scores = logits if processing is None else processing.apply(logits, draft_tokens)
        scores = apply_masks(scores, masks)
        if coupled:   # the target's token at every position; accept while the draft agrees
            tokens = coupled_tokens(scores, rows, noise)
            matches = draft_tokens == tokens[:, :k] if k else tokens[:, :0].bool()
            num_accepted = matches.long().cumprod(-1).sum(-1)
        elif k == 0:
            num_accepted = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
            tokens = self._pick(scores[:, 0], rows, u=u[:, 0])[0].unsqueeze(1)
        else:
            p = probs_from_logits(scores, rows)
            num_accepted, tokens = accept(draft_tokens, q, p, u[:, k:2 * k], u[:, 2 * k])
        return num_accepted, tokens, token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])

    def _commit(self, group: Group, k: int, host, lp, kept: torch.Tensor,
                proposed: list[int] | None = None, proposed_dev: torch.Tensor | None = None):
        """Per row: commit the accepted drafts and the bonus token (stop rules apply, I5), then
        cut both caches back to I3 on the host and, from the device's own counts (`kept`, the
        accepted drafts within each row's cap), on the device: no copy back up. `proposed`
        (host) and `proposed_dev`: each row's own proposal length, when rows verified
        different counts (no draft model)."""
        committed, accepted = [], []
        target_cut, draft_cut = [], []
        for row, seq in enumerate(group.seqs):
            verified = seq.drafts_at(k) if proposed is None else proposed[row]
            a = min(host[row][0], verified)
            m = seq.num_tokens
            accepted.append(a)
            committed.append(seq.append(host[row][1:a + 2], lp[row] and lp[row][:a + 1]))
            target_cut.append((k if proposed is None else verified) - a)   # target holds m+k, keeps m+a
            seq.num_cached_target = m + a
            if group.draft_kv is not None and k > 0:
                draft_cut.append(max(0, k - 1 - a))        # draft holds m+k-1, keeps <= m+a
                seq.num_cached_draft = min(m + k - 1, m + a)
            shown = k if proposed is None else verified
            if shown > 0:
                seq.observe_acceptance(a, shown)
        group.target_kv.drop_tail(target_cut, (k if proposed is None else proposed_dev) - kept)
        if group.draft_kv is not None and k > 0:
            group.draft_kv.drop_tail(draft_cut, (k - 1 - kept).clamp_min(0))
        return committed, accepted

    def _draft(self, group: Group, k: int, rows: RowSampling, u: torch.Tensor | None,
               noise: torch.Tensor | None, first_input, next_pos: torch.Tensor,
               stop: list[float] | None = None, masks: StepMasks | None = None):
        """k draft tokens per row (their distributions when sampling, and with `stop` their
        confidence bins), feeding the draft only what its cache lacks (`first_input`: ids,
        positions, validity, counts). With `stop`, maybe fewer: the round ends after draft j
        once every row's draft gives its token less than stop[j - 1] of its probability; the
        verification's answer does not depend on how many drafts it checks.
        With grammars (`masks`, their first position's started), each draft is proposed under
        its position's mask and, after it, the next position's mask is started from the drafts
        so far; it fills on the host while the next forward (draft, or the verification) runs
        (one copy down, one up per draft: a constrained group's price); returns the masks
        with every verified position's started."""
        seqs = group.seqs
        drafted: list[list[int]] = [[] for _ in seqs]
        ids, pos, valid, counts = first_input
        tokens, probs, logits_seen = [], [], []
        for j in range(k):
            logits = self._forward(self.draft, group.draft_kv, ids, pos, valid, counts, keep=1)
            if group.processing is not None:   # the target's rule, on the drafts so far
                logits = group.processing.apply(logits, torch.stack(tokens, 1) if tokens else None, j)
            logits = apply_masks(logits, masks, j)
            token, q = self._pick(logits[:, 0], rows, None if noise is None else noise[:, j:j + 1],
                                  None if u is None else u[:, j])
            tokens.append(token)
            probs.append(q)
            if masks is not None:   # the grammars' state after this draft: its mask
                for row, t in zip(drafted, self.transfers.to_host(token)):
                    row.append(t)
                masks.extend(drafted, j + 2)
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
        return (torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1), bins,
                masks)

    def _coupled(self, rows: RowSampling) -> bool:
        """True when tokens are argmaxes (greedy, or gumbel noise) and acceptance is agreement."""
        return self.coupling == "gumbel" or rows.all_greedy

    def _coupled_params(self, seqs: list[Sequence]) -> bool:
        """`_coupled` from the rows' parameters, before their settings are on the device."""
        return self.coupling == "gumbel" or all(s.params.greedy for s in seqs)

    def _pick(self, logits: torch.Tensor, rows: RowSampling, noise=None, u=None):
        """Next token per row from [B, V] logits: under the gumbel coupling (or greedy) the
        argmax, with noise [B, 1, V] of that position, no distribution built; else a sample on
        uniforms u [B] with its distribution q."""
        if self._coupled(rows):
            return coupled_tokens(logits[:, None], rows, noise)[:, 0], None
        q = probs_from_logits(logits[:, None], rows)[:, 0]
        return sample(q, u), q

    def _count(self, seqs, k, accepted, committed, proposed: list[int] | None = None) -> None:
        s = self.stats
        s.add("steps")
        s.add_step(len(seqs), k)
        s.add("row_steps", len(seqs))
        s.add("committed_tokens", sum(len(c) for c in committed))
        if k == 0:
            s.add("plain_steps")
        else:
            s.add("draft_tokens", k * len(seqs) if proposed is None else sum(proposed))
            s.add("accepted_tokens", sum(accepted))
