"""EXSPEC's KV storage: static, block-allocated, one store per model (design: "EXSPEC scheduling").

A separate module next to padded.py (which keeps PaddedKV, EQSPEC's baseline) because the store, its
allocator and its cache layer are one concept of their own and together would push padded.py past
~400 lines. All of its tensor surgery stays in here.

KVStore. Per model, per layer, one preallocated buffer of keys and one of values,
[num_blocks * BLOCK_SIZE, kv_heads, head_dim], cut into blocks of BLOCK_SIZE token slots. A
host free list hands blocks out: a row's next block right after its last when that is free,
else the lowest free one. Block 0 is scratch: pad query tokens write there and padded
block-table entries read it, and the mask hides it.

BlockTable. One sequence's blocks in one store, for the sequence's whole life: position p of the
sequence lives in slot `blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`, so the write column
is the token's position and rolling back rejected drafts is a length change. Its blocks go back
to the free list when the row leaves (`release`) or, whatever path drops it, when it is freed.

BlockKV. A group's view: the rows' tables. Merging groups and dropping rows copy no KV (only
tables move). A forward gets a device block table [B, nb] (nb: the longest row's blocks, bucketed
to a power of two where compiled graphs are per shape: CUDA graphs, the read in place); the cache layer writes the new entries at their slots
and gathers each row's blocks into [B, H, nb * BLOCK_SIZE, D] for attention: dense attention
over those columns, so a forward costs in proportion to the longest row's blocks (measured: see
the docs, "The decode path"). On the eager path a group of one row whose blocks are consecutive
(a sequence alone in its store gets them so) skips the gather and the mask: its entries are one
slice of each buffer, read in place, and the model's own causal mask is exact. The masks come
from one function (kv.LayerMasks.build, one mask per layer type, sliding windows included) of
device tensors: key positions and query positions.

Everything a forward needs that varies per step is a device tensor (table, positions, validity),
never a Python int, so a compiled forward does not recompile as rows grow, roll back or leave.
"""
from __future__ import annotations

import heapq
import weakref

import torch
from transformers.cache_utils import DynamicLayer

from ..utils.transfer import Transfers
from .block_cache import BlockCache
from .in_place import block_masks, table_maps
from .padded import LayerMasks, new_cache

BLOCK_SIZE = 16
SCRATCH_BLOCK = 0


def table_bucket(blocks: int) -> int:
    """A compiled path's block-table width for rows of at most `blocks` blocks: the next power
    of two, at least 2 (torch compiles a size of 1 apart)."""
    return 1 << (max(2, blocks) - 1).bit_length()


def row_bucket(rows: int) -> int:
    """The rows a forward with static shapes (CUDA graphs) runs for `rows` real ones: 1, 2, 4,
    then multiples of 8 (vLLM's capture sizes), the rest pad rows. A graph per row count would
    be max_batch_size captures per width and table bucket, each a forward's time in the warm-up."""
    return 1 << (rows - 1).bit_length() if rows <= 4 else -(-rows // 8) * 8


def row_buckets(max_rows: int) -> list[int]:
    """Every `row_bucket` up to max_rows'."""
    return sorted({row_bucket(rows) for rows in range(1, max_rows + 1)})


def table_buckets(max_tokens: int) -> list[int]:
    """Every block-table width a compiled path meets for rows of at most `max_tokens` entries
    (2, 4, ... up to the bucket of max_tokens)."""
    top = table_bucket(KVStore.units_for(max_tokens))
    return [1 << i for i in range(1, top.bit_length())]


class _Forward:
    """The current forward's indices, shared by every layer of a store: where the new entries
    go (`slots`, [B*q]) and which slots each row reads (`gather`, [B, W]); or, for one row whose
    blocks are consecutive, its `span` (first slot, entries cached, entries after the forward):
    its entries are then one slice of the buffer, read in place. With no `gather` and no
    `span`, every row reads the whole buffer in place (in_place.py: a BlockMask says which
    slots are its own)."""

    def __init__(self):
        self.slots: torch.Tensor | None = None
        self.gather: torch.Tensor | None = None
        self.span: tuple[int, int, int] | None = None
        self._copies: dict = {}   # the indices on other GPUs (device_map), once per forward

    def bind(self, slots: torch.Tensor | None, gather: torch.Tensor | None,
             span: tuple[int, int, int] | None = None) -> None:
        self.slots, self.gather, self.span, self._copies = slots, gather, span, {}

    @property
    def in_place(self) -> bool:
        return self.gather is None and self.span is None

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device == self.slots.device:
            return self.slots, self.gather
        if device not in self._copies:
            self._copies[device] = (self.slots.to(device), self.gather.to(device))
        return self._copies[device]


def _rows_of(buffer: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """[B, H, W, D] from a [slots, H, D] buffer and [B, W] slot indices: whole slots gathered
    (index_select copies H * D contiguous values per slot), then made contiguous, since some
    attention code views the keys it gets. Advanced indexing over (slot, head) pairs did the
    same in one kernel at 3-4x the time: 40% of a B = 8 forward of the demo target on a CPU.
    The copy goes into a fresh tensor rather than through `contiguous()`, whose contiguity test
    on a compiled region's symbolic rows guarded on one row (compiled.py keeps rows symbolic
    from one)."""
    rows, width = gather.shape
    picked = buffer.index_select(0, gather.reshape(-1)).view(rows, width, *buffer.shape[1:])
    out = picked.new_empty((rows, buffer.shape[1], width, *buffer.shape[2:]))
    return out.copy_(picked.transpose(1, 2))


def _buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A store buffer. On CUDA its address is marked static: the compiled path's CUDA graphs
    (cudagraph trees) write into it in place, and they skip a graph whose mutated input is not
    static. (A store that grows gets new buffers: its graphs are captured again.)"""
    if tensor.is_cuda:
        torch._dynamo.mark_static_address(tensor)
    return tensor


class _BlockLayer(DynamicLayer):
    """One layer's slice of the store, as a transformers cache layer: `update` writes the new
    entries at their slots and returns every row's gathered entries."""

    def __init__(self, capacity: int, forward: _Forward):
        super().__init__()
        self.capacity = capacity   # token slots (the store's blocks x BLOCK_SIZE)
        self.forward = forward

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:   # shapes come from the first write (eager, before compiling)
            self.device = key_states.device
            self.keys = _buffer(key_states.new_zeros((self.capacity,) + key_states.shape[1:2] + key_states.shape[3:]))
            self.values = _buffer(value_states.new_zeros((self.capacity,) + value_states.shape[1:2] + value_states.shape[3:]))
            self.is_initialized = True
        if self.forward.span is not None:
            return self._update_span(key_states, value_states, *self.forward.span)
        if self.forward.in_place:   # the whole buffers, as [1, H, slots, D] views
            slots, gather = self.forward.slots, None
        else:
            slots, gather = self.forward.on(self.keys.device)
        heads = key_states.shape[1]
        self.keys.index_copy_(0, slots, key_states.transpose(1, 2).reshape(-1, heads, key_states.shape[3]))
        self.values.index_copy_(0, slots, value_states.transpose(1, 2).reshape(
            -1, value_states.shape[1], value_states.shape[3]))
        if gather is None:
            return self.keys.transpose(0, 1)[None], self.values.transpose(0, 1)[None]
        return _rows_of(self.keys, gather), _rows_of(self.values, gather)

    def _update_span(self, key_states, value_states, start: int, cached: int, total: int):
        """One row in consecutive blocks: its new entries written at their slots, and its
        entries so far returned as views of the buffers ([1, H, total, D]), no gather."""
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            buffer[start + cached:start + total].copy_(new[0].transpose(0, 1))
        return (self.keys[start:start + total].transpose(0, 1)[None],
                self.values[start:start + total].transpose(0, 1)[None])

    def get_seq_length(self) -> int:
        if self.forward.span is not None:   # what HF's own masks count as cached
            return self.forward.span[1]
        if self.forward.slots is None:
            return 0
        return self.capacity if self.forward.in_place else self.forward.gather.shape[1]

    def grow(self, slots: int) -> None:
        extra, self.capacity = slots - self.capacity, slots
        if self.is_initialized:
            self.keys = _buffer(torch.cat([self.keys, self.keys.new_zeros((extra,) + self.keys.shape[1:])]))
            self.values = _buffer(torch.cat([self.values, self.values.new_zeros((extra,) + self.values.shape[1:])]))


class KVStore:
    """One model's KV entries for every sequence of the pool, in blocks (see the module doc).
    Under a budget it is made at its full share and never grows; without one it doubles when
    its blocks run out (one copy of the buffers, rare)."""

    def __init__(self, model, device, num_blocks: int = 64, grows: bool = True,
                 bucketed: bool = False, prefix=None, in_place: bool = False, mask_rows: int = 1):
        self.device = torch.device(device)
        # compiled forwards read the buffers in place (in_place.py); a store that grew would
        # change their graphs' shapes, so such a store has a budget and never grows
        self.in_place = in_place and not grows
        self.mask_rows = mask_rows   # the rows of what in_place.block_masks' mask function reads
        self.prefix = prefix   # block_cache.BlockCache, or None: caching off
        self.bucketed = bucketed   # table widths in powers of two (few shapes, for graphs per shape)
        self.masks = LayerMasks.of(model)
        self.num_blocks = max(2, num_blocks)
        self.grows = grows
        self.forward = _Forward()
        self.transfers = Transfers(device)   # block tables go up through it (counted, pinned)
        self.cache = new_cache(model)
        self.cache.layers = [_BlockLayer(self.num_blocks * BLOCK_SIZE, self.forward)
                             for _ in self.cache.layers]
        # The free blocks, and a min-heap over them for the lowest one (it may still hold blocks
        # taken out of turn by `_take`: skipped when popped, dropped when the heap is rebuilt).
        # Both O(log n) per block: a release runs on the tick, and a GPU store has 1e5 blocks.
        self.free_set = set(range(SCRATCH_BLOCK + 1, self.num_blocks))
        self.free_heap = sorted(self.free_set)

    # -- allocation units (what admission reserves; design: "EXSPEC scheduling") ------------
    @staticmethod
    def units_for(num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` KV entries holds in this store."""
        return -(-num_tokens // BLOCK_SIZE)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` free blocks: each the one right after the previous (after `after`, a row's
        last block) when that is free, else the lowest free one. A row's blocks then stay
        consecutive wherever its neighbours leave room, and a row alone reads its entries in
        place (BlockTable.span); handing out the lowest first keeps free room in one piece."""
        while count > len(self.free_set):
            evicted = None if self.prefix is None else self.prefix.evict()
            if evicted is None:
                self._grow()
            else:   # an unused cached block before a bigger store
                self._free_one(evicted)
        out = []
        for _ in range(count):
            after = after + 1 if after is not None and after + 1 in self.free_set else self._lowest()
            self.free_set.remove(after)
            out.append(after)
        if len(self.free_heap) > 2 * len(self.free_set) + 64:   # mostly blocks taken out of turn
            self.free_heap = sorted(self.free_set)
        return out

    def _lowest(self) -> int:
        while self.free_heap[0] not in self.free_set:
            heapq.heappop(self.free_heap)
        return heapq.heappop(self.free_heap)

    def free(self, blocks: list[int]) -> None:
        """A table lets go of its blocks (cached ones stay cached while unused)."""
        for block in blocks if self.prefix is None else self.prefix.release(blocks):
            self._free_one(block)
        blocks.clear()

    def _free_one(self, block: int) -> None:
        self.free_set.add(block)
        heapq.heappush(self.free_heap, block)

    def _grow(self) -> None:
        # Doubling holds the old and new buffers at once (and on CUDA recaptures every graph),
        # so a store under a budget is made at its share instead and never grows past it.
        if not self.grows:
            raise torch.OutOfMemoryError(f"KV store full: {self.num_blocks} blocks of {BLOCK_SIZE} tokens")
        new = self.num_blocks * 2
        for layer in self.cache.layers:
            layer.grow(new * BLOCK_SIZE)
        self.free(list(range(self.num_blocks, new)))
        self.num_blocks = new


class BlockTable:
    """One sequence's blocks in one store, held for the sequence's lifetime."""

    def __init__(self, store: KVStore):
        self.blocks: list[int] = []   # never rebound: the finalizer frees this very list
        self.length = 0               # KV entries written for real tokens
        self.cached_blocks = 0        # leading blocks the prefix cache has seen (engine/prefix_caching.py)
        self.content = 0              # the content id of the last of them
        self.release = weakref.finalize(self, store.free, self.blocks)

    def span(self, count: int) -> tuple[int, int, int] | None:
        """(first slot, entries cached, entries after `count` more) when this sequence's
        blocks are consecutive, so its entries are one slice of the store (position p at slot
        first + p); None otherwise. A sequence alone in its store gets consecutive blocks."""
        first = self.blocks[0]
        if any(b != first + i for i, b in enumerate(self.blocks)):
            return None
        return first * BLOCK_SIZE, self.length, self.length + count

    def reserve(self, store: KVStore, num_tokens: int) -> bool:
        """Make room for `num_tokens` entries; True when blocks were added."""
        more = store.units_for(num_tokens) - len(self.blocks)
        if more > 0:
            self.blocks.extend(store.allocate(more, self.blocks[-1] if self.blocks else None))
        return more > 0


class BlockKV:
    """A group's rows in one model's KVStore; same interface as kv.PaddedKV."""

    aligned = True     # nothing here ever needs realigning
    free_pads = True   # a pad input costs nothing: its entry goes to the scratch block

    def __init__(self, store: KVStore, tables: list[BlockTable]):
        self.store = store
        self.tables = tables
        self._table: torch.Tensor | None = None   # the device block table, rebuilt on change
        self._columns_of: torch.Tensor | None = None   # the table `_columns` was made from
        self._padded: tuple | None = None   # (table, it with pad rows): `_with_rows`'s last
        self._maps: tuple | None = None     # (table, in_place.table_maps of it), read in place

    @property
    def cache(self):
        return self.store.cache

    @property
    def batch(self) -> int:
        return len(self.tables)

    @property
    def lengths(self) -> list[int]:
        return [t.length for t in self.tables]

    def allocated_tokens(self) -> int:
        """Token slots held by the rows' blocks (used ones and room to grow)."""
        return sum(len(t.blocks) for t in self.tables) * BLOCK_SIZE

    # -- a forward pass -----------------------------------------------------------------------
    def attention_mask(self, input_valid: torch.Tensor, counts: list[int],
                       positions: torch.Tensor, always: bool = True, in_place: bool = False):
        """Room for the forward's tokens, the forward's slots bound for the layers, and its mask.
        input_valid / positions [B, q] on the device (left-padded rows: real tokens last).
        `always` False (eager): one row in consecutive blocks reads its entries in place and
        gets no mask (None: its columns are its positions, so the model's own causal masks are
        exact, sliding windows included, and HF skips one for a single query). `in_place` (a
        compiled forward that reads its store in place): every row reads the whole buffers,
        and the masks are BlockMasks (in_place.py). Rows of input_valid past the group's are
        pad rows (`row_bucket`): they read and write only the scratch block."""
        grew = [t.reserve(self.store, t.length + c) for t, c in zip(self.tables, counts)]
        if not always and self.batch == 1 and counts[0] == input_valid.shape[1]:
            span = self.tables[0].span(counts[0])
            if span is not None:
                if any(grew):
                    self._table = None   # rebuilt whenever a later forward gathers
                self.store.forward.bind(None, None, span)
                return None
        if any(grew) or self._table is None:
            self._table = self.device_table()
        table = self._with_rows(self._table, input_valid.shape[0])
        if in_place and self.store.in_place:
            return self._in_place_masks(table, input_valid, positions)
        gather, columns = self._columns(table)
        # a token's slot is the slot of the column its position names
        slots = torch.where(input_valid, gather.gather(1, positions), SCRATCH_BLOCK * BLOCK_SIZE).reshape(-1)
        self.store.forward.bind(slots, gather)
        # a gathered column's position is its column: later ones (past the row's length,
        # scratch) are hidden by position, and out-of-window ones by their layer's window
        return self.store.masks.build(columns, None, positions)

    def _with_rows(self, table: torch.Tensor, rows: int) -> torch.Tensor:
        """`table` with scratch rows up to `rows` (a static-shape forward's pad rows), made
        once per table and row count."""
        if rows == table.shape[0]:
            return table
        if self._padded is None or self._padded[0] is not table or self._padded[1].shape[0] != rows:
            padded = torch.nn.functional.pad(table, (0, 0, 0, rows - table.shape[0]), value=SCRATCH_BLOCK)
            self._padded = (table, padded)
        return self._padded[1]

    def _in_place_masks(self, table: torch.Tensor, input_valid: torch.Tensor, positions: torch.Tensor):
        """A compiled forward's read in place: its slots bound (a token's is its position's
        slot in its row's block), and the BlockMask of each layer type (in_place.py)."""
        store = self.store
        slots = table.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE
        store.forward.bind(torch.where(input_valid, slots, SCRATCH_BLOCK * BLOCK_SIZE).reshape(-1), None)
        if self._maps is None or self._maps[0] is not table:
            self._maps = (table, table_maps(table, store.num_blocks, SCRATCH_BLOCK, store.mask_rows))
        return block_masks(self._maps[1], positions, input_valid, BLOCK_SIZE, store.masks.windows)

    def _columns(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's slot of every gathered column [B, W] and the columns' positions [W]:
        made once per device table (a table lasts until a row takes a new block, and serves
        every forward of the model till then), not per forward."""
        if self._columns_of is not table:
            width = table.shape[1] * BLOCK_SIZE
            offsets = torch.arange(BLOCK_SIZE, device=table.device)
            self._gather = (table[:, :, None] * BLOCK_SIZE + offsets).reshape(table.shape[0], width)
            self._positions = torch.arange(width, device=table.device)
            self._columns_of = table
        return self._gather, self._positions

    def device_table(self) -> torch.Tensor:
        """The rows' block table on the device: one host-to-device copy of `host_table()`."""
        return self.store.transfers.to_device(torch.tensor(self.host_table(), dtype=torch.long))

    def host_table(self) -> list[list[int]]:
        """[B][nb] block ids, padded with the scratch block. nb: the longest row's blocks; where
        a compiled graph is per shape (`bucketed`) rounded up to a power of two so the shapes a
        forward sees stay few, and at least 2 (torch compiles a size of 1 apart). Otherwise it
        reads only what rows hold: a bucket would make it read up to twice that (measured
        eagerly: 1.2-1.5x the forward)."""
        longest = max(len(t.blocks) for t in self.tables)
        return self.padded_table(table_bucket(longest) if self.store.bucketed else longest)

    def padded_table(self, width: int) -> list[list[int]]:
        """[B][width] block ids: each row's blocks, then the scratch block."""
        return [t.blocks + [SCRATCH_BLOCK] * (width - len(t.blocks)) for t in self.tables]

    def table_rows_for(self, extra: list[int]) -> list[list[int]] | None:
        """Ahead of a step: room for extra[i] more entries in row i; the new block table's host
        rows when the blocks changed (the runner sends them up with the step's other inputs,
        then `use_table`), else None (the device table stands)."""
        grew = [t.reserve(self.store, t.length + more) for t, more in zip(self.tables, extra)]
        return self.host_table() if any(grew) or self._table is None else None

    def use_table(self, table: torch.Tensor) -> None:
        self._table = table

    def make_contiguous(self) -> int:
        return 0   # the store's buffers never change shape or strides

    def appended(self, input_valid: torch.Tensor, counts: list[int]) -> None:
        for table, c in zip(self.tables, counts):
            table.length += c

    def drop_tail(self, counts: list[int], counts_dev: torch.Tensor | None = None) -> None:
        """Forget the last counts[i] entries of row i: a length change, nothing moves (and
        nothing on the device: the mask hides entries past a query's position)."""
        for table, c in zip(self.tables, counts):
            table.length -= c

    def compact(self) -> int:
        return 0

    # -- group algebra: only tables move ------------------------------------------------------
    def select(self, rows: list[int]) -> int:
        """Keep only `rows` (in that order); the others' blocks go back to the store."""
        keep = set(rows)
        for i, table in enumerate(self.tables):
            if i not in keep:
                table.release()
        self.tables = [self.tables[i] for i in rows]
        self._table = None
        return 0

    @classmethod
    def concat(cls, parts: list["BlockKV"], model) -> tuple["BlockKV", int]:
        return cls(parts[0].store, [t for p in parts for t in p.tables]), 0


class BlockStores:
    """The EXSPEC layout's factory: one KVStore per model, new groups' BlockKVs in them."""

    def __init__(self, device, max_num_kv_tokens: int | None = None, bucketed: bool = False,
                 prefix_caching: bool = False, in_place: bool = False, max_rows: int = 1):
        """`max_num_kv_tokens`: each store's share of the budget (None: no budget, stores
        double as they fill). Under a budget every store takes its whole share when first used
        (its scratch block within it) and never grows: growing by copying would hold twice the
        buffers for a moment, past the budget."""
        self.device = device
        self.bucketed = bucketed   # table widths in powers of two (kv_layout says where)
        self.in_place = in_place   # compiled forwards read the stores in place (in_place.py)
        # the most rows a decode forward has: max_batch_size's, with static shapes' pad rows
        self.max_rows = row_bucket(max_rows)
        self.prefix_caching = prefix_caching   # each store keeps a block_cache.BlockCache
        self.blocks = None if max_num_kv_tokens is None else max_num_kv_tokens // BLOCK_SIZE
        self.stores: dict[int, KVStore] = {}

    @staticmethod
    def entries_for(num_tokens: int) -> int:
        """KV entries a sequence that grows to num_tokens holds in a store: whole blocks (what
        admission reserves; design: "EXSPEC scheduling")."""
        return KVStore.units_for(num_tokens) * BLOCK_SIZE

    @staticmethod
    def allocation_for(reservations: list[int], models: int) -> int:
        """KV entries the stores allocate for sequences holding these reservations (all
        models, in entries_for units): their blocks, and each store's scratch block (counted
        beside them, none for an empty pool)."""
        return sum(reservations) + models * BLOCK_SIZE if reservations else 0

    def store(self, model) -> KVStore:
        if id(model) not in self.stores:
            self.stores[id(model)] = KVStore(model, self.device, self.blocks or 64,
                                             grows=self.blocks is None, bucketed=self.bucketed,
                                             in_place=self.in_place, mask_rows=self.max_rows,
                                             prefix=BlockCache(BLOCK_SIZE) if self.prefix_caching else None)
        return self.stores[id(model)]

    def empty(self, model, batch: int, device) -> BlockKV:
        store = self.store(model)
        return BlockKV(store, [BlockTable(store) for _ in range(batch)])
