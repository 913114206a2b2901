"""All KV-cache surgery lives here (design: "EQSPEC realignment", "Models"): the only
module that touches cache tensors.

Two layouts share one interface (attention_mask / appended / drop_tail / compact / select /
concat), so the runner and the pool never look inside: PaddedKV here, and EXSPEC's static,
block-allocated BlockKV in kv/blocks.py. Both mask through LayerMasks (below): one mask per
layer type, from positions.

PaddedKV (EQSPEC). A group's cache for one model is a transformers DynamicCache of [B, H, L, D] tensors plus a
`valid` [B, L] mask of the columns that hold real entries. Rows are kept right-aligned (left
padding, minimal): row i's n_i entries are its last n_i columns, so every row appends its new
tokens at the same column and a plain 2D attention mask describes the batch. Two things break the
alignment: a step in which rows accept different numbers of drafts (their tails are cut by
different amounts) and an append where rows feed different numbers of tokens (left-padded
input leaves holes). Both are fixed by `compact`: one gather per cache tensor that moves every
row's valid entries to the right edge (EQSPEC's unpad, append, repad).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer,
                                     get_layer_types_and_kwargs)

from ..errors import ModelLoadError


def cache_layer_classes(model) -> set[type]:
    """The layer classes of the cache transformers builds for this model (what new_cache
    builds); architecture.py refuses at load what new_cache would refuse at a request."""
    return {type(layer) for layer in DynamicCache(config=model.config).layers}


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    # A sliding layer keeps every entry too (its mask hides those out of the window), so that
    # every layer's columns are the same and one cut-back or gather serves them all.
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer
                    for layer in cache.layers]
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ModelLoadError(f"{type(model).__name__}: only full and sliding-window attention "
                             "layers are supported (chunked or linear-attention caches cannot "
                             "be realigned)")
    return cache


class LayerCache:
    """One layer of a cache as an attention layer sees a cache: `update(keys, values, layer_idx,
    ...)` writes to this layer whatever `layer_idx` says (the compiled path's regions,
    compiled.py: a Python int that differs per layer must not select anything in their graph).
    Anything else a layer asks (get_seq_length, ...) is the whole cache's answer: every layer of
    both layouts holds the same columns."""

    def __init__(self, cache: DynamicCache, index: int):
        self.cache = cache
        self.layer = cache.layers[index]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """[B, q, W] bool -> the [B, 1, q, W] additive mask HF attention takes (0 or dtype min:
    finite, so a query with nothing to see, a pad, gets a harmless average, not NaN)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@dataclass(frozen=True)
class LayerMasks:
    """How one model's layers mask attention: the sliding window of each layer type (None: full
    attention), keyed by the names its forward looks masks up by (transformers 5 takes a dict
    from layer type to mask), and the dtype of its additive masks."""
    windows: dict[str, int | None]
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, model) -> "LayerMasks":
        types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        windows: dict[str, int | None] = {}
        for kind, layer_kwargs in zip(types, kwargs):
            if kind not in ("full_attention", "sliding_attention"):
                raise ModelLoadError(f"{type(model).__name__}: {kind!r} layers cannot be masked "
                                     "by the KV layouts (only full and sliding-window attention)")
            window = layer_kwargs.get("sliding_window") if kind == "sliding_attention" else None
            if windows.setdefault(kind, window) != window:
                raise ModelLoadError(f"{type(model).__name__}: its {kind} layers have different "
                                     "windows, and the model takes one mask per layer type")
        return cls(windows, model.dtype)

    def build(self, key_pos: torch.Tensor, key_valid: torch.Tensor | None, query_pos: torch.Tensor):
        """The additive [B, 1, q, L] mask of each layer type, from the key positions ([L], alike
        for every row, or [B, L]), their validity [B, L] (None: every column) and the query
        positions [B, q]: a query sees the valid keys of its own row at positions up to its
        own, and in a sliding layer only the last `window` of them (query - key < window,
        transformers' rule). One tensor when there is one layer type."""
        seen = key_pos[..., None, :] <= query_pos[:, :, None]
        if key_valid is not None:
            seen &= key_valid[:, None, :]
        masks = {}
        for kind, window in self.windows.items():
            if window is None:
                allowed = seen
            else:
                allowed = seen & (query_pos[:, :, None] - key_pos[..., None, :] < window)
            masks[kind] = _additive(allowed, self.dtype)
        return masks if len(masks) > 1 else next(iter(masks.values()))


FULL_ATTENTION = LayerMasks({"full_attention": None})


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if layer.is_initialized]


def _on(index: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`index` where `tensor` lives: a target spread over GPUs (device_map) keeps each layer's
    cache on that layer's GPU, while the bookkeeping lives on the engine's device."""
    return index if index.device == tensor.device else index.to(tensor.device)


def _cuts_on_device(counts: list[int], counts_dev: torch.Tensor | None, device) -> torch.Tensor:
    """The per-row cut counts on the device: the runner's own device tensor when it has one
    (no copy), else one copy of the host list."""
    return counts_dev if counts_dev is not None else torch.tensor(counts, device=device)


def _runs(rows: list[int]) -> list[slice]:
    """`rows` as runs of consecutive row numbers, in order: [0, 1, 2, 5, 6] -> [0:3, 5:7]."""
    runs: list[slice] = []
    for row in rows:
        if runs and runs[-1].stop == row:
            runs[-1] = slice(runs[-1].start, row + 1)
        else:
            runs.append(slice(row, row + 1))
    return runs


def _take(tensor: torch.Tensor, runs: list[slice]) -> torch.Tensor:
    """The rows of `runs`, stacked, in a new tensor (one copy, no index tensor)."""
    return torch.cat([tensor[run] for run in runs])


def uses_alibi(cfg) -> bool:
    """ALiBi models (Bloom, Falcon with alibi, MPT) derive their position biases from a 2D
    padding mask's running sum, so they need one (and cannot take EXSPEC's 4D mask)."""
    attn = getattr(cfg, "attn_config", None)
    return (cfg.model_type == "bloom" or bool(getattr(cfg, "alibi", False))
            or bool(getattr(attn, "alibi", False)))


class PaddedKV:
    """One model's cache for a group of rows, right-aligned, with a validity mask."""

    free_pads = False   # a pad input is a column every row holds (a hole until realigned)

    def __init__(self, cache: DynamicCache, valid: torch.Tensor, lengths: list[int],
                 masks: LayerMasks = FULL_ATTENTION, mask_2d: bool = False):
        self.cache = cache
        self.mask_2d = mask_2d      # the model reads positions off a 2D mask (ALiBi: Bloom)
        self.valid = valid          # [B, L] bool
        self.lengths = lengths      # host: valid entries per row (never read back from `valid`)
        self.masks = masks          # each layer type's window, the masks' dtype
        self.aligned = True         # host-side: every row's entries are its last n_i columns

    @classmethod
    def empty(cls, model, batch: int, device) -> "PaddedKV":
        return cls(new_cache(model), torch.zeros(batch, 0, dtype=torch.bool, device=device),
                   [0] * batch, LayerMasks.of(model), uses_alibi(model.config))

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    # -- accounting: what admission reserves, and what is really allocated ---------------------
    @staticmethod
    def entries_for(num_tokens: int) -> int:
        """KV entries a row that grows to num_tokens holds (the budget's unit): one per token
        here (but a group's tensors are rows x its longest row: see allocated_tokens)."""
        return num_tokens

    @staticmethod
    def allocation_for(reservations: list[int], models: int) -> int:
        """KV entries (all models) that rows holding these reservations can make the layout
        allocate: a group's tensors are its rows x its longest row, and however the rows are
        grouped (EQSPEC: one batch; the ALiBi fallback: EXSPEC's groups) that is at most every
        row x the longest (design: "EXSPEC scheduling")."""
        return len(reservations) * max(reservations, default=0)

    def allocated_tokens(self) -> int:
        """KV entries the cache tensors hold room for (rows x columns), used or not."""
        return self.batch * self.width

    # -- a forward pass: the mask to pass in, then the bookkeeping after it -------------------
    def attention_mask(self, input_valid: torch.Tensor, counts: list[int],
                       positions: torch.Tensor, always: bool = False,
                       in_place: bool = False) -> torch.Tensor | dict | None:
        """None where no row has padding (the model's own masks are exact, sliding windows
        included: a column is then a position, and HF skips building one where it can); else
        one 4D mask per layer type from the rows' positions (a 2D mask would make HF read it back
        to see whether it is all ones). positions [B, q]: the inputs' positions (I1). `always`:
        a mask even where none is needed (a compiled forward would compile again for None).
        `in_place`: the block store's read in place, which this layout never has."""
        q = input_valid.shape[1]
        keys = torch.cat([self.valid, input_valid], dim=1)                     # [B, W + q]
        if self.mask_2d:
            return keys.long()
        if not always and self.aligned and min(self.lengths, default=0) == self.width and min(counts) == q:
            return None
        key_pos = keys.cumsum(1) - 1   # a valid column's position in its row (I1)
        return self.masks.build(key_pos, keys, positions)

    def appended(self, input_valid: torch.Tensor, counts: list[int]) -> None:
        """Record the q columns the forward just appended (input_valid [B, q], left-padded;
        counts[i] real tokens in row i)."""
        if min(counts) < input_valid.shape[1] and self.width > 0:
            self.aligned = False    # pad inputs sit between old and new entries: holes
        self.valid = torch.cat([self.valid, input_valid], dim=1)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def table_rows_for(self, extra: list[int]) -> None:
        """No block table here (kv.blocks.BlockKV has one)."""
        return None

    def make_contiguous(self) -> int:
        """Copy view-shaped cache tensors (left by a uniform crop or a trim) into contiguous
        ones; returns bytes copied. Only the compiled path calls it: a compiled forward guards
        on its inputs' strides and would recompile for every view. A cache of one column (after
        a one-token prompt) gets a masked column on its left: torch gives a size of 1 a graph
        of its own, which the warm-up's longer prompts never meet."""
        if self.width == 1:
            self._pad_left(1)
        moved = 0
        for layer in _layers(self.cache):
            if not (layer.keys.is_contiguous() and layer.values.is_contiguous()):
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
                moved += layer.keys.nbytes + layer.values.nbytes
        return moved

    # -- after verification -------------------------------------------------------------------
    def drop_tail(self, counts: list[int], counts_dev: torch.Tensor | None = None) -> None:
        """Forget the last counts[i] appended entries of row i (rejected drafts); `counts_dev`,
        when given, holds the same counts on the device."""
        if not counts or max(counts) == 0:
            return
        self.lengths = [n - c for n, c in zip(self.lengths, counts)]
        if self.aligned and min(counts) == max(counts):
            self._keep_columns(slice(0, self.width - counts[0]))   # a view: nothing moves
            return
        cut = _cuts_on_device(counts, counts_dev, self.valid.device)
        cols = torch.arange(self.width, device=self.valid.device)
        self.valid &= cols[None, :] < (self.width - cut)[:, None]
        self.aligned = False

    def compact(self) -> int:
        """Right-align every row with minimal left padding; returns bytes copied (0 if none)."""
        if self.aligned:
            return 0
        counts = self.valid.sum(1)
        width = max(self.lengths)
        # A stable sort of the mask puts each row's invalid columns first and its valid ones
        # last, in order: the last `width` sorted indices are the gather source of every row.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
        self.valid = torch.arange(width, device=order.device)[None, :] >= (width - counts)[:, None]
        moved = 0
        for layer in _layers(self.cache):
            idx = _on(order, layer.keys)[:, None, :, None].expand(
                -1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
            moved += layer.keys.nbytes + layer.values.nbytes
        self.aligned = True
        return moved

    # -- group algebra: drop rows, merge groups ------------------------------------------------
    def select(self, rows: list[int]) -> int:
        """Keep only `rows` (in that order); returns bytes copied. The rows are taken as slices
        (runs of consecutive rows) joined in one copy: no index has to go up to the device,
        which a row leaving would otherwise cost outside the step's one copy up."""
        runs = _runs(rows)
        self.valid = _take(self.valid, runs)
        self.lengths = [self.lengths[i] for i in rows]
        moved = 0
        for layer in _layers(self.cache):
            layer.keys = _take(layer.keys, runs)
            layer.values = _take(layer.values, runs)
            moved += layer.keys.nbytes + layer.values.nbytes
        self._trim_left()
        return moved

    @classmethod
    def concat(cls, parts: list["PaddedKV"], model) -> tuple["PaddedKV", int]:
        """Stack groups row-wise, left-padding the narrower ones; returns (merged, bytes copied)."""
        moved = sum(part.compact() for part in parts)
        width = max(p.width for p in parts)
        merged = cls(new_cache(model),
                     torch.cat([torch.nn.functional.pad(p.valid, (width - p.width, 0)) for p in parts]),
                     [n for p in parts for n in p.lengths], parts[0].masks, parts[0].mask_2d)
        for i, layer in enumerate(merged.cache.layers):
            sources = [p.cache.layers[i] for p in parts if p.cache.layers[i].is_initialized]
            if len(sources) != len(parts):
                continue
            padded = {name: [torch.nn.functional.pad(getattr(s, name), (0, 0, width - s.keys.shape[2], 0))
                             for s in sources] for name in ("keys", "values")}
            layer.lazy_initialization(padded["keys"][0], padded["values"][0])
            layer.keys = torch.cat(padded["keys"], dim=0)
            layer.values = torch.cat(padded["values"], dim=0)
            moved += layer.keys.nbytes + layer.values.nbytes
        return merged, moved

    # -- helpers -------------------------------------------------------------------------------
    def _trim_left(self) -> None:
        """Drop leading columns that no row uses (minimal left padding); a view, no copy. Only
        when aligned (from the host lengths): otherwise the realignment that follows leaves the
        minimal width anyway."""
        if self.aligned and self.width > max(self.lengths, default=0):
            self._keep_columns(slice(self.width - max(self.lengths, default=0), self.width))

    def _pad_left(self, columns: int) -> None:
        """`columns` invalid columns before every row's entries (rows stay right-aligned)."""
        self.valid = torch.nn.functional.pad(self.valid, (columns, 0))
        for layer in _layers(self.cache):
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, columns, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, columns, 0))

    def _keep_columns(self, cols: slice) -> None:
        self.valid = self.valid[:, cols]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[:, :, cols]
            layer.values = layer.values[:, :, cols]

