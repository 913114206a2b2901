"""What a verification costs against one token on this machine: the real pair's target
(SmolLM2-135M-Instruct, `make real-pair`) at batch 1 over a 96-token context, forwards of 1, 2, 3,
4 and 5 tokens through the engine's own runner, on the eager path, the compiled path (the
lm_head and the layers' linears packed for small batches where that is faster), the compiled
path without the packed linears (`--no-unpacked` leaves it out) and with the plain lm_head
(`--no-packed-head`). Every cell is an
engine of its own on one store layout (EXSPEC's block store, n-gram proposer: no draft to load);
the widths and cells are timed in turn, round after round, and each figure is a median.

    python scripts/verification_cost.py                 # 1 torch thread, 15 rounds
    python scripts/verification_cost.py --threads 2 --rounds 30

Prints the processor (lscpu's name), then per cell the milliseconds per width and each width's
ratio to one token. A compiled cell warms up first (a cold compile cache: a minute or two).
"""
from __future__ import annotations

import argparse
import functools
import statistics

CONTEXT = 96
WIDTHS = (1, 2, 3, 4, 5)


def build_cell(path: str, compiled_path: bool, packed: bool = True, linears: bool = True, threads: int = 1):
    """One cell's engine, warm, and its target forward (width -> seconds; demo/check_cost.py).
    `packed`: the lm_head packed for small batches; `linears`: the layers' linears through
    packed copies where the warm-up timed them faster (both the compiled path's default on a CPU);
    `threads`: torch's (the engine sets them: torch_threads)."""
    from exspec import EngineConfig, LLMEngine
    from exspec.demo.check_cost import engine_forward
    from exspec.models import packed_head, packed_linears
    real, bar = packed_head.packable, packed_linears.PACK_FROM_ELEMENTS
    if not packed:   # this cell's head stays plain: nothing to pack
        packed_head.packable = lambda model: False
    if not linears:   # no linear is big enough
        packed_linears.PACK_FROM_ELEMENTS = 1 << 62
    try:
        engine = LLMEngine(EngineConfig(target_model=path, method="exspec", proposer="ngram",
                                        num_speculative_tokens=max(WIDTHS) - 1, max_batch_size=1,
                                        adaptive_k=False, enforce_eager=not compiled_path,
                                        torch_threads=threads))
    finally:
        packed_head.packable, packed_linears.PACK_FROM_ELEMENTS = real, bar
    return engine_forward(engine, CONTEXT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-packed-head", action="store_true", help="leave out the compiled path "
                    "with the plain head")
    ap.add_argument("--no-unpacked", action="store_true", help="leave out the compiled path "
                    "without the packed linears")
    args = ap.parse_args()
    import torch
    from exspec.models.real_pair import PAIR_DIR
    from exspec.utils.machine import processor_name
    target = str(PAIR_DIR / "target")
    build = functools.partial(build_cell, threads=args.threads)
    cells = {"eager": build(target, False, packed=False),
             "compiled": build(target, True)}
    if not args.no_unpacked:
        cells["compiled, linears unpacked"] = build(target, True, linears=False)
    if not args.no_packed_head:
        cells["compiled, plain head"] = build(target, True, packed=False)
    seconds = {(cell, w): [] for cell in cells for w in WIDTHS}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):   # the first round untimed
            for width in WIDTHS:
                for cell, forward in cells.items():
                    took = forward(width)
                    if round_:
                        seconds[cell, width].append(took)
    print(f"{processor_name()}, {torch.get_num_threads()} torch thread(s), the real pair's target "
          f"at batch 1 over {CONTEXT} cached tokens, medians of {args.rounds} rounds:")
    for cell in cells:
        ms = {w: 1e3 * statistics.median(seconds[cell, w]) for w in WIDTHS}
        print(f"  {cell:26s} " + "  ".join(f"{w} tok {ms[w]:.1f} ms ({ms[w] / ms[1]:.2f}x)" for w in WIDTHS))


if __name__ == "__main__":
    main()
