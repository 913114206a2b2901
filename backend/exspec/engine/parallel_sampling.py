"""Parallel sampling: a request with n > 1 runs as n child sequences (design: "Parallel sampling").

Child i is named f"{i}_{request_id}" and, when the request has a seed, seeded seed + i: vLLM's
naming and seed derivation (vllm/v1/engine/parallel_sampling.py), so a seeded request is
reproducible and its sample i is exactly a lone request with seed + i; unseeded children each get
a fresh seed, like any unseeded request. With prefix caching on, child 0 enters the pool at once
and its siblings once child 0 has its first token: its prompt is prefilled and its full blocks
cached by then, so the siblings are fed only what lies past them. Outputs keep the request's id
with the child's `index`; a child's last output has its finish_reason, and only the request's
last output is `finished`. abort(request_id) aborts every child; a child that fails aborts its
siblings and the request ends with that error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..outputs import RequestOutput
from ..params import SamplingParams
from .sequence import Sequence


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index`: n = 1, and seed + index when the request is seeded."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, best_of=None, seed=seed)


@dataclass
class Parent:
    request_id: str
    running: set[str]                          # child ids not finished yet
    index: dict[str, int]                      # child id -> its sample index
    error: str | None = None                   # the first child failure: the request's error
    held: list[Sequence] = field(default_factory=list)   # siblings waiting for child 0's prefill
    first: Sequence | None = None              # child 0, while siblings wait for it


class ParallelSampling:
    """The engine's requests with n > 1: which children each has, and the siblings held back.
    Every method runs under the engine's lock."""

    def __init__(self):
        self._parents: dict[str, Parent] = {}
        self._parent_of: dict[str, Parent] = {}    # child id -> its request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def owns(self, sequence_id: str) -> bool:
        """Whether `sequence_id` names a running sample (so no request may take it)."""
        return sequence_id in self._parent_of

    def child_ids(self, request_id: str) -> list[str]:
        return sorted(self._parents[request_id].running)

    def add(self, request_id: str, children: list[Sequence], hold: bool) -> list[Sequence]:
        """Register a request's children; returns those to queue now (all, or child 0 alone
        when `hold`: the siblings wait for `release`)."""
        parent = Parent(request_id, {c.request_id for c in children},
                        {c.request_id: i for i, c in enumerate(children)})
        self._parents[request_id] = parent
        for child in children:
            self._parent_of[child.request_id] = parent
        if not hold:
            return list(children)
        parent.first, parent.held = children[0], list(children[1:])
        return [children[0]]

    def release(self) -> list[Sequence]:
        """Held siblings whose child 0 has its first token (or finished): its prompt's blocks
        are cached now, so they go to the pool's queue."""
        out = []
        for parent in self._parents.values():
            first = parent.first
            if parent.held and (first.num_output_tokens > 0 or first.finished):
                out += parent.held
                parent.held, parent.first = [], None
        return out

    def drop_held(self, child_ids: set[str] | None = None) -> list[Sequence]:
        """Held siblings among `child_ids` (aborted before they reached the pool; None: all of
        them, the tick failed), removed."""
        dropped = []
        for parent in self._parents.values():
            dropped += [s for s in parent.held if child_ids is None or s.request_id in child_ids]
            parent.held = [s for s in parent.held if s not in dropped]
        return dropped

    def held(self) -> list[Sequence]:
        return [s for p in self._parents.values() for s in p.held]

    def relabel(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], set[str]]:
        """Children's outputs as their request's: its id, the child's index, `finished` only on
        the last child's final output (with the request's error, if a child failed). Returns the
        outputs and the ids of children to abort because a sibling failed."""
        to_abort: set[str] = set()
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is None:
                continue
            child = out.request_id
            out.request_id, out.index = parent.request_id, parent.index[child]
            if not out.finished:
                continue
            parent.running.discard(child)
            del self._parent_of[child]
            if out.finish_reason == "error" and parent.error is None:
                parent.error = out.error
                to_abort |= parent.running
            if parent.running:
                out.finished = False   # this sample ended (finish_reason says how); others run
            else:
                del self._parents[parent.request_id]
                if parent.error is not None:
                    out.finish_reason, out.error = "error", parent.error
        return outputs, to_abort
