"""Group: rows that are stepped together, with the target's batched cache and the proposer's
state (proposer.py: its own cache, or nothing), which it carries without looking inside.

A group is a value with a small algebra (TGI's batch): built by a prefill, rows dropped with
`keep`, groups joined with `merge`, made rectangular again with `realign`. Every copy those
make is returned as a byte count, which is what realign_bytes measures.
"""
from __future__ import annotations

import itertools

import torch

from ..sampling.logits_processing import RowProcessing
from ..sampling.sampler import RowSampling
from .sequence import Sequence

_ids = itertools.count()


class Group:
    def __init__(self, seqs: list[Sequence], target_kv, proposer_state):
        self.id = next(_ids)
        self.seqs = seqs
        self.target_kv = target_kv
        self.proposer_state = proposer_state
        # the rows' sampling settings and logits processing state on the device: set by the
        # runner from the upload of the first prefill or step that needs them, None again when
        # the rows change
        self.sampling: RowSampling | None = None
        self.processing: RowProcessing | None = None
        self.steps = 0   # steps taken with these batched caches (a merge starts a new group)
        self.k: int | None = None        # the k of its last step (adaptive k's hysteresis)
        self.k_before_probe: int | None = None   # the k a neighbour probe left (adaptive_k.py)
        self.plain_probe_left = 0   # plain steps a probe near a tie still measures (adaptive_k.py)
        self.plain_steps_in_a_row = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def equal_length(self) -> bool:
        return len({s.num_tokens for s in self.seqs}) == 1

    @property
    def isolated(self) -> bool:
        """Holds a row re-admitted after a shared failure: it steps alone (scheduler.py)."""
        return any(s.isolated for s in self.seqs)

    @property
    def max_skipped(self) -> int:
        return max(s.skipped_ticks for s in self.seqs)

    def length_spread_with(self, other: "Group") -> int:
        lengths = [s.num_tokens for s in self.seqs + other.seqs]
        return max(lengths) - min(lengths)

    def acceptance(self, prior: float) -> float:
        """Mean recent acceptance of the rows (prior for rows not yet measured)."""
        values = [prior if s.acceptance_estimate is None else s.acceptance_estimate for s in self.seqs]
        return sum(values) / len(values)

    def kv_tokens(self) -> int:
        """KV entries held for real tokens, every model's (what the pool budgets)."""
        return sum(s.num_cached_target for s in self.seqs) + self.proposer_state.kv_tokens()

    def caches(self):
        """Every KV cache of the group: the target's first, then the proposer's."""
        return [self.target_kv] + self.proposer_state.caches()

    # The pool calls realign / keep / merge between steps: inference mode keeps every cache tensor
    # an inference tensor, as a step makes them (a compiled forward recompiles for the other kind).
    @torch.inference_mode()
    def realign(self) -> int:
        """EQSPEC's unpad / append / repad of every cache; bytes copied (0 when nothing moves)."""
        return self.target_kv.compact() + self.proposer_state.compact()

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> int:
        """Keep only `rows` (dropping finished or moved-out sequences); bytes copied."""
        if len(rows) == len(self.seqs):
            return 0
        self.seqs = [self.seqs[i] for i in rows]
        self.sampling = self.processing = None
        return self.target_kv.select(rows) + self.proposer_state.select(rows) if rows else 0

    @classmethod
    @torch.inference_mode()
    def merge(cls, groups: list["Group"], target_model) -> tuple["Group", int]:
        """One group from several (row order: as given); returns (group, bytes copied)."""
        if len(groups) == 1:
            return groups[0], 0
        layout = type(groups[0].target_kv)
        target_kv, moved = layout.concat([g.target_kv for g in groups], target_model)
        state, n = type(groups[0].proposer_state).concat([g.proposer_state for g in groups])
        merged = cls([s for g in groups for s in g.seqs], target_kv, state)
        moved += n
        merged.k = groups[0].k
        return merged, moved
