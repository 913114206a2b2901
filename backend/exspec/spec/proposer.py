"""Proposer: where a speculative step's drafts come from (design: "Proposers").

The runner holds one proposer, chosen once at load (engine/llm_engine.py), and never asks which it holds.
A step reads: plan -> one upload -> propose -> verify -> accept -> commit, and the proposer
takes part at each point:
- `plan` (before the upload, on the host): the step's width and each row's cap. A host proposer
  (n-gram) knows its proposals here, so they shape the upload: a ragged verification input, every
  verified position's grammar mask, the grammar's valid prefix. A device proposer (a draft
  model) knows only k; it drafts after the upload.
- `stage` puts what it needs into the step's one upload (it never copies on its own) and names
  the room its caches need; `propose` reads its sections of what arrived and returns a
  `Proposal`: drafted tokens (and their distributions q), or a verification input of its own.
- `commit` rolls its state back to what each row kept; `request_done` tells it a row's request
  ended, and how.
Its per-group state (`new_state`: a KV cache, or nothing) rides in the Group opaquely: the group
keeps, merges and realigns it with its own rows. Its capabilities (`proposes`,
`gives_confidences`, `models`, `kv_models`) are what the scheduler and the warm-up read.

A method lives in its class: `speculative_method` declares what the configuration holds for it
(speculative.py), `load_draft` / `load_head` load its weights with the target's (models/loading.py
calls them), `from_config` builds it; spec/registry.py lists the classes and is the one factory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.loading import ModelPair
    from ..speculative import SpeculativeConfig, SpeculativeMethod
    from ..sampling.sampler import RowSampling
    from ..sampling.structured_output import RowGrammar, StepMasks
    from ..utils.stats import Stats
    from ..utils.transfer import Upload


class Row(Protocol):
    """What a proposer reads of a row (the engine's Sequence is one): its tokens and its cap."""
    tokens: list[int]             # prompt + committed output; the last is pending
    grammar: RowGrammar | None    # its structured output's matcher, if constrained

    @property
    def num_tokens(self) -> int: ...
    @property
    def pending_token(self) -> int: ...
    def drafts_at(self, k: int) -> int: ...


class Pricing(Protocol):
    """What a step's plan is priced by (adaptive k's: engine/adaptive_k.StepPricing)."""

    def width(self, lengths: list[int], drafted: bool = True) -> int:
        """The verified width that pays for host proposals of these lengths."""

    def seconds(self, width: int, drafts: int) -> float | None:
        """A step's estimated seconds at `width` with `drafts` draft forwards (None: unpriced)."""


@dataclass
class Plan:
    """A step's drafts as planned on the host, before its upload."""
    width: int                              # drafts per row the step may verify (0: a plain step)
    caps: list[int]                         # per row, the drafts it may keep
    tokens: list[list[int]] | None = None   # the proposals, when known on the host (rows differ)
    lengths: list[int] | None = None        # ... and their lengths before a priced cut


@dataclass
class StepState:
    """What the step hands a device proposer: the rows' sampling on the device and the step's
    randomness, shared with the verification so that a draft is the target's token exactly when
    it would be accepted."""
    rows: RowSampling
    coupled: bool                     # tokens are argmaxes (greedy or gumbel): no q needed
    uniforms: torch.Tensor | None     # [B, 2k + 1] rejection sampling's (drafts use [:, :k])
    noise: torch.Tensor | None        # [B, k + 1, V] gumbel noise of positions m .. m + k
    next_pos: torch.Tensor            # [B] the first draft's position
    masks: StepMasks | None           # the grammars' allowed tokens, being filled
    processing: object | None         # the rows' logits processing (logits_processing.RowProcessing)
    stop: object | None               # the round's draft stop (draft_stop.RoundStop)


@dataclass
class Proposal:
    """A step's drafts as the verification takes them: `tokens` [B, width] drafted on the
    device (q [B, width, V] with them when sampled), or, for proposals known on the host, the
    ragged verification input (`verify_input`: ids, positions, validity, counts) holding each
    row's [pending, proposal]."""
    width: int
    tokens: torch.Tensor | None = None
    q: torch.Tensor | None = None
    verify_input: tuple | None = None
    masks: StepMasks | None = None
    confidence_bins: torch.Tensor | None = None   # [B, width] (with draft stop)


class Runner(Protocol):
    """What the runner lends a proposer: its forwards, its picks, its upload helpers."""
    stats: Stats
    transfers: object
    device: torch.device
    logits_width: int   # the target's logit rows: a proposal's q is that wide

    def forward(self, model, kv, ids, pos, valid, counts: list[int], keep: int,
                decode: bool = True) -> torch.Tensor: ...
    def forward_output(self, model, kv, ids, pos, valid, counts: list[int], keep: int,
                       decode: bool = True, features: torch.Tensor | None = None): ...
    def pick(self, logits, rows, noise=None, u=None): ...
    def stage_ragged(self, upload: Upload, tails: list[list[int]], starts: list[int]) -> int: ...
    def read_ragged(self, section: torch.Tensor, tails: list[list[int]]) -> tuple: ...


class NoState:
    """The per-group state of a proposer that keeps none (n-gram, none at all)."""

    def caches(self) -> list:
        return []

    def kv_tokens(self) -> int:
        return 0

    def select(self, rows: list[int]) -> int:
        return 0

    def compact(self) -> int:
        return 0

    @classmethod
    def concat(cls, parts: list["NoState"]) -> tuple["NoState", int]:
        return parts[0], 0


class KVState:
    """A proposer's per-group KV cache in one model's layout (a draft model's): rows held as the
    target's are, its length per row being what that model has cached of the row."""

    def __init__(self, kv, model):
        self.kv = kv
        self.model = model

    def cached(self, row: int) -> int:
        return self.kv.lengths[row]

    def caches(self) -> list:
        return [self.kv]

    def kv_tokens(self) -> int:
        return sum(self.kv.lengths)

    def select(self, rows: list[int]) -> int:
        return self.kv.select(rows)

    def compact(self) -> int:
        return self.kv.compact()

    @classmethod
    def concat(cls, parts: list["KVState"]) -> tuple["KVState", int]:
        kv, moved = type(parts[0].kv).concat([p.kv for p in parts], parts[0].model)
        return cls(kv, parts[0].model), moved


class Proposer:
    """The interface (module doc); this base is also the proposer of plain decoding: it proposes
    nothing, keeps nothing and runs no model."""

    speculative_method: SpeculativeMethod | None = None   # its name, keys, model (speculative.py);
                               # None: not a method of its own (plain decoding, a shared base)
    proposes = False           # whether any step can verify drafts
    gives_confidences = False  # its drafts' confidences can end a round early (draft_stop.py)
    proposes_on_host = False   # its proposals are known at `plan`, so adaptive k prices each
                               # step's own (AdaptiveK.width) instead of choosing one k
    learns_across_requests = False   # what it proposes depends on requests served before
    models: tuple = ()         # models it runs: compiled and warmed up with the target
    kv_models: tuple = ()      # models it keeps a KV cache of per group, in the layout's stores
    vocab = None               # how its ids and logits map to the target's (vocab.PaddedVocab)

    # -- loading and building: what the registry's one factory asks of a method ----------------
    @classmethod
    def load_draft(cls, config: EngineConfig):
        """A model of its own loaded before the target, beside it (a draft LLM: its positions
        limit the pair's, a device_map policy sees its memory): ModelPair.draft. None: none."""
        return None

    @classmethod
    def load_head(cls, config: EngineConfig, target):
        """A model of its own loaded onto the loaded target (an EAGLE-3 head reads its hidden
        states): ModelPair.head. None: none."""
        return None

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair: ModelPair | None, pad_id: int) -> "Proposer":
        """The proposer for this configuration on this pair (None for a method that loads no
        model: it needs none of the pair)."""
        return cls()

    def new_state(self, layout, batch: int, device):
        """Its state for a new group of `batch` rows, all empty."""
        return NoState()

    def prefill(self, runner: Runner, state, ragged: tuple) -> None:
        """Feed prompt tokens (`ragged`: ids, positions, validity, counts, as the target got them)."""

    def plan(self, runner: Runner, seqs: list[Row], k: int,
             pricing: Pricing | None = None) -> Plan:
        """The step's width and caps; a host proposer proposes here, and with `pricing`
        (adaptive k's) keeps each proposal to the width that pays (`pricing.width`)."""
        width = k if self.proposes else 0
        return Plan(width, [s.drafts_at(width) for s in seqs])

    def stage(self, runner: Runner, state, seqs: list[Row], plan: Plan,
              upload: Upload) -> tuple[object, dict]:
        """Its inputs as sections of the step's upload; returns (what `propose` reads back, the
        room its caches need: {kv: entries per row})."""
        return None, {}

    def propose(self, runner: Runner, state, seqs: list[Row], plan: Plan, staged,
                sent: list[torch.Tensor], step: StepState) -> Proposal:
        return Proposal(plan.width, masks=step.masks)

    def commit(self, state, width: int, accepted: list[int], kept: torch.Tensor) -> None:
        """Each row kept accepted[i] of `width` drafts (`kept`: the same on the device)."""

    def request_done(self, row: Row, reason: str) -> None:
        """A row's request ended (`reason`: stop, length, abort or error), once per row, on the
        engine's thread: what a proposer learns across requests (a suffix tree of outputs)
        takes only rows that ended well, and frees what it kept per request."""

    def forget(self) -> None:
        """Drop what it learnt across requests (the benchmark starts each run from nothing, so
        that a repeat is not proposed the answers of the one before)."""
