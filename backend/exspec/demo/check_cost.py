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


@torch.inference_mode()
def measure(target, max_width: int, cache_len: int = 96, samples: int = 7, warmup: int = 2,
            seed: int = 0) -> CheckCost:
    """The target's forward at 1 .. max_width tokens over a cache of `cache_len` (a chat
    prompt's length), batch 1, the widths taken in turn (the host's speed swings within
    seconds), each forward's new entries cropped off again; the first `warmup` rounds untimed."""
    from transformers import DynamicCache
    gen = torch.Generator().manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    device = target.get_input_embeddings().weight.device
    cache = DynamicCache(config=target.config)
    context = torch.randint(vocab, (1, cache_len), generator=gen).to(device)
    target(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    times: dict[int, list[float]] = {w: [] for w in range(1, max_width + 1)}
    for i in range(warmup + samples):
        for w in times:
            ids = torch.randint(vocab, (1, w), generator=gen).to(device)
            pos = torch.arange(cache_len, cache_len + w, device=device)[None]
            start = time.perf_counter()
            target(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=w)
            if i >= warmup:
                times[w].append(time.perf_counter() - start)
            cache.crop(-w)   # back to cache_len entries
    return CheckCost({w: statistics.median(t) for w, t in times.items()}, samples)
