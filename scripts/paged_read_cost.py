"""What reading the KV in place would cost against today's gather, one attention call: B rows
of a block store (their blocks interleaved, as rows that grow together get them), each row's
queries over its own entries. Today (kv/blocks.py): each row's slots gathered into
[B, H, W, D] (`index_select` + a contiguous copy), then SDPA with a boolean mask. In place: a
compiled FlexAttention over the store's whole buffer, the rows' block tables as its BlockMask's
block indices (blocks before a row's first query "full", no mask_mod; the last ones masked by
position through a block -> logical-block table), so nothing is copied and what a call
allocates does not depend on the context. Shapes: the real pair's attention (9 query heads, 3
KV heads, head dim 64); the store's page size is a flag, since the CPU kernel's cost per page
is what decides.

    python scripts/paged_read_cost.py                         # 1 thread, pages of 16 and 64
    python scripts/paged_read_cost.py --contexts 256,4096 --queries 1,5 --batch 8

Prints the processor, then per (page, context, queries) the microseconds of each (medians of
interleaved rounds), their ratio, the largest difference of the outputs, and the bytes the
gather allocates per layer (the in-place read allocates none of its own).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from exspec.utils.machine import processor_name

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


class Case:
    def __init__(self, batch: int, context: int, queries: int, page: int, max_context: int):
        self.page, self.batch = page, batch
        self.num_pages = batch * max_context // page + 1        # page 0: scratch
        slots = self.num_pages * page
        self.keys = torch.randn(slots, KV_HEADS, HEAD_DIM)
        self.values = torch.randn(slots, KV_HEADS, HEAD_DIM)
        pages = -(-context // page)
        self.table = torch.tensor([[1 + r + batch * j for j in range(pages)] for r in range(batch)])
        self.positions = context - queries + torch.arange(queries).expand(batch, -1)   # [B, q]
        self.query = torch.randn(batch, HEADS, queries, HEAD_DIM)
        self.flex = torch.compile(flex_attention, dynamic=False)

    def gathered(self) -> torch.Tensor:
        """Today's read: gather, then SDPA with a boolean mask."""
        slots = (self.table[:, :, None] * self.page + torch.arange(self.page)).reshape(self.batch, -1)
        keys, values = (buf.index_select(0, slots.reshape(-1)).view(self.batch, -1, KV_HEADS, HEAD_DIM)
                        .transpose(1, 2).contiguous() for buf in (self.keys, self.values))
        mask = torch.arange(slots.shape[1])[None, None, :] <= self.positions[:, :, None]
        return torch.nn.functional.scaled_dot_product_attention(
            self.query, keys, values, attn_mask=mask[:, None], enable_gqa=True)

    def block_mask(self) -> BlockMask:
        """The rows' pages as flex block indices: full ones, then the masked last ones."""
        page, batch, count = self.page, self.batch, self.num_pages
        logical = torch.full((batch, count), -1, dtype=torch.long)
        logical.scatter_(1, self.table, torch.arange(self.table.shape[1]).expand(batch, -1))
        positions = self.positions

        def mask_mod(b, h, q, kv):
            at = logical[b, kv // page]
            return (at >= 0) & (at * page + kv % page <= positions[b, q])

        table = torch.zeros(batch, count, dtype=torch.long)
        table[:, :self.table.shape[1]] = self.table
        full = (positions[:, 0] + 1) // page
        every = (positions[:, -1] + page) // page
        columns = torch.arange(count)
        full_pages = torch.where(columns < full[:, None], table, 0)
        partial = table.gather(1, (columns + full[:, None]).clamp_max(count - 1))
        partial = torch.where(columns < (every - full)[:, None], partial, 0)
        as_blocks = lambda t: t.to(torch.int32)[:, None, None]   # noqa: E731  [B, 1, 1, ...]
        return BlockMask.from_kv_blocks(
            as_blocks(every - full), as_blocks(partial), as_blocks(full), as_blocks(full_pages),
            BLOCK_SIZE=(128, page), mask_mod=mask_mod,
            seq_lengths=(self.query.shape[2], count * page), compute_q_blocks=False)

    def in_place(self) -> torch.Tensor:
        keys = self.keys.transpose(0, 1)[None].expand(self.batch, -1, -1, -1)   # views, no copy
        values = self.values.transpose(0, 1)[None].expand(self.batch, -1, -1, -1)
        return self.flex(self.query, keys, values, block_mask=self.block_mask(), enable_gqa=True)

    def gather_bytes(self) -> int:
        return 2 * self.batch * self.table.shape[1] * self.page * KV_HEADS * HEAD_DIM * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", default="16,64")
    parser.add_argument("--contexts", default="256,4096")
    parser.add_argument("--queries", default="1,5")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"{processor_name()}, {args.threads} torch thread(s), batch {args.batch}")
    print("page | context | queries | gather+SDPA us | in place us | in place / gather | max diff | gather bytes/layer")
    for page in (int(p) for p in args.pages.split(",")):
        for context in contexts:
            for queries in (int(q) for q in args.queries.split(",")):
                case = Case(args.batch, context, queries, page, max(contexts))
                diff = (case.in_place() - case.gathered()).abs().max().item()   # compiles
                times = {case.gathered: [], case.in_place: []}
                for _ in range(args.rounds):
                    for run, taken in times.items():
                        start = time.perf_counter()
                        for _ in range(5):
                            run()
                        taken.append((time.perf_counter() - start) / 5 * 1e6)
                old, new = (statistics.median(t) for t in times.values())
                print(f"{page} | {context} | {queries} | {old:.0f} | {new:.0f} | {new / old:.2f} | "
                      f"{diff:.1e} | {case.gather_bytes():,}", flush=True)


if __name__ == "__main__":
    main()
