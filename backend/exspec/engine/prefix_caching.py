"""Automatic prefix caching on EXSPEC's block store: the pool's policy (design: "Prefix caching").

A full block (BLOCK_SIZE entries) of committed tokens holds KV that depends only on the tokens up
to its end, in one model at one dtype. So once written it can serve every later sequence whose
tokens start the same way: that sequence skips the prefill of those tokens in every model. Each
store keeps its cached blocks in a BlockCache (kv/block_cache.py).

PrefixCaching (one per pool). At admission `lookup` finds a waiting sequence's cached prefix in
every store (the common length, in whole blocks, never the block that holds the last prompt
token: its logits are needed for the first token); `claim` takes those blocks and sets the
sequence's num_cached_target; `attach` puts them into the new group's tables (each cache's length).
`register` caches the full blocks of committed tokens a row has written (after each prefill and
when the row leaves).

Admission stays sound (design: "EXSPEC scheduling"): each row reserves its peak, and a block held
by several rows counts once (`shared_entries` is what the sum of reservations counts twice); a
new sequence's need leaves out the cached blocks another row already holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..kv.blocks import KVStore


@dataclass
class Hit:
    """A waiting sequence's cached prefix: its blocks per store and the entries they save."""
    tokens: int                      # prompt tokens with cached entries in every store
    blocks: list[list[int]]          # per store (target first), the blocks holding them
    held_entries: int                # entries of those blocks that rows hold already (all stores)


class PrefixCaching:
    """The pool's prefix cache over its stores (module doc)."""

    def __init__(self, stores: list[KVStore]):
        self.stores = stores   # the target's, then the proposer's (as Group.caches orders them)
        self.claimed: dict[int, Hit] = {}   # id(sequence) -> its hit, until `attach`
        self.queries = 0       # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0          # of them, tokens found cached (vLLM's prefix_cache_hits)

    def lookup(self, seq) -> Hit:
        size = self.stores[0].prefix.block_size
        max_blocks = (seq.num_to_prefill - 1) // size   # the last prompt token is fed
        found = [store.prefix.match(seq.tokens, max_blocks) for store in self.stores]
        common = min(len(b) for b in found)
        blocks = [b[:common] for b in found]
        # counted once per store, as the least any store saves (every store gets the same share
        # of the KV budget, so each stays within its share)
        held = min(store.prefix.held(b) for store, b in zip(self.stores, blocks))
        return Hit(common * size, blocks, held * size * len(self.stores))

    def claim(self, seq, hit: Hit) -> None:
        """Admitted: hold the hit's blocks and skip their prefill."""
        self.queries += seq.num_to_prefill
        self.hits += hit.tokens
        if not hit.tokens:
            return
        for store, blocks in zip(self.stores, hit.blocks):
            store.prefix.hold(blocks)
        seq.num_cached_target = hit.tokens
        self.claimed[id(seq)] = hit

    def attach(self, group) -> None:
        """A new group's empty tables take its rows' claimed blocks."""
        for row, seq in enumerate(group.seqs):
            hit = self.claimed.pop(id(seq), None)
            if hit is not None:
                for kv, blocks in zip(group.caches(), hit.blocks):
                    table = kv.tables[row]
                    table.blocks.extend(blocks)
                    table.length = hit.tokens
                    table.cached_blocks = len(blocks)
                    table.content = kv.store.prefix.content_of[blocks[-1]]

    def drop_claims(self, seqs=None) -> None:
        """The tick failed between `claim` and `attach` (for `seqs`, or every row): the
        claimed blocks are let go."""
        for key in [id(s) for s in seqs] if seqs is not None else list(self.claimed):
            hit = self.claimed.pop(key, None)
            for store, blocks in zip(self.stores, hit.blocks if hit else []):
                store.free(list(blocks))

    def register(self, group) -> None:
        """Cache the full blocks of committed tokens every row of the group has written."""
        for kv in group.caches():
            for seq, table in zip(group.seqs, kv.tables):
                full = table.length // kv.store.prefix.block_size   # entries below length are committed (I3)
                if full > table.cached_blocks:
                    table.content = kv.store.prefix.register(table.blocks[:full], seq.tokens,
                                                             table.cached_blocks, table.content)
                    table.cached_blocks = full

    def shared_entries(self) -> int:
        """Entries the sum of the rows' reservations counts more than once (all stores, each
        as the least any store shares; see `lookup`)."""
        shared = min(store.prefix.shared_blocks() for store in self.stores)
        return shared * self.stores[0].prefix.block_size * len(self.stores)

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else None,
                "prefix_cache_blocks": sum(len(s.prefix.refs) for s in self.stores)}
