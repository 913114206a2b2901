"""Attention that reads the block store's KV in place (`attention_backend` "FLEX_ATTENTION";
design: "Storage").

The default read (kv/blocks.py) gathers each row's blocks into a dense [B, H, W, D] per layer
per forward: a copy that grows with the context (50 MB a layer at B = 8 and 4,096 tokens of
the real pair). Here a compiled decode forward attends over the store's whole buffer instead
([1, H, slots, D], a view, expanded over the rows without a copy) with FlexAttention, whose
BlockMask lists each row's own blocks: what a forward allocates then does not depend on how
long its rows are.

The BlockMask of a forward (`block_masks`, built once per forward outside the compiled regions,
shared by every layer of the store, from maps of the block table made once per table,
`table_maps`): per row, the blocks wholly before its first real query
go in as "full" blocks (the kernel reads them without the mask function); the blocks from
there to its last query's go in as partial ones, masked by `mask_mod`, which alone is exact
(an eager FlexAttention evaluates it over every slot and ignores the lists): a slot is seen
when it belongs to the row (`logical`, [B, store blocks]: its block's index in the row's
table, -1 elsewhere and always for the scratch block) at a position up to the query's, and in
a sliding-window layer within its window (those get no full blocks).

Only a compiled forward gets a BlockMask: the attention function registered here hands any
other mask (prefill, eager forwards) to transformers' SDPA, so one model serves both reads.
Inductor's CPU FlexAttention template builds only with the query width static (torch 2.13:
its C++ fails to compile with a symbolic width or store size), so the compiled regions run a
graph per query width (compiled.py) and the store does not grow (a KV budget).
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "exspec_flex"          # the attention implementation models are switched to
Q_BLOCK = 128                 # FlexAttention's query block: a decode forward's queries fit one


def attention(module, query, key, value, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, **kwargs):
    """A transformers attention function: FlexAttention over the whole store for a BlockMask
    (key and value [1, H, slots, D]), transformers' SDPA for anything else."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows = query.shape[0]
    out = flex_attention(query, key.expand(rows, -1, -1, -1), value.expand(rows, -1, -1, -1),
                         block_mask=attention_mask, scale=scaling,
                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)   # the masks transformers builds itself: SDPA's


def unsupported(model) -> str | None:
    """Why `model`'s attention cannot read in place (a score modification FlexAttention would
    need a score_mod for), or None."""
    text = model.config.get_text_config(decoder=True)
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(text, key, None):
            return f"its attention logits are soft-capped ({key})"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "its attention has sink logits"
    if getattr(text, "attention_dropout", 0.0):
        return "its attention has dropout"
    return None


def use_in_place(model) -> None:
    """Switch `model`'s attention to `attention` (the same outputs for every mask but a
    BlockMask, which only the in-place read builds)."""
    model.set_attn_implementation(NAME)


def table_maps(table: torch.Tensor, num_blocks: int, scratch: int,
               mask_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `block_masks` reads of a block table (`table` [B, nb] the rows' block ids, padded
    with `scratch`, in a store of `num_blocks`), made once per table: a table serves every
    forward of its model until a row takes a new block (the draft's k forwards, say).
    `logical` [max(B, mask_rows), num_blocks]: each store block's index in the row's table, -1
    where it is not the row's (the rows past B: none). Its rows are `mask_rows`, a size of its
    own that stays one number while B varies, since inductor's CPU template misnames a symbolic
    size of what a mask function indexes (torch 2.13: "cur_kvSplitSize9 was not declared").
    `padded` [B, num_blocks]: the table padded to the store's blocks (the kernels' block lists)."""
    rows, width = table.shape
    device = table.device
    logical = torch.full((max(rows, mask_rows), num_blocks), -1, dtype=torch.long, device=device)
    logical[:rows].scatter_(1, table, torch.arange(width, device=device).expand(rows, -1))
    logical[:, scratch] = -1   # padding, and pads' entries: never seen
    return logical, torch.nn.functional.pad(table, (0, num_blocks - width))


def block_masks(maps: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                valid: torch.Tensor, block_size: int, windows: dict[str, int | None]):
    """The BlockMask of each layer type for a forward over a store: `maps` its block table's
    (`table_maps`), `positions` / `valid` [B, q] the queries'. One BlockMask when there is one
    layer type (as LayerMasks.build)."""
    logical, padded = maps
    rows, num_blocks = padded.shape
    device = padded.device
    query_positions = torch.nn.functional.pad(positions, (0, 0, 0, logical.shape[0] - rows))
    columns = torch.arange(num_blocks, device=device)
    first = torch.where(valid, positions, positions.new_tensor(1 << 62)).amin(1)   # first real query
    every = positions.amax(1) // block_size + 1   # blocks up to the last query's
    masks = {}
    for kind, window in windows.items():
        if window is None:   # blocks wholly before the first real query: seen whole by every one
            full, start = torch.minimum((first + 1) // block_size, every), None
        else:                # no full blocks; the partial ones from the first in any window
            full = torch.zeros_like(every)
            start = ((first - window + 1).clamp_min(0) // block_size).clamp_max(every - 1)
        skip = full if start is None else start
        partial = padded.gather(1, (columns + skip[:, None]).clamp_max(num_blocks - 1))
        partial = torch.where(columns < (every - skip)[:, None], partial, 0)
        full_ids = torch.where(columns < full[:, None], padded, 0)

        def mask_mod(b, h, q, kv, window=window):
            at = logical[b, kv // block_size]
            key = at * block_size + kv % block_size
            seen = (at >= 0) & (key <= query_positions[b, q])
            return seen if window is None else seen & (query_positions[b, q] - key < window)

        as_blocks = lambda t: t.to(torch.int32)[:, None, None]   # noqa: E731  [B, 1, 1, ...]
        masks[kind] = BlockMask.from_kv_blocks(
            as_blocks(every - skip), as_blocks(partial), as_blocks(full), as_blocks(full_ids),
            BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
            seq_lengths=(positions.shape[1], num_blocks * block_size), compute_q_blocks=False)
    return masks if len(masks) > 1 else next(iter(masks.values()))
