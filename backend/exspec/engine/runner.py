"""ModelRunner: prefill a group, and one speculative (or plain) step on a group
(design: "One speculative step").

step = plan (the proposer: width and caps, proposals known on the host) -> one upload ->
propose (a draft model drafts k tokens with its own cache) -> verify [pending, d1..dk] in one
target pass -> accept -> commit per row -> cut the caches back to I3. The acceptance rules are in
sampler.py: greedy rows and the gumbel coupling accept while the draft's token equals the
target's; the rejection coupling runs speculative rejection sampling. Where proposals differ in
length per row (n-gram), verification feeds each row only its own.
Positions are explicit per row (I1) and the attention mask comes from the caches' validity (I2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.blocks import row_bucket
from ..kv.padded import PaddedKV
from ..sampling.logits_processing import RowProcessing, processes_logits
from ..sampling.logprobs import token_logprobs
from ..sampling.noise import gumbel
from ..sampling.sampler import RowSampling, accept, coupled_tokens, point_mass, probs_from_logits, sample
from ..sampling.structured_output import StepMasks, apply_masks
from ..spec.proposer import Plan, Proposal, Proposer, StepState
from ..spec.vocab import logit_rows
from ..utils.faults import Faults
from ..utils.stats import Stats
from ..utils.transfer import Transfers, Upload, floats_from_bits
from .group import Group
from .sequence import Sequence


NO_TOKEN = ("no token is allowed at output position {}: the request's constraints "
            "(structured_outputs, allowed_token_ids, bad_words, min_tokens, logit_bias) leave none "
            "there; the output before it is kept")


def no_token_allowed(scores: torch.Tensor) -> torch.Tensor:
    """[B, T]: whether a position's processed scores [B, T, V] allow no token at all (all -inf,
    or NaN): a row that reaches one ends with an error rather than with an arbitrary token."""
    return ~(scores.amax(-1) > float("-inf"))


@dataclass
class StepInputs:
    """What a step's one upload brought to the device (`ModelRunner._upload_step_inputs`)."""
    proposer: object         # what the proposer staged (it reads its sections of `sent`)
    sent: list[torch.Tensor]  # the upload's sections
    pending: torch.Tensor    # [B] each row's pending token
    start: torch.Tensor      # [B] its position
    caps: torch.Tensor       # [B] the drafts the row may keep
    uniforms: torch.Tensor | None   # [B, 2k + 1] rejection sampling's
    masks: StepMasks | None  # the grammars' allowed tokens per verified position, being filled


@dataclass
class StepResult:
    committed: list[list[int]]   # per row, after stop truncation
    num_accepted: list[int]      # per row, accepted drafts (before stop truncation)
    k: int                       # drafts per row this step ran (fewer than planned if stopped)
    verified: list[int] | None = None   # per row, the drafts it may keep (its cap at k)
    confidence_bins: list[list[int]] | None = None   # per row, its drafts' (with `stop`)
    proposed: list[int] | None = None   # per row, drafts verified when rows differ (n-gram)
    lengths: list[int] | None = None    # ... and its proposal's length before a priced cut


class ModelRunner:
    def __init__(self, target, proposer: Proposer, pad_id: int, device: str, stats: Stats,
                 kv_layout=PaddedKV, faults: Faults | None = None, coupling: str = "gumbel"):
        self.faults = faults or Faults(None)
        self.coupling = coupling     # "gumbel" or "rejection" (sampler.py)
        # Gumbel noise covers the widest vocabulary of the models (a padded target's, say)
        self.noise_width = max(logit_rows(m) for m in (target, *proposer.models))
        self.logits_width = logit_rows(target)   # a draft's logits come widened to it (vocab.py)
        self.kv_layout = kv_layout   # PaddedKV (EQSPEC, realigned) or kv.blocks.BlockStores (EXSPEC)
        self.target = target
        self.proposer = proposer     # where drafts come from (proposer.py); chosen at load
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

    def stage_ragged(self, upload: Upload, tails: list[list[int]], starts: list[int]) -> int:
        """`_ragged_rows` as one [3, B, W] section of an upload (`read_ragged` reads it back)."""
        parts = self._ragged_rows(tails, starts)
        return upload.add([v for part in parts for row in part for v in row],
                          3, len(tails), max(len(t) for t in tails))

    @staticmethod
    def read_ragged(section: torch.Tensor, tails: list[list[int]]):
        """A sent `stage_ragged` section: ids, positions, validity (device) and counts (host)."""
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

    def forward(self, model, kv, ids, pos, valid, counts: list[int], keep: int, decode=True):
        """decode: a forward of a step (compiled on the compiled path); a prefill is not."""
        # a target spread over GPUs ends on its last GPU; sampling lives on the engine's device
        return self.forward_output(model, kv, ids, pos, valid, counts, keep, decode).logits.to(self.device)

    def forward_output(self, model, kv, ids, pos, valid, counts: list[int], keep: int,
                       decode=True, features: torch.Tensor | None = None):
        """`forward`'s model output, whole; `features` [B, q, hidden]: an EAGLE head's input
        beside the ids (spec/eagle3.py)."""
        forward = self.decode_forwards.get(model, model) if decode else model
        if forward is not model and forward.widest is not None and keep <= forward.widest < ids.shape[1]:
            return self._in_pieces(model, kv, ids, pos, valid, counts, keep, features, forward.widest)
        self.faults.before_forward()
        rows = ids.shape[0]
        if forward is not model:   # its rows may then be padded (static shapes)
            ids, pos, valid, features = self._compiled_inputs(forward, kv, ids, pos, valid, features)
        in_place = forward is not model and forward.reads_in_place(*ids.shape)
        mask = kv.attention_mask(valid, counts, pos, always=forward is not model, in_place=in_place)
        inputs = {} if features is None else {"features": features}
        out = forward(input_ids=ids, attention_mask=mask, position_ids=pos,
                      cache=kv.cache, use_cache=True, logits_to_keep=keep, **inputs)
        kv.appended(valid[:rows], counts)
        return out if ids.shape[0] == rows else _first_rows(out, rows, ids.shape[0])

    def _compiled_inputs(self, forward, kv, ids, pos, valid, features):
        """A compiled forward's inputs: of one stride pattern, a one-token forward fed as two,
        and with static shapes the rows padded to their bucket."""
        self.stats.add("realign_bytes", kv.make_contiguous())   # a copy on EQSPEC's views
        # Dynamo guards strides too: an expanded or sliced input (positions broadcast over
        # rows, say) would compile a new graph after the warm-up
        ids, pos, valid = _dense(ids), _dense(pos), _dense(valid)
        features = None if features is None else _dense(features)
        if ids.shape[1] == 1 and kv.free_pads:
            # fed as two tokens, a pad first (its entry goes to scratch): torch compiles a
            # width of 1 apart, so this halves the graphs the warm-up compiles
            pad = torch.nn.functional.pad
            ids, pos, valid = (pad(t, (1, 0), value=fill)
                               for t, fill in ((ids, self.pad_id), (pos, 0), (valid, False)))
            if features is not None:
                features = pad(features, (0, 0, 1, 0))
        rows = row_bucket(ids.shape[0]) if forward.static_shapes else ids.shape[0]
        if rows > ids.shape[0]:
            # a graph per row bucket, not per row count (CUDA graphs): pad rows of pad tokens,
            # invalid, so that they read and write only the scratch block; their outputs dropped
            ids, pos, valid = (_pad_rows(t, rows, fill)
                               for t, fill in ((ids, self.pad_id), (pos, 0), (valid, False)))
            features = None if features is None else _pad_rows(features, rows, 0)
        return ids, pos, valid, features

    def _in_pieces(self, model, kv, ids, pos, valid, counts: list[int], keep: int, features,
                   widest: int):
        """A decode forward wider than the graphs the warm-up built (a proposer's catch-up after
        more than k plain steps), as consecutive forwards through them of at most `widest`
        columns, the last one `widest` wide: each writes its columns' entries, the last gives
        the output. Rows are left-padded: row i's tokens are its last counts[i] columns."""
        width = ids.shape[1]
        bounds = [0, *range(width % widest or widest, width + 1, widest)]
        for start, end in zip(bounds, bounds[1:]):
            fed = [max(0, end - max(start, width - count)) for count in counts]
            out = self.forward_output(model, kv, ids[:, start:end], pos[:, start:end], valid[:, start:end],
                                      fed, keep if end == width else 1,
                                      features=None if features is None else features[:, start:end])
        return out

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
        """A group for sequences about to be prefilled: the target's empty cache, the proposer's
        empty state."""
        target_kv = self.kv_layout.empty(self.target, len(seqs), self.device)
        return Group(seqs, target_kv, self.proposer.new_state(self.kv_layout, len(seqs), self.device))

    @torch.inference_mode()
    def prefill(self, group: Group, counts: list[int]) -> list[bool]:
        """Feed row i its next counts[i] prompt tokens, batched, to the target and the proposer
        (one chunk of a chunked prefill, or the whole prompt). A row that has now fed its whole
        prompt commits its first token; returns, per row, whether it fed all it had to (a row
        re-admitted with output, `Sequence.num_to_prefill`, has its pending token and picks
        none). The logits kept are the last column's: every row's last fed token (inputs are
        left-padded)."""
        seqs = group.seqs
        with self.stats.timer("prefill"):
            starts = [s.num_cached_target for s in seqs]
            chunks = [s.tokens[n:n + c] for s, n, c in zip(seqs, starts, counts)]
            done = [n + c == s.num_to_prefill for s, n, c in zip(seqs, starts, counts)]
            rows = [i for i, d in enumerate(done) if d and not seqs[i].output_ids]
            # one copy up: the chunks, and for rows that finish their prompt what picking
            # their first token needs
            upload = Upload()
            at = self.stage_ragged(upload, chunks, starts)
            first = self._stage_first_tokens(upload, group, rows)
            tables = self._stage_tables(upload, {kv: counts for kv in group.caches()})
            sent = upload.send(self.transfers)
            self._use_tables(tables, sent)
            ragged = self.read_ragged(sent[at], chunks)
            ids, pos, valid, fed = ragged
            logits = self.forward(self.target, group.target_kv, ids, pos, valid, fed, keep=1,
                                  decode=False)
            self.proposer.prefill(self, group.proposer_state, ragged)
            for seq, chunk in zip(seqs, chunks):
                self.faults.before_row(seq, "row_prefill_error_token")
                seq.num_cached_target += len(chunk)
            if rows:   # each row's last fed token is in the last column: the next position follows
                self._first_tokens(group, logits, rows, pos[:, -1] + 1, first, sent)
            self.stats.add("prefill_tokens_target", sum(fed))
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
        first, _ = self.pick(scores[:, 0], sampling, self._noise(sampling, next_pos, 1), u)
        lp = token_logprobs(logits[:, :1], first[:, None], [s.params.logprobs for s in seqs])
        checked = processing_at is not None or masks is not None   # else every token is allowed
        picked = first[:, None] if not checked else torch.stack(
            [first, no_token_allowed(scores)[:, 0].long()], 1)
        for row, (seq, (token, *blocked)) in enumerate(zip(seqs, self.transfers.to_host(picked))):
            if blocked and blocked[0]:
                seq.finish("error", NO_TOKEN.format(0))
            else:
                seq.append([token], lp[row])

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, group: Group, k: int, stop=None, pricing=None) -> StepResult:
        """One speculative step at k (0: plain): propose, verify, accept, commit. `stop`
        (draft_stop.RoundStop): where the round of drafts may end early; with it the drafts'
        confidences are measured (a host read per draft token) and their bins returned.
        `pricing` (adaptive_k.StepPricing): what the proposer's plan is priced by, or None."""
        seqs, state = group.seqs, group.proposer_state
        plan = self.proposer.plan(self, seqs, k, pricing)
        inputs = self._upload_step_inputs(group, plan)
        rows = group.sampling
        coupled = self._coupled(rows)
        u = inputs.uniforms   # rejection sampling: one per draft token, per acceptance test, and for the final token
        # gumbel: positions m .. m+width, the proposer's drafts and the target alike
        noise = self._noise(rows, inputs.start + 1, plan.width + 1)
        proposal = Proposal(0, masks=inputs.masks)
        if plan.width > 0:
            proposal = self.proposer.propose(
                self, state, seqs, plan, inputs.proposer, inputs.sent,
                StepState(rows, coupled, u, noise, inputs.start + 1, inputs.masks, group.processing, stop))
        k = proposal.width   # what is verified: fewer than planned if the round stopped early
        if k < plan.width:
            self.stats.add("draft_stopped_steps")
            noise = None if noise is None else noise[:, :k + 1]

        uniform = proposal.verify_input is None   # else each row verifies its own count
        with self.stats.timer("verify"):
            if uniform:
                num_accepted, tokens, lp, blocked = self._verify(
                    group, k, rows, coupled, u, noise, inputs.pending, inputs.start,
                    proposal.tokens, proposal.q, proposal.masks)
            else:
                num_accepted, tokens, lp, blocked = self._verify_ragged(
                    group, k, rows, coupled, u, noise, proposal.verify_input, inputs.caps,
                    proposal.masks)
            bins = proposal.confidence_bins
            # the step's one device-to-host copy: per row its accepted count, its k + 1 tokens,
            # whether each of their positions allowed no token (when checked), its drafts' bins
            host = self.transfers.to_host(torch.cat(
                [num_accepted[:, None], tokens] + ([] if blocked is None else [blocked.long()])
                + ([] if bins is None else [bins]), dim=1))
        lengths = [s.num_tokens for s in seqs]
        kept = torch.minimum(num_accepted, inputs.caps)
        verified = [min(c, k) for c in plan.caps]
        cut_dev = (k if uniform else inputs.caps) - kept   # the target's rejected entries per row
        committed, accepted, counted = self._commit(group, k, host, lp, verified, uniform, cut_dev,
                                                    checked=blocked is not None)
        self.proposer.commit(state, k, accepted, kept)
        if group.processing is not None:   # the device's own committed tokens: no copy back up
            group.processing.advance(tokens, kept, [m + a + 1 for m, a in zip(lengths, accepted)])
        # per row what it proposed, where rows differ: a ragged verification's, or a plan that
        # says its proposals' lengths (a hybrid's step on suffix decoding alone)
        proposed = None if uniform and plan.lengths is None else verified
        self._count(seqs, k, committed, counted)
        bins_at = k + 2 if blocked is None else 2 * k + 3
        return StepResult(committed, accepted, k, verified,
                          None if bins is None else [row[bins_at:] for row in host], proposed,
                          plan.lengths)

    def _upload_step_inputs(self, group: Group, plan: Plan) -> "StepInputs":
        """The step's one host-to-device copy: the proposer's sections (a draft model's first
        input and catch-up; an n-gram's verification input), per row the pending token, its
        position and the row's cap, the block table of a cache whose rows take new blocks
        this step, the rows' sampling settings when the group is new or lost rows, and
        rejection sampling's uniforms."""
        seqs = group.seqs
        upload = Upload()
        staged, room = self.proposer.stage(self, group.proposer_state, seqs, plan, upload)
        per_row = [s.pending_token for s in seqs] + [s.num_tokens - 1 for s in seqs] + plan.caps
        per_row_at = upload.add(per_row, 3, len(seqs))
        # room for what each model is fed this step: the target width + 1 per row, the proposer
        # what it asked for
        tables = self._stage_tables(upload, {group.target_kv: [plan.width + 1] * len(seqs), **room})
        sampling_at = self._stage_sampling(upload, seqs) if group.sampling is None else None
        if group.processing is not None and group.processing.lengths != [s.num_tokens for s in seqs]:
            group.processing = None   # a row's history moved on without it (a first token)
        processing_at = self._stage_processing(upload, seqs) if group.processing is None else None
        coupled = self._coupled_params(seqs)
        u_at = None if coupled else self._stage_uniforms(upload, seqs, 2 * plan.width + 1)
        # the grammars' masks, filled while the forwards run: at every verified position for
        # proposals known here (n-gram), at the first for drafts made on the device (the rest
        # follow its drafts)
        host_drafts = plan.tokens is not None
        masks = StepMasks.start(seqs, self.transfers, self.logits_width, plan.tokens,
                                plan.width + 1 if host_drafts else 1)
        sent = upload.send(self.transfers)

        if group.sampling is None:
            group.sampling = self._sampling_sent(sent, sampling_at, seqs)
        if processing_at is not None:
            group.processing = RowProcessing(sent, processing_at, seqs, self.logits_width)
        columns = sent[per_row_at]
        self._use_tables(tables, sent)
        return StepInputs(proposer=staged, sent=sent, pending=columns[0], start=columns[1],
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
        logits = self.forward(self.target, group.target_kv, ids, pos, valid, [k + 1] * len(seqs), keep=k + 1)
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
        logits = self.forward(self.target, group.target_kv, ids, pos, valid, counts, keep=k + 1)
        shifted = ((k - proposed)[:, None] + torch.arange(k + 1, device=self.device)).clamp_max(k)
        logits = logits.gather(1, shifted[..., None].expand(-1, -1, logits.shape[-1]))
        draft_tokens = ids.gather(1, shifted)[:, 1:]
        q = None if coupled else point_mass(draft_tokens, logits.shape[-1])
        return self._accept(group, k, rows, coupled, u, noise, logits, draft_tokens, q, masks)

    def _accept(self, group: Group, k: int, rows: RowSampling, coupled: bool, u, noise, logits,
                draft_tokens, q, masks=None):
        """The accepted draft counts [B], the step's tokens [B, k+1], the logprobs asked for and,
        where rows are processed or constrained, which positions allowed no token ([B, k+1];
        else None), from the target's logits [B, k+1, V] at each row's verified positions
        (`masks`: the tokens each row's grammar allows there)."""
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
            tokens = self.pick(scores[:, 0], rows, u=u[:, 0])[0].unsqueeze(1)
        else:
            p = probs_from_logits(scores, rows)
            num_accepted, tokens = accept(draft_tokens, q, p, u[:, k:2 * k], u[:, 2 * k])
        # only a row's processing or grammar can leave a position without any token
        blocked = None if processing is None and masks is None else no_token_allowed(scores)
        return (num_accepted, tokens, token_logprobs(logits, tokens, [s.params.logprobs for s in seqs]),
                blocked)

    def _commit(self, group: Group, k: int, host, lp, verified: list[int], uniform: bool,
                cut_dev: torch.Tensor, checked: bool = False):
        """Per row: commit the accepted drafts and the bonus token (stop rules apply, I5), then
        cut the target's cache back to I3 on the host and, from the device's own counts
        on the device: no copy back up.
        `verified`: per row, the drafts it may keep; `uniform`: every row fed k + 1 tokens (else
        its own verified + 1); `cut_dev`: the target's cut per row, on the device; `checked`:
        host rows carry, after the tokens, whether each position allowed no token: a row
        commits up to the first such position and ends there with an error.
        Returns per row the tokens committed, the drafts accepted (what the caches keep) and
        the drafts counted as (verified, accepted): `Sequence.count_drafts`'s."""
        committed, accepted, counted, target_cut = [], [], [], []
        for row, seq in enumerate(group.seqs):
            self.faults.before_row(seq)
            a = min(host[row][0], verified[row])
            m = seq.num_tokens
            accepted.append(a)
            new = host[row][1:a + 2]
            if checked and any(host[row][k + 2:k + 3 + a]):
                new = new[:host[row][k + 2:k + 3 + a].index(1)]
            committed.append(seq.append(new, lp[row] and lp[row][:len(new)]))
            if len(new) < a + 1 and not seq.finished:   # stopped at a position with no token
                seq.finish("error", NO_TOKEN.format(seq.num_output_tokens))
            fed = k if uniform else verified[row]
            target_cut.append(fed - a)   # the target holds m + fed, keeps m + a
            seq.num_cached_target = m + a
            # the drafts it could keep (its own cap, not the group's k); where the output ended
            # in this step, only those at positions it reached (a stop inside an accepted run)
            reached = len(committed[-1]) if seq.finished else verified[row] + 1
            counted.append((min(verified[row], reached), min(a, reached)))
            seq.count_drafts(*counted[-1])
            if verified[row] > 0:
                seq.observe_acceptance(a, verified[row])
        group.target_kv.drop_tail(target_cut, cut_dev)
        return committed, accepted, counted

    def _coupled(self, rows: RowSampling) -> bool:
        """True when tokens are argmaxes (greedy, or gumbel noise) and acceptance is agreement."""
        return self.coupling == "gumbel" or rows.all_greedy

    def _coupled_params(self, seqs: list[Sequence]) -> bool:
        """`_coupled` from the rows' parameters, before their settings are on the device."""
        return self.coupling == "gumbel" or all(s.params.greedy for s in seqs)

    def pick(self, logits: torch.Tensor, rows: RowSampling, noise=None, u=None):
        """Next token per row from [B, V] logits: under the gumbel coupling (or greedy) the
        argmax, with noise [B, 1, V] of that position, no distribution built; else a sample on
        uniforms u [B] with its distribution q."""
        if self._coupled(rows):
            return coupled_tokens(logits[:, None], rows, noise)[:, 0], None
        q = probs_from_logits(logits[:, None], rows)[:, 0]
        return sample(q, u), q

    def _count(self, seqs, k, committed, counted: list[tuple[int, int]]) -> None:
        """The step in the engine's stats; drafts as the rows counted them (`_commit`)."""
        s = self.stats
        s.add("steps")
        s.add_step(len(seqs), k)
        s.add("row_steps", len(seqs))
        s.add("committed_tokens", sum(len(c) for c in committed))
        if k == 0:
            s.add("plain_steps")
        else:
            verified, accepted = [v for v, _ in counted], [a for _, a in counted]
            s.add("draft_tokens", sum(verified))
            s.add("accepted_tokens", sum(accepted))
            s.add_depths(verified, accepted)


def _pad_rows(tensor: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """`tensor` [B, ...] with rows of `fill` after its own, `rows` in all."""
    return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, rows - tensor.shape[0]), value=fill)


def _first_rows(out, rows: int, padded: int):
    """A forward's output (a transformers ModelOutput, or an EAGLE head's) with its tensors of
    `padded` rows cut to their first `rows`: a static-shape forward's pad rows dropped."""
    for name in list(out.keys() if hasattr(out, "keys") else vars(out)):
        value = getattr(out, name)
        if torch.is_tensor(value) and value.dim() and value.shape[0] == padded:
            setattr(out, name, value[:rows])
    return out


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with the strides and storage offset of a new contiguous tensor of its shape.
    `contiguous()` is not enough: it keeps any stride of a size-1 dimension (one row sliced from
    a wider buffer) and a view's offset (positions read from a step's one upload), and Dynamo
    guards both (an offset of 0 or 1 apart from larger ones: a width first compiled from an
    upload's slice compiled again for a new tensor after READY)."""
    expected, step = [], 1
    for size in reversed(tensor.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == tensor.stride() and tensor.storage_offset() == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
