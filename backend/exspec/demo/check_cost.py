"""CheckCost: what verifying 2 .. k + 1 tokens costs against decoding one, measured on this machine.

A speculative step verifies its proposals and the bonus token in one target forward of w tokens;
it pays where it commits more tokens than that forward costs in one-token forwards. The ratios
are the processor's, not the model's: the real pair's target at batch 1 checked 5 tokens for
about 1.6x one token on one 2-core Intel Xeon, while one AMD EPYC took 1.6x for 2 tokens already
and 2x for 3 (MKL's small-matrix path there runs each extra row below 4 as another
matrix-vector pass: docs/results-by-machine.md). Adaptive k picks per step the width that
commits the most tokens per second from the engine's own measurements; these ratios say, before
any case runs, what it will find.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..params import SamplingParams

# where even the cheapest check costs more than this many tokens, proposals that keep a token
# or two a step (a head on open questions) do not pay: adaptive k decodes mostly plainly
DEAR = 1.4


@dataclass(frozen=True)
class CheckCost:
    seconds: dict[int, float]   # width -> the target's forward at that many tokens, batch 1, median
    samples: int                # forwards of each width timed

    def ratio(self, width: int) -> float:
        return self.seconds[width] / self.seconds[1]

    @property
    def widths(self) -> list[int]:
        return sorted(w for w in self.seconds if w > 1)

    def line(self) -> str:
        """One line: the ratios and what they mean for speculation here."""
        ratios = "/".join(f"{self.ratio(w):.2f}" for w in self.widths)
        cheapest = min(self.widths, key=self.ratio)
        if self.ratio(cheapest) > DEAR:
            then = ("every check here costs much more than a token, so adaptive k decodes mostly "
                    "plainly where proposals keep few tokens (a head on open questions), and "
                    "speculation pays where text repeats (suffix decoding on repeated asks)")
        else:
            then = (f"a {cheapest}-token check is cheap here, so even proposals that keep a token "
                    "or so a step pay, and where text repeats (repeated asks) long ones pay more")
        return (f"here checking {'/'.join(map(str, self.widths))} tokens costs {ratios}x one token "
                f"(the target's forward at batch 1, {self.seconds[1] * 1e3:.0f} ms for one; "
                f"medians of {self.samples}): a step pays once it commits more tokens than its "
                f"check costs; {then}")


def engine_forward(engine, cache_len: int = 96, seed: int = 0):
    """A function width -> seconds: one forward of the engine's target at batch 1 through its own
    runner (so on the path the engine serves: eager or compiled, its KV layout), over a context
    of `cache_len` tokens (a chat prompt's length), each forward's new entries dropped again."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.target.get_output_embeddings().weight.shape[0]
    runner = engine.runner
    context = torch.randint(1, vocab, (cache_len,), generator=gen).tolist()
    group = runner.new_group([engine._sequence("check-cost", context, SamplingParams(max_tokens=1))])
    runner.prefill(group, [cache_len])
    kv, device = group.target_kv, runner.device

    def forward(width: int) -> float:
        ids = torch.randint(1, vocab, (1, width), generator=gen).to(device)
        pos = torch.arange(cache_len, cache_len + width, device=device)[None]
        valid = torch.ones_like(ids, dtype=torch.bool)
        start = time.perf_counter()
        runner.forward(engine.target, kv, ids, pos, valid, [width], keep=width)
        seconds = time.perf_counter() - start
        kv.drop_tail([width])
        return seconds
    return forward


@torch.inference_mode()
def measure(engine, max_width: int, samples: int = 7, warmup: int = 2) -> CheckCost:
    """The engine's target forward at 1 .. max_width tokens (`engine_forward`), the widths
    taken in turn (the host's speed swings within seconds), medians; the first `warmup` rounds
    untimed. The engine must serve max_width (k + 1) tokens a forward: a speculative one, warm."""
    forward = engine_forward(engine)
    times: dict[int, list[float]] = {w: [] for w in range(1, max_width + 1)}
    for i in range(warmup + samples):
        for w in times:
            took = forward(w)
            if i >= warmup:
                times[w].append(took)
    return CheckCost({w: statistics.median(t) for w, t in times.items()}, samples)
