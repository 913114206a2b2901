"""EXSPEC's block store (kv/blocks.py) on its own: allocation units, blocks returned when rows
leave, merges and leaving rows that copy no KV, growth that keeps every entry, and the mask."""
import torch

from exspec.demo.tiny import llama
from exspec.kv.padded import FULL_ATTENTION
from exspec.kv.blocks import BLOCK_SIZE, BlockStores, row_bucket, row_buckets


def prefill(kv, model, lengths):
    """Real forwards writing each row's first lengths[i] tokens (left-padded)."""
    width = max(lengths)
    ids = torch.ones(len(lengths), width, dtype=torch.long)
    valid = torch.arange(width)[None, :] >= (width - torch.tensor(lengths))[:, None]
    pos = (valid.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=kv.attention_mask(valid, lengths, pos), position_ids=pos,
              cache=kv.cache, use_cache=True, logits_to_keep=1)
    kv.appended(valid, lengths)


def test_allocation_units_and_blocks_back_on_leaving():
    model = llama(320, 0).eval()
    stores = BlockStores("cpu")
    store = stores.store(model)
    free = len(store.free_set)
    assert store.units_for(1) == 1 and store.units_for(BLOCK_SIZE) == 1 and store.units_for(BLOCK_SIZE + 1) == 2
    kv = stores.empty(model, 3, "cpu")
    prefill(kv, model, [5, BLOCK_SIZE + 3, 2 * BLOCK_SIZE])
    assert sum(kv.lengths) == 5 + BLOCK_SIZE + 3 + 2 * BLOCK_SIZE
    assert kv.allocated_tokens() == (1 + 2 + 2) * BLOCK_SIZE
    assert len(store.free_set) == free - 5
    assert kv.select([2, 0]) == 0 and kv.lengths == [2 * BLOCK_SIZE, 5]
    assert len(store.free_set) == free - 3, "the dropped row's blocks did not come back"
    del kv   # a group dropped whole (a failure, say): its rows' blocks come back too
    assert len(store.free_set) == free


def test_merge_and_rollback_copy_nothing_and_keep_entries():
    model = llama(320, 0).eval()
    stores = BlockStores("cpu")
    a, b = stores.empty(model, 2, "cpu"), stores.empty(model, 1, "cpu")
    prefill(a, model, [4, 9])
    prefill(b, model, [7])
    layer = a.cache.layers[0]
    before = layer.keys.data_ptr(), layer.keys.clone()
    merged, moved = type(a).concat([a, b], model)
    assert moved == 0 and merged.lengths == [4, 9, 7]
    merged.drop_tail([1, 0, 2])
    assert merged.lengths == [3, 9, 5] and layer.keys.data_ptr() == before[0]
    assert torch.equal(layer.keys, before[1]), "a merge or a rollback moved KV entries"


def test_store_growth_keeps_every_entry():
    model = llama(320, 0).eval()
    stores = BlockStores("cpu")
    store = stores.store(model)
    kv = stores.empty(model, 1, "cpu")
    prefill(kv, model, [8])
    slots = kv.tables[0].blocks[0] * BLOCK_SIZE
    first = store.cache.layers[0].keys[slots:slots + 8].clone()
    blocks = store.num_blocks
    kv.tables[0].reserve(store, (blocks + 1) * BLOCK_SIZE)   # more than the store holds: it doubles
    assert store.num_blocks == 2 * blocks
    assert torch.equal(store.cache.layers[0].keys[slots:slots + 8], first)


def test_mask_shows_each_query_the_positions_up_to_its_own():
    mask = FULL_ATTENTION.build(torch.arange(6), None, torch.tensor([[2, 3], [0, 5]]))
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed == [[[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]],
                       [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]]


def _forward(kv, model, ids, start, always):
    """One forward of `ids` [1, q] at positions start.. on a one-row BlockKV; its logits."""
    q = ids.shape[1]
    valid = torch.ones(1, q, dtype=torch.bool)
    pos = torch.arange(start, start + q)[None]
    with torch.inference_mode():
        mask = kv.attention_mask(valid, [q], pos, always=always)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=kv.cache,
                       use_cache=True).logits
    kv.appended(valid, [q])
    return logits, mask


def test_one_row_in_consecutive_blocks_reads_its_entries_in_place():
    model = llama(320, 0).eval()
    prompt = torch.randint(3, 300, (1, 2 * BLOCK_SIZE + 5))
    steps = [torch.tensor([[7]]), torch.tensor([[9, 11, 13]]), torch.tensor([[17]])]
    runs = {}
    for always in (True, False):   # True: gather + mask, as before; False: the in-place span
        stores = BlockStores("cpu")
        kv = stores.empty(model, 1, "cpu")
        logits, mask = _forward(kv, model, prompt, 0, always)
        out, start = [logits[0, -1]], prompt.shape[1]
        for ids in steps:
            logits, mask = _forward(kv, model, ids, start, always)
            out.append(logits[0])
            start += ids.shape[1]
            assert (stores.store(model).forward.span is None) == always and (mask is None) != always
        kv.drop_tail([2])   # a rollback, then one more token over the dropped entries
        logits, _ = _forward(kv, model, torch.tensor([[19]]), start - 2, always)
        runs[always] = out + [logits[0]]
    for gathered, in_place in zip(runs[True], runs[False]):
        torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)


def test_one_row_in_scattered_blocks_falls_back_to_the_gather():
    model = llama(320, 0).eval()
    stores = BlockStores("cpu")
    kv, other = stores.empty(model, 1, "cpu"), stores.empty(model, 1, "cpu")
    prompt = torch.randint(3, 300, (1, BLOCK_SIZE))
    _forward(kv, model, prompt, 0, always=False)
    _forward(other, model, prompt, 0, always=False)   # takes the block after kv's
    logits, mask = _forward(kv, model, torch.tensor([[5, 6]]), BLOCK_SIZE, always=False)
    assert kv.tables[0].span(1) is None, kv.tables[0].blocks
    assert stores.store(model).forward.span is None and mask is not None
    reference = llama(320, 0).eval()
    with torch.inference_mode():
        expected = reference(input_ids=torch.cat([prompt, torch.tensor([[5, 6]])], 1)).logits[0, -2:]
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def test_rows_get_consecutive_blocks_where_the_store_has_room():
    """A row grows into the block right after its last when that is free, and a new row takes
    the lowest free blocks in order, so after rows come and go a row alone still reads its
    entries in place (its span), as a sequence in a fresh store does."""
    model = llama(320, 0).eval()
    stores = BlockStores("cpu")
    store = stores.store(model)
    first, second = stores.empty(model, 1, "cpu").tables[0], stores.empty(model, 1, "cpu").tables[0]
    first.reserve(store, 2 * BLOCK_SIZE)      # blocks 1, 2
    second.reserve(store, BLOCK_SIZE)         # block 3
    first.release()                           # 1 and 2 free again, below the second row's
    second.reserve(store, 3 * BLOCK_SIZE)     # grows into 4 and 5, not into 1 and 2
    assert second.blocks == [3, 4, 5] and second.span(1) is not None
    third = stores.empty(model, 1, "cpu").tables[0]
    third.reserve(store, 2 * BLOCK_SIZE)      # the lowest free, in order (1, 2), not 2, 1
    assert third.blocks == [1, 2] and third.span(1) is not None
    third.reserve(store, 3 * BLOCK_SIZE)      # 3 is taken: the lowest free instead
    assert third.blocks == [1, 2, 6] and third.span(1) is None


def test_rows_go_in_few_buckets_each_at_least_the_rows_and_built_by_the_warm_up():
    """Static shapes (CUDA graphs) capture a graph per row bucket, not per row count: 11
    buckets for 64 rows (1, 2, 4, 8, 16, ..., 64) where there were 64 captures per shape."""
    assert row_buckets(64) == [1, 2, 4] + list(range(8, 65, 8))
    assert len(row_buckets(256)) == 35 and row_buckets(6) == [1, 2, 4, 8]
    for rows in range(1, 300):
        assert rows <= row_bucket(rows) <= max(rows + 7, 4) and row_bucket(rows) in row_buckets(rows)
