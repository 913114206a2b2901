"""EXSPEC's block store (kv_blocks.py) on its own: allocation units, blocks returned when rows
leave, merges and leaving rows that copy no KV, growth that keeps every entry, and the mask."""
import torch

from exspec.demo.tiny import llama
from exspec.kv_blocks import BLOCK_SIZE, BlockStores, block_mask


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
    free = store.num_free_blocks
    assert store.units_for(1) == 1 and store.units_for(BLOCK_SIZE) == 1 and store.units_for(BLOCK_SIZE + 1) == 2
    kv = stores.empty(model, 3, "cpu")
    prefill(kv, model, [5, BLOCK_SIZE + 3, 2 * BLOCK_SIZE])
    assert kv.used_tokens() == 5 + BLOCK_SIZE + 3 + 2 * BLOCK_SIZE
    assert kv.allocated_tokens() == (1 + 2 + 2) * BLOCK_SIZE
    assert store.num_free_blocks == free - 5
    assert kv.select([2, 0]) == 0 and kv.lengths == [2 * BLOCK_SIZE, 5]
    assert store.num_free_blocks == free - 3, "the dropped row's blocks did not come back"
    del kv   # a group dropped whole (a failure, say): its rows' blocks come back too
    assert store.num_free_blocks == free


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
    mask = block_mask(torch.arange(6), torch.tensor([[2, 3], [0, 5]]), torch.float32)
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed == [[[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]],
                       [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]]
