"""Eagle3Proposer: an EAGLE-3 head drafts k tokens per row from the target's own hidden states
(vLLM's "eagle3" method; the head: models/eagle3.py; design: "Proposers").

What it needs from the target: the inputs of three of its decoder layers at every position the
target computes (prefill chunks, verifications, plain steps), read by pre-hooks during the
target's own forward (models/layer_inputs.py) and projected by the head's `fc` into one feature
per position.

Its per-group state (`HeadState`): the head's KV cache, in the target's layout, where entry e
holds (token e, feature of target position e - 1) (models/eagle3.py), and per row the features of
the positions the target has computed and the head has not yet taken: right-aligned in
[B, W, hidden], count per row. A row's head cache holds `c` true entries and the target `t`
positions; the buffer then holds the t - c + 1 features of entries c .. t (entry c's feature is
target position c - 1's, a zero vector for c = 0, and after a prefix-cache hit, whose features
were not computed: one approximated entry, never a changed output).

A step: the first forward feeds each row its entries c .. n - 1 (n: the row's tokens, the last
pending; ragged, 1 .. k + 1 of them, more after plain steps) with their true features; its
output drafts d1 and, before the norm, is the feature of the next entry (d1, that output), and
so on: k forwards in all, as a draft model's. The entries fed with the head's own features are
provisional: `commit` cuts all k - 1 of them and keeps, as the next step's features, the
verification's features of the positions each row kept (its accepted drafts and the pending
token: a + 1). A plain step appends its one feature. So the head never runs a second time over
a position it has taken, and the target never runs twice.
"""
from __future__ import annotations

import torch

from ..errors import ModelLoadError
from ..models.eagle3 import load_head
from ..models.layer_inputs import LayerInputs
from ..models.loading import DTYPES, check_source
from ..speculative import SpeculativeConfig, SpeculativeMethod
from .draft_model import DraftModelProposer
from .proposer import KVState, Plan, Proposal, Runner, StepState


class HeadState(KVState):
    """The head's cache and the features it has not taken (module doc)."""

    def __init__(self, kv, model, features: torch.Tensor, counts: list[int]):
        super().__init__(kv, model)
        self.features = features   # [B, W, hidden], right-aligned
        self.counts = counts       # per row, its features in `features` and `pending`
        # features that came after `features`, joined only when read, so a long run of steps the
        # head does not draft adds in O(1) instead of copying the buffer each step: a plain
        # step's [B, 1, hidden], or an undrafted step's verified [B, width + 1, hidden] with
        # `kept` [B] (its first kept + 1 columns are the row's)
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.pending_counts = [0] * len(counts)   # per row, its features in `pending`

    def joined(self) -> torch.Tensor:
        """Every feature the head has not taken, [B, W, hidden], right-aligned."""
        if not self.pending:
            return self.features
        pieces = [self.features] + [f for f, _ in self.pending]
        if all(kept is None for _, kept in self.pending):
            self.features = torch.cat(pieces, dim=1)   # plain steps only: every column a row's
        else:
            self.features = self._right_aligned(torch.cat(pieces, dim=1))
        self.pending, self.pending_counts = [], [0] * len(self.counts)
        return self.features

    def _right_aligned(self, both: torch.Tensor) -> torch.Tensor:
        """One scatter puts each row's columns of [features, *pending] (`both`) right-aligned:
        all of `features` (its pads lie left of a row's own, so they land left of them again),
        then all of a plain step's, and the first kept + 1 of an undrafted step's. Only device
        tensors go in (no host list copied up: on a GPU that would wait for the queue)."""
        device, total = both.device, both.shape[1]
        valid = [torch.ones(both.shape[0], self.features.shape[1], dtype=torch.bool, device=device)]
        for f, kept in self.pending:
            columns = torch.arange(f.shape[1], device=device).expand(both.shape[0], -1)
            valid.append(columns <= kept[:, None] if kept is not None else torch.ones_like(columns, dtype=torch.bool))
        valid = torch.cat(valid, dim=1)
        rank = valid.cumsum(1)   # 1 .. a row's valid columns, in order
        to = torch.where(valid, total - rank[:, -1:] + rank - 1, total)   # column `total`: the rest
        out = both.new_zeros(both.shape[0], total + 1, both.shape[-1])
        out.scatter_(1, to[..., None].expand(-1, -1, both.shape[-1]), both)
        return out[:, total - max(self.counts):total]

    @classmethod
    def empty(cls, kv, model, batch: int, device) -> "HeadState":
        zero = torch.zeros(batch, 1, model.config.hidden_size, dtype=model.dtype, device=device)
        return cls(kv, model, zero, [1] * batch)

    def select(self, rows: list[int]) -> int:
        moved = super().select(rows)
        self.features = self.joined()[torch.tensor(rows, device=self.features.device)]
        self.counts = [self.counts[i] for i in rows]
        self.pending_counts = [0] * len(rows)
        return moved + self.features.nbytes

    def compact(self) -> int:
        moved = super().compact()
        width = max(max((c - p for c, p in zip(self.counts, self.pending_counts)), default=1), 1)
        if width < self.features.shape[1]:
            self.features = self.features[:, -width:]
        return moved

    @classmethod
    def concat(cls, parts: list["HeadState"]) -> tuple["HeadState", int]:
        kv, moved = KVState.concat(parts)
        joined = [p.joined() for p in parts]
        width = max(f.shape[1] for f in joined)
        features = torch.cat([torch.nn.functional.pad(f, (0, 0, width - f.shape[1], 0)) for f in joined])
        state = cls(kv.kv, kv.model, features, [c for p in parts for c in p.counts])
        return state, moved + features.nbytes

    def take_prefill(self, chunk: torch.Tensor, valid: torch.Tensor, fed: list[int]) -> torch.Tensor:
        """The features of a prefill chunk's entries (`chunk`: the target's features of the
        chunk's positions [B, W, hidden], left-padded as its ids, `valid` [B, W] which columns
        are real; `fed`: tokens per row): entry s + j takes position s + j - 1's, so each row's
        first real column takes the buffer's (not the pad's before it); the buffer keeps the
        chunk's last (a row fed nothing keeps its own)."""
        before = self.joined()[:, -1:]
        features = torch.cat([before, chunk[:, :-1]], dim=1)   # one position back
        first = valid & ~torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
        features = torch.where(first[..., None], before, features)
        last = chunk[:, -1:]
        if min(fed) == 0:
            fed_rows = torch.tensor([f > 0 for f in fed], device=chunk.device)[:, None, None]
            last = torch.where(fed_rows, last, before)
        self.features, self.counts = last, [1] * len(fed)
        return features

    def keep_verified(self, verified: torch.Tensor, width: int, kept: torch.Tensor,
                      accepted: list[int]) -> None:
        """After a step of `width` drafts: the features of the positions each row kept
        (verified [B, width + 1, hidden]: every verified position's; kept [B] on the device),
        right-aligned."""
        shift = (torch.arange(width + 1, device=kept.device) - (width - kept)[:, None]).clamp_min(0)
        self.features = verified.gather(1, shift[..., None].expand(-1, -1, verified.shape[-1]))
        self.counts = [a + 1 for a in accepted]
        self.pending, self.pending_counts = [], [0] * len(accepted)

    def extend_verified(self, verified: torch.Tensor, kept: torch.Tensor, accepted: list[int]) -> None:
        """After a step the head did not draft: the features of the positions each row kept
        (verified [B, width + 1, hidden], its first a + 1 columns) join the ones it has not
        taken (when read: `joined`)."""
        self._add(verified, kept, [a + 1 for a in accepted])

    def append(self, features: torch.Tensor) -> None:
        """A plain step's feature [B, 1, hidden] (the pending token's position) joins the buffer."""
        self._add(features, None, [1] * len(self.counts))

    def _add(self, features: torch.Tensor, kept: torch.Tensor | None, added: list[int]) -> None:
        self.pending.append((features, kept))
        self.counts = [c + n for c, n in zip(self.counts, added)]
        self.pending_counts = [c + n for c, n in zip(self.pending_counts, added)]


class Eagle3Proposer(DraftModelProposer):
    speculative_method = SpeculativeMethod(
        "eagle3", usage="an EAGLE-3 head (method 'eagle3' and 'model': the head's folder)",
        model="the EAGLE-3 head's folder", head=True)

    def __init__(self, head, target):
        super().__init__(head)   # self.model: the head
        self.layer_inputs = LayerInputs.of(target, head.layer_ids)
        self._feature: torch.Tensor | None = None   # the next forward's features, while drafting

    @classmethod
    def load_draft(cls, config):
        return None   # its model is a head on the target: load_head

    @classmethod
    def load_head(cls, config, target):
        """The head (models/eagle3.py), on the target it reads."""
        if not config.draft_model:
            return None
        return load_head(check_source(config.draft_model, "EAGLE-3 head"), target,
                         DTYPES[config.dtype], config.device)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair, pad_id: int) -> "Eagle3Proposer":
        if pair.head is None:
            raise ModelLoadError("proposer 'eagle3': the pair was loaded without its EAGLE-3 head "
                                 "(load it with proposer 'eagle3' and draft_model: the head's folder)")
        return cls(pair.head, pair.target)

    def new_state(self, layout, batch: int, device) -> HeadState:
        return HeadState.empty(layout.empty(self.model, batch, device), self.model, batch, device)

    def _target_features(self, rows: int | None = None) -> torch.Tensor:
        """The features of the target's last forward, every position's, of its first `rows`
        rows (a forward with static shapes runs pad rows after the group's)."""
        return self.model.project([inputs[:rows] for inputs in self.layer_inputs.take()])

    def _forward(self, runner: Runner, kv, ids, pos, valid, counts, decode: bool = True):
        out = runner.forward_output(self.model, kv, ids, pos, valid, counts, keep=1, decode=decode,
                                    features=self._feature)
        self._feature = out.hidden   # the next draft's feature: this one's output
        return out.logits.to(runner.device)

    def prefill(self, runner: Runner, state: HeadState, ragged: tuple) -> None:
        ids, pos, valid, fed = ragged
        self._feature = state.take_prefill(self._target_features(), valid, fed)
        self._forward(runner, state.kv, ids, pos, valid, fed, decode=False)
        runner.stats.add("prefill_tokens_draft", sum(fed))

    def stage(self, runner: Runner, state: HeadState, seqs, plan: Plan, upload):
        """The first forward's input: each row's entries the head lacks (its true features are
        in the buffer); room for them and k - 1 provisional entries."""
        if plan.width == 0:
            return None, {}
        cached = [state.cached(i) for i in range(len(seqs))]
        tails = [s.tokens[n:] for s, n in zip(seqs, cached)]
        assert [len(t) for t in tails] == state.counts, "EAGLE-3 head: features and tokens disagree"
        room = {state.kv: [len(t) + plan.width - 1 for t in tails]}
        return (tails, runner.stage_ragged(upload, tails, cached)), room

    def propose(self, runner: Runner, state: HeadState, seqs, plan: Plan, staged,
                sent: list[torch.Tensor], step: StepState) -> Proposal:
        tails, at = staged
        first = runner.read_ragged(sent[at], tails)
        self._feature = state.joined()[:, -first[0].shape[1]:]
        with runner.stats.timer("draft"):
            return self._draft(runner, state, len(seqs), plan.width, step, first)

    def commit(self, state: HeadState, width: int, accepted: list[int], kept: torch.Tensor) -> None:
        # the last width + 1 columns: a compiled one-token forward is fed a pad first
        verified = self._target_features(len(accepted))[:, -(width + 1):]
        self._feature = None
        if width == 0:
            state.append(verified)
            return
        # its k - 1 entries fed its own features go; the buffer takes the verified ones
        state.kv.drop_tail([width - 1] * len(accepted),
                           torch.full_like(kept, width - 1))
        state.keep_verified(verified, width, kept, accepted)

    def commit_undrafted(self, state: HeadState, width: int, accepted: list[int],
                         kept: torch.Tensor) -> None:
        """A step verified drafts it did not make (a hybrid's all-suffix step): its cache holds
        what it held; the buffer takes the kept positions' features after its own."""
        state.extend_verified(self._target_features(len(accepted))[:, -(width + 1):], kept, accepted)
