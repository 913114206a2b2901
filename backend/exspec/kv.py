"""All KV-cache surgery lives here (DESIGN §3.4, §3.6): the only module that touches cache tensors.

Two layouts share one interface (attention_mask / appended / drop_tail / compact / select /
concat), so the runner and the pool never look inside: PaddedKV here, and EXSPEC's static,
block-allocated BlockKV in kv_blocks.py.

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

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import ModelLoadError


def cache_layer_classes(model) -> set[type]:
    """The layer classes of the cache transformers builds for this model (what new_cache
    builds); architecture.py refuses at load what new_cache would refuse at a request."""
    return {type(layer) for layer in DynamicCache(config=model.config).layers}


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ModelLoadError(f"{type(model).__name__}: only full-attention layers are supported "
                             "(sliding-window or linear-attention caches cannot be realigned)")
    return cache


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if layer.is_initialized]


def _on(index: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`index` where `tensor` lives: a target spread over GPUs (device_map) keeps each layer's
    cache on that layer's GPU, while the bookkeeping lives on the engine's device."""
    return index if index.device == tensor.device else index.to(tensor.device)


class PaddedKV:
    """One model's cache for a group of rows, right-aligned, with a validity mask."""

    def __init__(self, cache: DynamicCache, valid: torch.Tensor):
        self.cache = cache
        self.valid = valid          # [B, L] bool
        self.aligned = True         # host-side: every row's entries are its last n_i columns

    @classmethod
    def empty(cls, model, batch: int, device) -> "PaddedKV":
        return cls(new_cache(model), torch.zeros(batch, 0, dtype=torch.bool, device=device))

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

    def allocated_tokens(self) -> int:
        """KV entries the cache tensors hold room for (rows x columns), used or not."""
        return self.batch * self.width

    # -- a forward pass: the mask to pass in, then the bookkeeping after it -------------------
    def attention_mask(self, input_valid: torch.Tensor, counts: list[int],
                       positions: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.valid, input_valid], dim=1).long()

    def appended(self, input_valid: torch.Tensor, counts: list[int]) -> None:
        """Record the q columns the forward just appended (input_valid [B, q], left-padded;
        counts[i] real tokens in row i)."""
        if min(counts) < input_valid.shape[1] and self.width > 0:
            self.aligned = False    # pad inputs sit between old and new entries: holes
        self.valid = torch.cat([self.valid, input_valid], dim=1)

    def make_contiguous(self) -> int:
        """Copy view-shaped cache tensors (left by a uniform crop or a trim) into contiguous
        ones; returns bytes copied. Only the compiled path calls it: a compiled forward guards
        on its inputs' strides and would recompile for every view."""
        moved = 0
        for layer in _layers(self.cache):
            if not (layer.keys.is_contiguous() and layer.values.is_contiguous()):
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
                moved += layer.keys.nbytes + layer.values.nbytes
        return moved

    # -- after verification -------------------------------------------------------------------
    def drop_tail(self, counts: list[int]) -> None:
        """Forget the last counts[i] appended entries of row i (rejected drafts)."""
        if not counts or max(counts) == 0:
            return
        if self.aligned and min(counts) == max(counts):
            self._keep_columns(slice(0, self.width - counts[0]))   # a view: nothing moves
            return
        cut = torch.tensor(counts, device=self.valid.device)
        cols = torch.arange(self.width, device=self.valid.device)
        self.valid &= cols[None, :] < (self.width - cut)[:, None]
        self.aligned = False

    def compact(self) -> int:
        """Right-align every row with minimal left padding; returns bytes copied (0 if none)."""
        if self.aligned:
            return 0
        counts = self.valid.sum(1)
        width = int(counts.max())
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
        """Keep only `rows` (in that order); returns bytes copied."""
        index = torch.tensor(rows, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        moved = 0
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, _on(index, layer.keys))
            layer.values = layer.values.index_select(0, _on(index, layer.values))
            moved += layer.keys.nbytes + layer.values.nbytes
        self._trim_left()
        return moved

    @classmethod
    def concat(cls, parts: list["PaddedKV"], model) -> tuple["PaddedKV", int]:
        """Stack groups row-wise, left-padding the narrower ones; returns (merged, bytes copied)."""
        moved = sum(part.compact() for part in parts)
        width = max(p.width for p in parts)
        merged = cls.empty(model, sum(p.batch for p in parts), parts[0].valid.device)
        merged.valid = torch.cat([torch.nn.functional.pad(p.valid, (width - p.width, 0))
                                  for p in parts], dim=0)
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
        """Drop leading columns that no row uses (minimal left padding); a view, no copy."""
        if self.width == 0:
            return
        used = int(self.valid.any(0).to(torch.int8).argmax()) if self.valid.any() else self.width
        if used > 0:
            self._keep_columns(slice(used, self.width))

    def _keep_columns(self, cols: slice) -> None:
        self.valid = self.valid[:, cols]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[:, :, cols]
            layer.values = layer.values[:, :, cols]
