"""NgramProposer: speculation without a draft model (prompt lookup; vLLM's "ngram" method).

A row's proposal is what followed the most recent earlier occurrence of its last n tokens in
its own prompt + output, n from prompt_lookup_max down to prompt_lookup_min, up to k tokens.
No model, no KV cache, no forward: it pays where outputs repeat their input (edits, answers from
a passage) and proposes nothing elsewhere. A proposal is only a proposal: the target verifies
it as it verifies a draft model's (design: "Proposers"). Each row keeps an index of its n-grams,
extended as it grows, so a lookup's cost does not grow with the context (NgramIndex).

A host proposer: its step is LookupProposer's (lookup.py).
"""
from __future__ import annotations

import weakref

from ..speculative import SpeculativeConfig, SpeculativeMethod
from .lookup import LookupProposer
from .proposer import Row


class NgramIndex:
    """One row's n-grams, for n in [min_n, max_n], each mapped to the start of its latest
    occurrence that something follows (it ends before the row's last token). Extended as the
    row grows, a token at a time, so a lookup costs O(max_n) whatever the context's length (a
    rescan of the whole history costs O(length x n) per row-step)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple[int, ...], int] = {}   # an n-gram -> its latest start
        self.covered = 0   # occurrences ending before this position are indexed

    def extend(self, tokens: list[int], budget: int | None = None) -> int:
        """Index the occurrences that end before the last token (tokens only ever grow), at
        most `budget` more positions (None: all); returns how many it indexed."""
        start, end = self.covered, len(tokens) - 1
        if budget is not None:
            end = min(end, start + budget)
        for at in range(start, end):
            for n in range(self.min_n, min(self.max_n, at + 1) + 1):
                self.starts[tuple(tokens[at - n + 1:at + 1])] = at - n + 1
        self.covered = max(start, end)
        return self.covered - start

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix of
        `tokens` (n from max_n down to min_n); [] when none matches or k is 0."""
        self.extend(tokens)
        return self.find(tokens, k)

    def find(self, tokens: list[int], k: int) -> list[int]:
        """`lookup` over the occurrences indexed so far."""
        if k <= 0:
            return []
        last = len(tokens)
        for n in range(min(self.max_n, last - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(tokens[last - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


def _check_lookup(spec: SpeculativeConfig) -> None:
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min and prompt_lookup_max must satisfy "
                         f"1 <= min <= max, got {spec.prompt_lookup_min} and "
                         f"{spec.prompt_lookup_max}")


class NgramProposer(LookupProposer):
    speculative_method = SpeculativeMethod(
        "ngram", usage="by prompt lookup (method 'ngram')",
        keys=("prompt_lookup_max", "prompt_lookup_min"), check=_check_lookup)

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        # a position costs one tuple per n: 1,024 positions a step at n 2-4 (a median 2-4 ms on
        # this shared 2-core CPU)
        self.index_budget = max(64, 3072 // (max_n - min_n + 1))
        # each row's index, while its sequence lives (freed at its request's end, or with it)
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair, pad_id: int) -> "NgramProposer":
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """`NgramIndex.lookup` on a history seen once (the rows' own indexes persist)."""
        return NgramIndex(self.min_n, self.max_n).lookup(tokens, k)

    def _index_of(self, row: Row) -> NgramIndex:
        index = self.indexes.get(row)
        if index is None:
            index = self.indexes[row] = NgramIndex(self.min_n, self.max_n)
        return index

    def index(self, row: Row, budget: int | None = None) -> int:
        return self._index_of(row).extend(row.tokens, budget)

    def propose_indexed(self, row: Row, k: int) -> list[int]:
        return self._index_of(row).find(row.tokens, k)

    def request_done(self, row: Row, reason: str) -> None:
        self.indexes.pop(row, None)
