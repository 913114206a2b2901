"""Property-based checks of the cache surgery (kv.PaddedKV) on synthetic caches whose entries
record the position of the token they belong to: after any sequence of appends (ragged or not),
tail drops (rejected drafts), row selections and realignments, every row holds exactly its
tokens' entries, in order, at their positions (I1, I3); after a realignment the rows are
right-aligned with minimal left padding, so a 2D mask describes them (I2)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from exspec.kv.padded import PaddedKV


def make_kv(batch):
    cache = DynamicCache(ddp_cache_data=[(torch.zeros(batch, 2, 0, 3), torch.zeros(batch, 2, 0, 3))])
    return PaddedKV(cache, torch.zeros(batch, 0, dtype=torch.bool), [0] * batch)


def append(kv, rows, counts):
    """Append counts[i] new tokens to row i (left-padded input, like the runner)."""
    width = max(counts)
    if width == 0:
        return 0
    keys = torch.full((len(rows), 2, width, 3), -1.0)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, n in enumerate(counts):
        for j in range(n):
            keys[i, :, width - n + j, :] = len(rows[i]) + j
        rows[i].extend(range(len(rows[i]), len(rows[i]) + n))
        valid[i, width - n:] = True
    kv.cache.layers[0].update(keys, keys + 0.5)
    kv.appended(valid, counts)
    return width


def check(kv, rows, aligned):
    layer = kv.cache.layers[0]
    assert layer.keys.shape[2] == kv.valid.shape[1]
    assert kv.lengths == [len(r) for r in rows], "the host lengths drifted from the cache"
    for i, row in enumerate(rows):
        got = layer.keys[i, 0, kv.valid[i], 0].tolist()
        assert got == row, f"row {i}: entries {got} != positions {row}"
        assert layer.values[i, 1, kv.valid[i], 2].tolist() == [p + 0.5 for p in row]
    if aligned:
        width = max((len(r) for r in rows), default=0)
        assert kv.width == width, "left padding is not minimal"
        for i, row in enumerate(rows):
            expected = [False] * (width - len(row)) + [True] * len(row)
            assert kv.valid[i].tolist() == expected, f"row {i} is not right-aligned"


ops = st.lists(st.tuples(st.sampled_from(["append", "drop", "compact", "select"]),
                         st.lists(st.integers(0, 4), min_size=6, max_size=6)),
               min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), ops)
def test_surgery_keeps_every_row_exact(batch, program):
    kv, rows = make_kv(batch), [[] for _ in range(batch)]
    append(kv, rows, [1 + c for c in [3, 1, 4, 1, 5, 9][:batch]])  # a ragged prefill
    last = [0] * batch
    for op, args in program:
        args = args[:len(rows)]
        if op == "append":
            last = list(args)
            append(kv, rows, last)
        elif op == "drop":   # rejected drafts: at most what the last append added
            cut = [min(a, n, len(r)) for a, n, r in zip(args, last, rows)]
            kv.drop_tail(cut)
            for r, c in zip(rows, cut):
                del r[len(r) - c:]
            last = [0] * len(rows)
        elif op == "compact":
            kv.compact()
            check(kv, rows, aligned=True)
            continue
        elif op == "select" and len(rows) > 1:
            keep = sorted(set(a % len(rows) for a in args))
            kv.select(keep)
            rows = [rows[i] for i in keep]
            last = [last[i] for i in keep]
        check(kv, rows, aligned=False)
    kv.compact()
    check(kv, rows, aligned=True)


def test_uniform_crop_moves_nothing():
    kv, rows = make_kv(3), [[], [], []]
    append(kv, rows, [4, 2, 3])
    kv.compact()
    before = kv.cache.layers[0].keys.data_ptr()
    append(kv, rows, [3, 3, 3])
    kv.drop_tail([2, 2, 2])
    for r in rows:
        del r[-2:]
    assert kv.compact() == 0, "equal acceptance must not copy"
    check(kv, rows, aligned=True)
    assert kv.aligned


def test_ragged_acceptance_realigns_with_one_gather():
    kv, rows = make_kv(3), [[], [], []]
    append(kv, rows, [5, 5, 5])
    append(kv, rows, [4, 4, 4])
    kv.drop_tail([3, 0, 1])
    for r, c in zip(rows, [3, 0, 1]):
        del r[len(r) - c:]
    moved = kv.compact()
    layer = kv.cache.layers[0]
    assert moved == layer.keys.nbytes + layer.values.nbytes
    check(kv, rows, aligned=True)


def test_concat_pads_narrower_groups():
    a, rows_a = make_kv(2), [[], []]
    append(a, rows_a, [3, 5])
    b, rows_b = make_kv(1), [[]]
    append(b, rows_b, [2])

    class Model:  # PaddedKV.concat only needs a config (new cache, masks) and a dtype (masks)
        from transformers import LlamaConfig
        config = LlamaConfig(num_hidden_layers=1)
        dtype = torch.float32

    merged, moved = PaddedKV.concat([a, b], Model)
    assert moved > 0
    check(merged, rows_a + rows_b, aligned=True)


def test_layer_masks_window_by_position_not_column():
    """A row with holes (a pad column between its old and new entries, as PaddedKV holds it
    before a realignment): the sliding mask counts positions, so the hole does not widen or
    narrow the window; one mask per layer type."""
    from exspec.kv.padded import LayerMasks
    masks = LayerMasks({"full_attention": None, "sliding_attention": 2})
    valid = torch.tensor([[False, True, True, False, True, True]])   # positions -, 0, 1, -, 2, 3
    positions = valid.cumsum(1) - 1
    built = masks.build(positions, valid, positions[:, -2:])         # queries at positions 2, 3
    assert set(built) == {"full_attention", "sliding_attention"}
    seen = {kind: (mask[0, 0] == 0).tolist() for kind, mask in built.items()}
    assert seen["full_attention"] == [[False, True, True, False, True, False],
                                      [False, True, True, False, True, True]]
    assert seen["sliding_attention"] == [[False, False, True, False, True, False],
                                         [False, False, False, False, True, True]]
