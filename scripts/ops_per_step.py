"""How much of a decode step is still dispatched op by op from Python: aten ops per engine step,
eager against compiled, counted by torch.profiler. An op counts when no aten op and no compiled
region encloses it (what Python itself dispatched: the model's eager parts, the KV layout's
indexing, sampling and acceptance); `inside compiled regions` counts the aten calls the compiled
code makes itself (inductor's extern kernels: matrix products, mostly). Each cell: one engine
over the real pair (`make real-pair`), its target alone (k = 0) or with the EAGLE-3 head at k = 4
(fixed, EXSPEC), batch 1 and 8, a few steps profiled after the prompt's prefill and one untimed step.

    python scripts/ops_per_step.py               # real pair, 4 steps a cell
"""
from __future__ import annotations

import argparse
from collections import Counter

COMPILED = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")


def count_ops(events) -> tuple[Counter, int]:
    """(aten ops Python dispatched, by name; aten calls made inside compiled regions)."""
    python, inside = Counter(), 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent, compiled, nested = event.cpu_parent, False, False
        while parent is not None:
            nested |= parent.name.startswith("aten::")
            compiled |= parent.name.startswith(COMPILED)
            parent = parent.cpu_parent
        if compiled:
            inside += not nested
        elif not nested:
            python[event.name] += 1
    return python, inside


def cell(path: str, eager: bool, head: str | None, batch: int, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from exspec import EngineConfig, LLMEngine, SamplingParams
    speculative = dict(method="exspec", proposer="eagle3", draft_model=head,
                       num_speculative_tokens=4) if head else dict(method="autoregressive")
    engine = LLMEngine(EngineConfig(target_model=path + "/target", max_batch_size=batch,
                                    adaptive_k=False, enforce_eager=eager, **speculative))
    prompts = [f"Question {i}: name three rivers of Europe and say where each one ends." for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=steps * 6 + 20, ignore_eos=True))
    for _ in range(3):   # prefill, then untimed steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    python, inside = count_ops(prof.events())
    return {"python": sum(python.values()) / steps, "inside": inside / steps,
            "top": [(name, round(n / steps)) for name, n in python.most_common(6)],
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    import torch
    from exspec.models.real_pair import PAIR_DIR
    torch.set_num_threads(1)
    path = str(PAIR_DIR)
    print("aten ops per engine step (the real pair; one torch thread):")
    print("| cell | batch | eager: from Python | compiled: from Python | compiled: inside regions |")
    print("|---|---|---|---|---|")
    for label, head in (("target alone (k = 0)", None), ("EAGLE-3 head, k = 4", path + "/eagle3")):
        for batch in (1, 8):
            eager = cell(path, True, head, batch, args.steps)
            comp = cell(path, False, head, batch, args.steps)
            print(f"| {label} | {batch} | {eager['python']:.0f} | {comp['python']:.0f} | "
                  f"{comp['inside']:.0f} |", flush=True)
            print(f"  compiled, most dispatched from Python per step: {comp['top']}", flush=True)


if __name__ == "__main__":
    main()
