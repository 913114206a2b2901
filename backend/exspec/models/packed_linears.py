"""The decoder layers' matrices prepacked by oneDNN for small batches, on a CPU's compiled path.

A decode step multiplies a few rows (one to k + 1 tokens a row) by every weight of every layer,
and on a CPU its time is the weights streamed from memory. MKL's sgemm, which inductor's graphs
call for a linear, repacks the weight on every call; on an AMD EPYC it also takes a slow path
for these shapes, so the real pair's target (SmolLM2-135M) spent ~42 ms on a one-token forward
where the same matrices packed once by oneDNN (`mkldnn._reorder_linear_weight`) take ~24 ms, and
a 5-token verification costs 1.15x one token (scripts/verification_cost.py;
docs/results-by-machine.md). On an Intel Xeon MKL's own path is the cheaper one below 4 rows.

A packed oneDNN tensor cannot enter a Dynamo graph, and inductor's freezing (which packs weights
it folds in as constants) makes graphs its on-disk cache refuses, so a restart would compile
minutes again. Instead each linear of the compiled region's template layer calls a custom op,
`exspec::packed_linear(x, weight, bias)`: an opaque call in the graph, cacheable like any
aten op, which finds the weight's packed copy by its address. Which of the two products runs is
decided per matrix shape and row count by timing both in place during the warm-up, every call
alternating (`PackedLinears.settle` fixes it before READY): timed in a real forward, where each
weight comes cold from memory, since a loop over one hot matrix favours MKL where a forward does
not. Rounding differs from MKL's by float32 ulps, as inductor's own kernels already do.

Only linears of at least PACK_FROM_ELEMENTS weights: for tiny ones (the deep-narrow pair's
64 x 64) the op's dispatch through Python (~5 us) costs more than the product. The packed copies
are extra memory, the layers' weights' size, dropped when no shape chose them.
"""
from __future__ import annotations

import statistics
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import log

# smaller weights keep inductor's own product (the op's dispatch costs more than packing saves)
PACK_FROM_ELEMENTS = 1 << 16
# the batch size oneDNN packs for: a verification's k + 1 rows at the default k (any row count
# runs; this one is the fastest there)
PACKED_FOR_ROWS = 5
# timed calls of each product per (rows, weight shape) before the warm-up's choice counts
MIN_SAMPLES = 4


@dataclass
class _Packed:
    weight: weakref.ref          # the weight whose address keys it (alive: the address is its)
    packed: torch.Tensor         # its oneDNN copy
    owner: "PackedLinears"


# weight address -> its packed copy; an entry goes when its weight does
_PACKS: dict[int, _Packed] = {}


@torch.library.custom_op("exspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the weight's oneDNN-packed copy where one exists and
    its owner chose it for this shape."""
    entry = _PACKS.get(weight.data_ptr())
    own = None if entry is None else entry.weight()
    if own is None or own.shape != weight.shape or own.stride() != weight.stride():
        return F.linear(x, weight, bias)
    return entry.owner.run(x, weight, bias, entry.packed)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] packed once by oneDNN for PACKED_FOR_ROWS-row products."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """x @ weight.T (+ bias) through `pack(weight)`, for any leading shape of x."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(torch.nn.Linear):
    """An nn.Linear whose forward is the op (the class of a compiled template's linears)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.exspec.packed_linear(x, self.weight, self.bias)


def packs(linear: torch.nn.Module) -> bool:
    """A float32 CPU nn.Linear big enough to pay for the op, where oneDNN is built in."""
    return (type(linear) is torch.nn.Linear and linear.weight.dtype == torch.float32
            and linear.weight.device.type == "cpu" and linear.weight.numel() >= PACK_FROM_ELEMENTS
            and (linear.bias is None or linear.bias.dtype == torch.float32)
            and torch.backends.mkldnn.is_available())


class PackedLinears:
    """The packed copies of one model's layer linears, and per (rows, out, in) which product
    runs: both in turn, timed, while `calibrating` (the warm-up), then the faster
    (`settle`)."""

    def __init__(self, layers, names: list[str]):
        self.calibrating = True
        self.chosen: dict[tuple[int, int, int], bool] = {}   # (rows, out, in) -> packed?
        self.samples: dict[tuple[int, int, int, bool], list[float]] = defaultdict(list)
        self.calls = 0   # products through a packed copy
        self.count = 0
        self.bytes = 0   # the copies' memory (their weights' size): what the packing costs
        with torch.no_grad():
            for layer in layers:
                for name in names:
                    weight = layer.get_submodule(name).weight
                    if weight.data_ptr() in _PACKS:   # another engine's compiled path of this model
                        continue
                    _PACKS[weight.data_ptr()] = _Packed(weakref.ref(weight), pack(weight), self)
                    weakref.finalize(weight, _PACKS.pop, weight.data_ptr(), None)
                    self.count += 1
                    self.bytes += weight.nbytes

    def run(self, x, weight, bias, packed) -> torch.Tensor:
        size = x.shape[-1]
        rows = x.numel() // size
        key = (rows, weight.shape[0], size)
        use = self.chosen.get(key, True)
        if self.calibrating:
            use = len(self.samples[key + (True,)]) <= len(self.samples[key + (False,)])
            start = time.perf_counter()
        if use:
            self.calls += 1
            out = packed_product(x, packed, bias, weight.shape[0])
        else:
            out = F.linear(x, weight, bias)
        if self.calibrating:
            self.samples[key + (use,)].append(time.perf_counter() - start)
        return out

    def settle(self, name: str) -> None:
        """End the warm-up's timing: each (rows, shape) timed enough runs its faster product
        from now on, any other the packed one; without a shape that chose it, the copies go."""
        self.calibrating = False
        rows: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])   # per row count, summed medians
        for key in {key[:3] for key in self.samples}:
            packed, plain = self.samples[key + (True,)], self.samples[key + (False,)]
            if min(len(packed), len(plain)) >= MIN_SAMPLES:
                self.chosen[key] = statistics.median(packed) <= statistics.median(plain)
                rows[key[0]][0] += statistics.median(packed)
                rows[key[0]][1] += statistics.median(plain)
        self.samples.clear()
        count, size, unused = self.count, self.size(), self.chosen and not any(self.chosen.values())
        if unused:
            self.release()
        log.info("exspec: %s: layer linears packed by oneDNN (%d weights, %s of copies%s), timed "
                 "in the warm-up (medians summed over its matrix shapes): %s", name, count, size,
                 "; dropped: MKL's product was the faster at every shape" if unused else "",
                 ", ".join(f"{r} rows: packed {1e6 * p:.0f} us, MKL {1e6 * q:.0f} us"
                           for r, (p, q) in sorted(rows.items())) or "nothing timed")

    def release(self) -> None:
        """Drop this model's packed copies (the op then runs MKL's product)."""
        for address in [a for a, entry in _PACKS.items() if entry.owner is self]:
            del _PACKS[address]
        self.count = self.bytes = 0

    def describe(self) -> str:
        chosen = sorted({rows for (rows, _, _), packed in self.chosen.items() if packed})
        return (f"layer linears packed by oneDNN ({self.count} weights, {self.size()} of copies"
                + (f"; packed at {chosen} rows" if self.chosen else "") + ")") if self.count else ""

    def size(self) -> str:
        mib = self.bytes / 2**20
        return f"{mib:.1f} MiB" if mib < 10 else f"{mib:.0f} MiB"


def pack_template(template, layer) -> list[str]:
    """Turn the template layer's linears that `packs` into PackedLinear (by class: the template
    is the compiled region's own copy), judged on the real `layer`; returns their names."""
    names = [name for name, module in layer.named_modules() if packs(module)]
    for name in names:
        template.get_submodule(name).__class__ = PackedLinear
    return names
