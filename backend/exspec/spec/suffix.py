"""SuffixProposer: suffix decoding (Oliaro et al., arXiv 2411.04975; vLLM's "suffix" method).

Two kinds of suffix tree propose: each request's own, over its prompt and output (extended as it
commits tokens), and one global tree over the outputs of earlier requests that ended with `stop`
or `length` (an aborted or failed request's output never enters it), holding at most
`max_cached_requests` of them and `max_cached_tokens` tokens in all (the oldest evicted first).
For a row, every suffix of its last tokens up to the trees' depth that occurred before is a
match; from a match of m tokens the proposal follows the most frequent continuation, a token at
a time, while the path's probability (the product of count(child) / count(parent)) stays at or
above `min_token_prob`, for at most min(k, floor(max_spec_factor * m)) tokens; of all matches in both trees the proposal with the
highest score (the sum of its tokens' path probabilities) wins. So a row proposes many tokens
where it repeats something seen often, and none where nothing matches. A proposal is only a
proposal: the target verifies it as it verifies any other (design: "Proposers").

A host proposer: its step is LookupProposer's (lookup.py).
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from ..speculative import SpeculativeConfig, SpeculativeMethod
from .lookup import LookupProposer
from .proposer import Row

# vLLM's suffix keys; the last is exspec's own (vLLM caps the global tree by requests only)
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
               "suffix_decoding_max_cached_tokens")


class _Node:
    """A substring of the indexed sequences (its path from the root) and how many times it
    occurs. A new node is a lazy leaf: it keeps where its first occurrence continues
    (`tokens[at:]`, a chain of count-1 substrings) instead of a chain of one-child nodes, so a
    sequence costs O(its length) nodes, not O(length x depth); the next occurrence that goes on
    past it makes it an inner node, one level at a time. Other occurrences of a lazy leaf (its
    count above 1) end where their sequence ends."""
    __slots__ = ("count", "depth", "children", "head", "tokens", "at")

    def __init__(self, depth: int, tokens=None, at: int = 0):
        self.count = 1
        self.depth = depth
        self.children: dict[int, _Node] | None = None if tokens is not None else {}
        self.head: int | None = None     # the child token with the highest count
        self.tokens, self.at = tokens, at   # a lazy leaf's continuation

    @property
    def lazy(self) -> bool:
        return self.children is None


def _rank(node: _Node, tok: int) -> tuple[int, int]:
    return node.children[tok].count, -tok


class SuffixTree:
    """Every substring of at most `max_depth` tokens of the indexed sequences, with its count of
    occurrences. Sequences are extended a token at a time (O(max_depth) per token, whatever
    their length) and removed whole."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(0)
        self.root.count = 0
        self._cursors: dict[int, list[_Node]] = {}   # per sequence: its suffixes' inner nodes
        self._tokens: dict[int, list[int]] = {}       # per sequence: what is indexed of it
        self._covered: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, seq_id: int, tokens: list[int], budget: int | None = None) -> int:
        """Index `tokens` (the sequence's whole list, which only grows) up to its end, at most
        `budget` more tokens (None: all); returns how many it indexed. A lazy leaf may point
        past what is indexed: those tokens did follow it."""
        if seq_id not in self._tokens:
            self._tokens[seq_id], self._cursors[seq_id], self._covered[seq_id] = tokens, [], 0
        cursors, start = self._cursors[seq_id], self._covered[seq_id]
        end = len(tokens) if budget is None else min(len(tokens), start + budget)
        for t in range(start, end):
            tok = tokens[t]
            self.root.count += 1
            moved = []
            for node in [self.root] + cursors:   # the suffixes ending at t - 1, shortest first
                child = self._step_in(node, tok, tokens, t + 1)
                if child is not None and child.depth < self.max_depth:
                    moved.append(child)
            cursors[:] = moved
        self._covered[seq_id] = end
        return end - start

    def _step_in(self, node: _Node, tok: int, tokens: list[int], after: int) -> _Node | None:
        """One more occurrence of node's substring followed by `tok`: the child's count grows
        (made lazy if new, returned None: its continuation is implied from then on)."""
        if node.lazy:
            self._unfold(node)
        child = node.children.get(tok)
        if child is None:
            node.children[tok] = _Node(node.depth + 1, tokens, after)
            self._raise_head(node, tok)
            return None
        child.count += 1
        self._raise_head(node, tok)
        return child

    def _unfold(self, node: _Node) -> None:
        """A lazy leaf becomes an inner node: its one occurrence's next token a lazy child."""
        tokens, at = node.tokens, node.at
        node.children, node.tokens = {}, None
        if at < len(tokens) and node.depth < self.max_depth:
            node.children[tokens[at]] = _Node(node.depth + 1, tokens, at + 1)
            node.head = tokens[at]

    @staticmethod
    def _raise_head(node: _Node, tok: int) -> None:
        """After tok's count grew: the head is the most frequent child, the lowest id on a tie
        (so a proposal depends on the counts alone)."""
        head = node.head
        if head is None or _rank(node, tok) > _rank(node, head):
            node.head = tok

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: every count it added comes off; nodes left at 0 go."""
        tokens = self._tokens.pop(seq_id)
        del self._cursors[seq_id], self._covered[seq_id]
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for t in range(start, min(start + self.max_depth, len(tokens))):
                child = node.children[tokens[t]]
                child.count -= 1
                if child.count == 0:
                    del node.children[tokens[t]]
                if node.head == tokens[t]:
                    node.head = max(node.children, key=lambda c: _rank(node, c), default=None)
                if child.lazy:   # nothing below counts this occurrence
                    if child.count and child.tokens is tokens:
                        child.children, child.tokens = {}, None   # the rest end there
                    break
                if child.count == 0:
                    break
                node = child

    def count(self, substring: list[int]) -> int:
        """How many times `substring` (at most max_depth tokens) occurs; 0 if never."""
        found = self._match(substring)
        if found is None:
            return 0
        node, inside = found
        return node.count if inside == 0 else 1   # inside a lazy leaf: its one occurrence

    def _match(self, substring) -> tuple[_Node, int] | None:
        """The node of `substring`, and how far into a lazy leaf's continuation it ends."""
        node, inside = self.root, 0
        for tok in substring:
            if node.lazy:
                at = node.at + inside
                if at >= len(node.tokens) or node.tokens[at] != tok or node.depth + inside >= self.max_depth:
                    return None
                inside += 1
            else:
                child = node.children.get(tok)
                if child is None:
                    return None
                node, inside = child, 0
        return node, inside

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """The best proposal over every match of a suffix of `context` (shorter than it, at
        most max_depth tokens): (tokens, score)."""
        context = context[-self.max_depth:]
        best, best_score = [], 0.0
        for m in range(1, len(context)):
            found = self._match(context[len(context) - m:])
            if found is None:
                break   # a longer suffix cannot occur where a shorter one does not
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            proposal, score = self._follow(*found, limit, min_token_prob)
            if score >= best_score:
                best, best_score = proposal, score
        return best, best_score

    def _follow(self, node: _Node, inside: int, limit: int, min_token_prob: float):
        """The most frequent continuation from a match, while its probability holds."""
        out, score, prob = [], 0.0, 1.0
        while len(out) < limit:
            if node.lazy:   # one occurrence goes on: its continuation
                at = node.at + inside
                if at >= len(node.tokens) or node.depth + inside >= self.max_depth:
                    break
                tok = node.tokens[at]
                if inside == 0:
                    prob /= node.count
                inside += 1
            else:
                if node.head is None:
                    break
                tok = node.head
                child = node.children[tok]
                prob *= child.count / node.count
                node, inside = child, 0
            if prob < min_token_prob:
                break
            out.append(tok)
            score += prob
        return out, score


class SuffixProposer(LookupProposer):
    # vLLM: without num_speculative_tokens, suffix decoding proposes up to the tree's depth
    speculative_method = SpeculativeMethod(
        "suffix", usage="by suffix decoding (method 'suffix')", keys=SUFFIX_KEYS,
        k_from="suffix_decoding_max_tree_depth")
    learns_across_requests = True   # the global tree of earlier outputs

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_tokens: int = 1_000_000):
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # a token costs up to one step per depth: 256 tokens a step at depth 24, a median 2-16 ms
        # on this (shared, 2-core) CPU for a 16k-token prompt repeating itself, the dearest case
        self.index_budget = max(64, 6144 // max_tree_depth)
        # each row's own tree, while its sequence lives (freed at its request's end, or with it)
        self.local: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.global_tree = SuffixTree(max_tree_depth)
        # global sequences, oldest first, with their lengths: the cap is on tokens too
        # (~200 bytes each), since a few long answers outweigh thousands of short ones
        self.cached: OrderedDict[int, int] = OrderedDict()
        self.cached_tokens = 0
        self._next_id = 0
        # the engine thread proposes and ends requests; an abort may end one from another
        self.lock = threading.Lock()

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, pair, pad_id: int) -> "SuffixProposer":
        return cls(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                   spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                   spec.suffix_decoding_max_cached_tokens)

    def index(self, row: Row, budget: int | None = None) -> int:
        tree = self.local.get(row)
        if tree is None:
            tree = self.local[row] = SuffixTree(self.max_tree_depth)
        return tree.extend(0, row.tokens, budget)

    def propose_indexed(self, row: Row, k: int) -> list[int]:
        return self.propose_scored(row, k)[0]

    def propose_scored(self, row: Row, k: int) -> tuple[list[int], float]:
        """`propose_indexed`'s proposal and its score: the sum of its tokens' path
        probabilities, the tokens it expects kept if the trees' frequencies were the target's
        (the hybrid weighs it against a model's drafts: hybrid.py)."""
        if k <= 0:
            return [], 0.0
        args = (k, self.max_spec_factor, self.min_token_prob)
        own, own_score = self.local[row].speculate(row.tokens, *args)
        with self.lock:
            if not len(self.global_tree):
                return own, own_score
            seen, seen_score = self.global_tree.speculate(row.tokens, *args)
        return (own, own_score) if own_score >= seen_score else (seen, seen_score)

    def forget(self) -> None:
        with self.lock:
            self.global_tree = SuffixTree(self.max_tree_depth)
            self.cached.clear()
            self.cached_tokens = 0

    def request_done(self, row: Row, reason: str) -> None:
        """A request's tree goes; its output joins the global tree if it ended as asked, and
        the oldest outputs leave it past max_cached_requests or max_cached_tokens."""
        self.local.pop(row, None)
        output = list(row.output_ids)
        if reason not in ("stop", "length") or not output or self.max_cached_requests == 0:
            return
        if len(output) > self.max_cached_tokens:   # it would evict everything, itself too
            return
        with self.lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            self.global_tree.extend(seq_id, output)
            self.cached[seq_id] = len(output)
            self.cached_tokens += len(output)
            while (len(self.cached) > self.max_cached_requests
                   or self.cached_tokens > self.max_cached_tokens):
                oldest, length = self.cached.popitem(last=False)
                self.global_tree.remove(oldest)
                self.cached_tokens -= length
