"""Whether storing the decoder layers' matrices [in, out] makes a few rows cheaper on this CPU:
nn.Linear keeps a weight [out, in] and MKL reads it as a transposed operand; the same values
stored [in, out] are read as a plain one, through another sgemm path. Two measurements, each
layout in turn round after round, medians, one torch thread by default:

- the real pair's target matrices (`make real-pair`; every nn.Linear of its decoder layers, far
  more than the caches hold, so the weights come from memory as in a forward) multiplied by 1,
  2, 3, 4, 5 and 8 rows;
- the target's whole eager forward of 1, 2 and 5 tokens over a 96-token context, once with each
  layout (two copies of the model).

    python scripts/weight_layout_cost.py [--rounds 12] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

ROWS = (1, 2, 3, 4, 5, 8)
WIDTHS = (1, 2, 5)
CONTEXT = 96


def in_out(model) -> None:
    """Store every nn.Linear weight of the model's decoder layers [in, out] (same values)."""
    import torch
    with torch.no_grad():
        for module in model.model.layers.modules():
            if type(module) is torch.nn.Linear:
                module.weight.data = module.weight.data.t().contiguous().t()


def matrices(model) -> list:
    import torch
    return [m.weight for m in model.model.layers.modules() if type(m) is torch.nn.Linear]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from exspec.models.real_pair import PAIR_DIR
    from exspec.utils.machine import processor_name
    torch.set_num_threads(args.threads)
    load = lambda: AutoModelForCausalLM.from_pretrained(str(PAIR_DIR / "target"), dtype=torch.float32).eval()  # noqa: E731
    models = {"[out, in] (nn.Linear's)": load(), "[in, out]": load()}
    in_out(models["[in, out]"])
    ids = torch.randint(100, 1000, (1, CONTEXT))
    mm, fw = {}, {}
    with torch.inference_mode():
        caches = {name: m(ids, use_cache=True).past_key_values for name, m in models.items()}
        for round_ in range(args.rounds + 1):   # the first round untimed
            for rows in ROWS:
                for name, model in models.items():
                    xs = {}
                    began = time.perf_counter()
                    for w in matrices(model):
                        x = xs.setdefault(w.shape[1], torch.randn(rows, w.shape[1]))
                        torch.nn.functional.linear(x, w)
                    if round_:
                        mm.setdefault((name, rows), []).append(time.perf_counter() - began)
            for width in WIDTHS:
                for name, model in models.items():
                    cache = caches[name]
                    began = time.perf_counter()
                    model(torch.randint(100, 1000, (1, width)), past_key_values=cache, use_cache=True,
                          logits_to_keep=width)
                    took = time.perf_counter() - began
                    cache.crop(-width)   # back to the context
                    if round_:
                        fw.setdefault((name, width), []).append(took)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    print(f"{processor_name()}, {torch.get_num_threads()} torch thread(s), medians of {args.rounds} rounds")
    print(f"the target's {len(matrices(models['[in, out]']))} layer matrices, ms per pass (ratio to 1 row):")
    for name in models:
        base = ms(mm[name, 1])
        print(f"  {name:24s} " + "  ".join(f"{r} rows {ms(mm[name, r]):.1f} ({ms(mm[name, r]) / base:.2f}x)" for r in ROWS))
    print(f"the target's eager forward over {CONTEXT} cached tokens, ms (ratio to 1 token):")
    for name in models:
        base = ms(fw[name, 1])
        print(f"  {name:24s} " + "  ".join(f"{w} tok {ms(fw[name, w]):.1f} ({ms(fw[name, w]) / base:.2f}x)" for w in WIDTHS))


if __name__ == "__main__":
    main()
