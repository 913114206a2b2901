"""BlockCache: one KV store's cached full blocks (design: "Prefix caching"; the policy that uses
it is engine/prefix_caching.py).

One per KVStore, so per model and dtype: the store is the key's model part. A cached block is
found by its content key (the content id of the block before it, the block's own token ids):
dict equality, so no hash collision can ever hand out the wrong entries. Content ids are never
reused, so a key whose parent was evicted can no longer be reached. Each cached block counts the
tables that hold it; one no table holds waits in an LRU and is evicted only when the store needs
a free block. Blocks are never written once full (rows write only past their own length), so
sharing needs no copy-on-write.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict


class BlockCache:
    """One store's cached blocks: content keys, reference counts and the LRU of unused ones."""

    def __init__(self, block_size: int):
        self.block_size = block_size   # entries per block (kv.blocks.BLOCK_SIZE)
        self._content_ids = itertools.count(1)   # 0: the empty prefix before a first block
        self.by_key: dict[tuple[int, tuple[int, ...]], int] = {}   # content key -> block
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its content key
        self.content_of: dict[int, int] = {}   # block -> content id (the parent part of keys)
        self.refs: dict[int, int] = {}          # block -> tables holding it
        self.unused: OrderedDict[int, None] = OrderedDict()   # refs 0, least recently used first

    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        """The cached blocks holding tokens' first full blocks, up to max_blocks."""
        blocks, parent = [], 0
        for i in range(max_blocks):
            block = self.by_key.get((parent, self._tokens(tokens, i)))
            if block is None:
                break
            blocks.append(block)
            parent = self.content_of[block]
        return blocks

    def _tokens(self, tokens: list[int], block: int) -> tuple[int, ...]:
        return tuple(tokens[block * self.block_size:(block + 1) * self.block_size])

    def held(self, blocks: list[int]) -> int:
        """How many of these cached blocks some table holds already."""
        return sum(self.refs[b] > 0 for b in blocks)

    def hold(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] += 1
            self.unused.pop(block, None)

    def register(self, blocks: list[int], tokens: list[int], start: int, parent: int) -> int:
        """Cache blocks[start:] of one table (full, written for `tokens`), whose block start - 1
        has content id `parent`; returns the last block's content id. A block whose content is
        cached already in another block stays private; the chain goes on through that one."""
        for i in range(start, len(blocks)):
            key = (parent, self._tokens(tokens, i))
            if key not in self.by_key:
                block = blocks[i]
                self.by_key[key], self.key_of[block] = block, key
                self.content_of[block] = next(self._content_ids)
                self.refs[block] = 1   # the table that wrote it
            parent = self.content_of[self.by_key[key]]
        return parent

    def release(self, blocks: list[int]) -> list[int]:
        """A table lets go of its blocks: cached ones it held lose a reference (unused ones go
        to the LRU); returns the others, to be freed."""
        free = []
        for block in blocks:
            if block in self.refs:
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    self.unused[block] = None
            else:
                free.append(block)
        return free

    def evict(self) -> int | None:
        """The least recently used block no table holds, uncached; None when there is none."""
        if not self.unused:
            return None
        block, _ = self.unused.popitem(last=False)
        del self.by_key[self.key_of.pop(block)], self.content_of[block], self.refs[block]
        return block

    def shared_blocks(self) -> int:
        """Holdings beyond the first of each cached block: what summing every row's
        reservation counts twice."""
        return sum(r - 1 for r in self.refs.values() if r > 1)
