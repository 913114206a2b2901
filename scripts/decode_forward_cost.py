"""One decode forward of a deep, narrow Llama on EXSPEC's block store, eager against compiled:
the cost exspec-bench's per-forward table measures, without building a pair and an engine
(one graph to compile instead of a whole warm-up). Interleaved, median of --repeats.

    python scripts/decode_forward_cost.py --layers 36 --hidden 64 --batch 1 --backend inductor
    python scripts/decode_forward_cost.py --layers 36 --hidden 64 --batch 1 --whole-model
(regional compilation by default: one compiled decoder layer; --whole-model: the whole model)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exspec.models import compiled
from exspec.demo.tiny import llama
from exspec.kv.blocks import BlockStores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64, help="cached tokens per row")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--whole-model", action="store_true", help="compile the whole model, not its layers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = llama(320, 0, layers=args.layers, hidden=args.hidden, max_positions=1024).eval()
    b, n = args.batch, args.context
    kv = BlockStores("cpu").empty(model, b, "cpu")

    def forward(fn, ids, pos):
        valid = torch.ones_like(ids, dtype=torch.bool)
        counts = [ids.shape[1]] * b
        fn(input_ids=ids, attention_mask=kv.attention_mask(valid, counts, pos), position_ids=pos,
           cache=kv.cache, use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        forward(model, torch.ones(b, n, dtype=torch.long), torch.arange(n).expand(b, n))   # prefill
        kv.appended(None, [n] * b)
        ids, pos = torch.ones(b, 1, dtype=torch.long), torch.full((b, 1), n)
        compiled.COMPILE_BACKEND = args.backend
        if args.whole_model:
            compiled.decoder_layers = lambda model: None
        paths = {"eager": model, f"compiled ({args.backend})": compiled.CompiledForward(model)}
        start = time.perf_counter()
        forward(paths[f"compiled ({args.backend})"], ids, pos)
        print(f"compile: {time.perf_counter() - start:.1f} s")
        seconds = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():   # the write at position n is the same every time
                start = time.perf_counter()
                forward(fn, ids, pos)
                seconds[name].append(time.perf_counter() - start)
    print(f"{args.layers} layers, hidden {args.hidden}, B={b}, {n} cached, torch threads "
          f"{torch.get_num_threads()}: " + ", ".join(
              f"{name} {1000 * statistics.median(s):.2f} ms" for name, s in seconds.items()))


if __name__ == "__main__":
    main()
