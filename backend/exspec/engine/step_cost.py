"""StepCost: what a step costs per batch-size bucket and verified width, measured as the engine
runs (adaptive k prices k with it; design: "EXSPEC scheduling")."""
from __future__ import annotations


class StepCost:
    """Seconds of a step at k drafts: `level x relative(k) + k x draft`, per batch-size bucket.

    `relative(k)`: the step besides its drafts (verifying k + 1 tokens a row, accepting,
    bookkeeping) in plain (one-token) steps, measured per width. On a compute-bound verifier it
    grows with the width, and not evenly (this 2-core CPU, the real pair at B = 8: a k = 1 step
    1.57 plain steps, a k = 2 step 1.63: one share per column, taken from the first, overpriced
    k = 2 and kept the EAGLE-3 head at k = 1, 0.96 of fixed k = 2); on a memory- or launch-bound
    one (a GPU at small batch) it hardly grows. `level`: a plain step's seconds now.

    This host's speed swings by +-20% within seconds and one step's time differs from the next by
    7% (median), more than neighbouring widths differ near the best, so widths are not each timed
    at their own moments (an earlier table of step times per k settled one k below its best): a
    step at another width than the bucket's step before measures that width as a ratio to the
    level the steps around it set, and every step moves the level. A run of steps at one width
    moves only the level, so a host slowing down does not leak into that width's ratio. A
    width's ratio is the mean of its first RATIO_MEMORY measurements, then a moving average.

    A width never measured is interpolated between the measured ones around it, or extrapolated
    from the two nearest (never cheaper for being wider); with one width measured, every width
    costs what it costs. Plain decoding counts as priced once a plain step is measured (`priced`):
    before that a plain step is taken as costly as the width measured. A bucket not measured yet
    borrows the nearest measured bucket's costs.
    """

    LEVEL_EMA = 0.1     # of the level and of a draft forward's seconds, per step (~10 steps' memory)
    RATIO_MEMORY = 5    # measurements a width's ratio averages over

    def __init__(self):
        self.level: dict[int, float] = {}                # bucket -> seconds of a plain step now
        self.ratio: dict[int, dict[int, float]] = {}     # bucket -> {k: cost in plain steps}
        self.measured: dict[int, dict[int, int]] = {}    # bucket -> {k: measurements}
        self.draft: dict[int, float] = {}                # bucket -> seconds per draft forward
        self.last_k: dict[int, int] = {}                 # bucket -> its last step's k

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << (batch - 1).bit_length()   # 1, 2, 4, 8, 16, ...

    def nearest(self, batch: int) -> int | None:
        """The bucket whose costs stand for this batch size: its own, else the nearest measured."""
        if not self.level:
            return None
        here = self.bucket(batch)
        if here in self.level:
            return here
        return min(self.level, key=lambda b: abs(b.bit_length() - here.bit_length()))

    def has(self, bucket: int) -> bool:
        return bucket in self.level

    def priced(self, bucket: int) -> bool:
        """Whether a plain step has been measured at this bucket (so width has a price)."""
        return 0 in self.ratio.get(bucket, {})

    def seconds(self, batch: int, k: int) -> float | None:
        """A step's estimated seconds at k; None before any step was measured."""
        b = self.nearest(batch)
        if b is None:
            return None
        return self.level[b] * self.relative(b, k) + k * self.draft.get(b, 0.0)

    def relative(self, bucket: int, k: int) -> float:
        """A step at k besides its drafts, in plain steps at this bucket (class doc)."""
        ratio = self.ratio[bucket]
        if k in ratio:
            return ratio[k]
        widths = sorted(ratio)
        if len(widths) == 1:
            return ratio[widths[0]]
        below, above = [w for w in widths if w < k], [w for w in widths if w > k]
        if below and above:
            a, c = below[-1], above[0]
            return ratio[a] + (ratio[c] - ratio[a]) * (k - a) / (c - a)
        a, c = widths[-2:] if below else widths[:2]
        edge = c if below else a
        slope = max(0.0, (ratio[c] - ratio[a]) / (c - a))
        return max(ratio[edge] + slope * (k - edge), 0.0)

    def observe(self, batch: int, k: int, seconds: float, draft_seconds: float) -> None:
        """A step at k (0: plain) took `seconds`, `draft_seconds` of them drafting."""
        b = self.bucket(batch)
        rest = max(seconds - draft_seconds, 1e-9)
        if k > 0:
            _ema(self.draft, b, draft_seconds / k, self.LEVEL_EMA)
        if b not in self.level:   # the bucket's first step: the unit its other widths are measured in
            self.level[b], self.ratio[b], self.measured[b], self.last_k[b] = rest, {k: 1.0}, {k: 1}, k
            return
        ratio, measured = self.ratio[b], self.measured[b]
        if k not in ratio or k != self.last_k[b]:   # another width: a ratio to the moment's level
            n = measured[k] = measured.get(k, 0) + 1
            now = rest / self.level[b]
            ratio[k] = now if k not in ratio else ratio[k] + (now - ratio[k]) / min(n, self.RATIO_MEMORY)
            if k == 0:   # keep plain steps the unit: rescale the ratios, the level with them
                unit = ratio[0]
                ratio.update({w: r / unit for w, r in ratio.items()})
                self.level[b] *= unit
        self.level[b] += self.LEVEL_EMA * (rest / ratio[k] - self.level[b])
        self.last_k[b] = k


def _ema(table: dict, key, value: float, weight: float) -> None:
    """Move table[key] toward value by `weight` (the first value sets it)."""
    old = table.get(key)
    table[key] = value if old is None else old + weight * (value - old)
