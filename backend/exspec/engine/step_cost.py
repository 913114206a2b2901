"""StepCost: what a step costs per batch-size bucket and verified width, measured as the engine
runs (adaptive k prices k with it; design: "EXSPEC scheduling")."""
from __future__ import annotations

import dataclasses
import math
import statistics


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
    at their own moments (an earlier table of step times per k settled one k below its best).
    The running width is the yardstick: its steps move the level, its ratio held; a step at
    another width measures that width as a ratio to the level (a neighbour probe, the other
    group's k), and two steps in a row at another width make it the yardstick (k moved). Every
    width is so measured against one fixed reference: when each width's step re-measured it
    against a level the others had moved, the ratios drifted together, 10% in one demo-pair
    run. A width's ratio is the median of its last RATIO_MEMORY measurements, so one step the
    host slowed does not price a width out until its next measurements (a mean left k = 5 at
    1.97 plain steps where probes measured 1.45 and held the demo pair at k = 4 for a run).

    A width's first step at a bucket runs cold (shapes new to the allocator and the kernels:
    the demo pair's first k = 3 step at B = 8 took 29 ms where the next took 17) and is not
    counted: counted, cold steps left k = 3 priced at 2.2 plain steps and k = 5 at 1.8 (1.56
    warm), and adaptive k settled on k = 4 at 0.92 of fixed k = 5 (`make bench`, exspec B = 8).

    A width's price is its own median where it stands out from a fit to all measured widths, the
    fit where it does not. The fit is `1 + jump + column x k` (least squares, each width
    weighted by its measurements, neither below 0): a speculative step's own cost beyond a plain
    one, then each verified column's. Neither alone prices every verifier: single widths'
    medians are noisy (+-5-10% on the demo pair, where neighbouring widths differ by 0-5%), and
    priced one by one they held k one or two below its best for whole runs (0.87 of fixed k = 5
    at exspec B = 4); a line cannot price a staircase (the real pair at B = 1 on this CPU: k = 1
    1.07 plain steps, k = 2 1.15, k = 3 1.65, k = 4 1.71; the line, 0.17 a column, priced k = 1
    above plain decoding's rate where k = 1 is 9% faster, and adaptive k ran a third of its
    steps plain, 0.97 of fixed k = 1). So each width's median is shrunk toward the fit by its
    noise: kept by 1 - se^2 / d^2 (d its distance from the fit, se^2 the variance of a median of
    its n measurements at the host's scatter, pooled over every width's measurements around
    their medians): a width measured often and far from the line keeps its own price, one within
    its noise of the line takes the line's. A width not measured costs the lower of the fit and
    the line between the measured widths on either side of it: priced too cheap, a width is run
    and so measured; priced too dear, it is never run (the real pair at B = 1 with k = 3 and 4
    measured: the fit through them priced k = 1 at 1.51 plain steps, not 1.07, and adaptive k
    ran at k = 3 until a neighbour probe measured k = 2). The yardstick's price to plain
    decoding is measured by the plain steps, so it counts their measurements in the fit, and its
    price is its own: shrunk toward a fit that a few probes' measurements pulled, the demo
    pair's k = 5 at B = 8 was priced 5% above its measure (1.71 plain steps for 1.62). With one
    width measured the jump is 0. Before plain steps are measured here (`priced`: PLAIN_SAMPLES
    of them, warm) a bucket borrows the nearest priced bucket's prices (`donor`), scaled so its
    running width costs what it was measured to cost here; with none priced yet, every width
    costs the measured widths' mean and a plain step as much. A bucket with no step yet
    borrows the nearest measured bucket's costs whole.
    """

    LEVEL_EMA = 0.1     # of the level and of a draft forward's seconds, per step (~10 steps)
    # a step counts in those averages at most this factor off them, either way: one outlier
    # (a one-off index build, a pause) moves a price by at most LEVEL_EMA x 1, 10%, gone within
    # a few steps; counted whole, one 100x draft step priced speculation out of adaptive k for
    # a thousand plain steps (plain steps do not measure drafts). The host's +-20% swings pass.
    OUTLIER = 2.0
    RATIO_MEMORY = 5    # measurements a width's ratio is the median of
    PLAIN_SAMPLES = 3   # warm plain steps that price a bucket's widths (one alone: +-7%)
    SCATTER = 0.1       # prior of one step's relative scatter around its width's median ...
    SCATTER_PRIOR = 4   # ... worth this many measurements

    def __init__(self):
        self.buckets: dict[int, Bucket] = {}   # batch-size bucket -> what its steps measured

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << (batch - 1).bit_length()   # 1, 2, 4, 8, 16, ...

    def nearest(self, batch: int) -> int | None:
        """The bucket whose costs stand for this batch size: its own, else the nearest measured
        (`_closest`: ties go to the larger)."""
        here = self.bucket(batch)
        if self.has(here):
            return here
        return _closest(here, [b for b in self.buckets if self.has(b)])

    def has(self, bucket: int) -> bool:
        """Whether a warm step was measured at this bucket."""
        return bucket in self.buckets and self.buckets[bucket].level is not None

    def measured(self, bucket: int, k: int) -> bool:
        """Whether a warm step at k measured its cost here."""
        return bucket in self.buckets and k in self.buckets[bucket].ratio

    def donor(self, bucket: int) -> int | None:
        """The priced bucket nearest this one, whose prices an unpriced bucket borrows; None if
        none is."""
        return _closest(bucket, [b for b, costs in self.buckets.items() if costs.priced and b != bucket])

    def priced(self, bucket: int) -> bool:
        """Whether plain steps have been measured at this bucket (so width has a price): as the
        yardstick, or PLAIN_SAMPLES times against it; for good (plain steps taken as the
        yardstick once, then left, stay measured)."""
        return bucket in self.buckets and self.buckets[bucket].priced

    def priceable(self, bucket: int) -> bool:
        """Whether a bucket's widths have a price: plain decoding measured there, or at a bucket
        it borrows from (`donor`)."""
        return self.priced(bucket) or self.donor(bucket) is not None

    def seconds(self, batch: int, k: int, drafts: int | None = None) -> float | None:
        """A step's estimated seconds at k with `drafts` draft forwards (k of them unless
        told); None before any step was measured."""
        b = self.nearest(batch)
        if b is None:
            return None
        costs = self.buckets[b]
        return costs.level * self.relative(b, k) + (k if drafts is None else drafts) * (costs.draft or 0.0)

    def relative(self, bucket: int, k: int) -> float:
        """A step at k besides its drafts, in plain steps at this bucket: its own median shrunk
        toward the fit by its noise (class doc); before plain decoding is measured, the
        measured widths' mean. Kept until a measurement changes the bucket's prices (priced
        afresh at every choice, they took 60 us a step: three times the rest of adaptive k)."""
        if not self.priced(bucket):   # borrowed or averaged: cheap, and the donor may move
            return self._unpriced(bucket, k)
        prices = self.buckets[bucket].prices
        if k not in prices:
            prices[k] = self._relative(bucket, k)
        return prices[k]

    def _unpriced(self, bucket: int, k: int) -> float:
        """Before plain decoding is measured here: the donor's prices, scaled so the running
        width costs what it was measured to cost here; with no donor, every width (plain
        included) the measured widths' mean."""
        costs, donor = self.buckets[bucket], self.donor(bucket)
        if donor is None:
            speculative = [r for w, r in costs.ratio.items() if w > 0]
            return sum(speculative) / len(speculative)
        running = costs.yardstick
        return costs.ratio[running] * self.relative(donor, k) / self.relative(donor, running)

    def _relative(self, bucket: int, k: int) -> float:
        costs = self.buckets[bucket]
        ratio = costs.ratio
        if k == 0:
            return 1.0
        if k == costs.yardstick:   # the reference every step moves: as measured
            return ratio[k]
        if costs.line is None:   # one fit per repricing, not one per width
            costs.line = self.fit(bucket)
        jump, column = costs.line
        line = 1.0 + jump + column * k
        if k not in ratio:   # the cheaper of the fit and the measured widths on either side
            below = max(w for w in ratio if w < k)
            above = min((w for w in ratio if w > k), default=None)
            if above is None:
                return line
            low, high = self.relative(bucket, below), self.relative(bucket, above)
            return min(line, low + (high - low) * (k - below) / (above - below))
        apart = (ratio[k] - line) ** 2
        if costs.spread is None:
            costs.spread = self.scatter(bucket)
        noise = (math.pi / 2) * costs.spread * ratio[k] ** 2 / self.measurements(bucket, k)
        kept = max(0.0, 1.0 - noise / apart) if apart > 0.0 else 0.0
        return line + kept * (ratio[k] - line)

    def measurements(self, bucket: int, k: int) -> int:
        """How many measurements a width's price rests on: the yardstick's, the plain steps'."""
        costs = self.buckets[bucket]
        return len(costs.samples.get(0 if k == costs.yardstick else k, ())) or 1

    def scatter(self, bucket: int) -> float:
        """One step's relative variance around its width's median, pooled over the bucket's
        widths, with SCATTER_PRIOR measurements' worth of SCATTER."""
        costs = self.buckets[bucket]
        total, count = self.SCATTER_PRIOR * self.SCATTER ** 2, self.SCATTER_PRIOR
        for w, recent in costs.samples.items():
            if len(recent) > 1:
                total += sum((r / costs.ratio[w] - 1.0) ** 2 for r in recent)
                count += len(recent) - 1
        return total / count

    def fit(self, bucket: int) -> tuple[float, float]:
        """(jump, column): a speculative step's cost over a plain one besides its columns, and
        each verified column's, both in plain steps and >= 0; least squares over the measured
        widths' ratios, each weighted by its measurements. One width measured: no jump."""
        points = [(w, r - 1.0, self.measurements(bucket, w))
                  for w, r in self.buckets[bucket].ratio.items() if w > 0]
        if not points:
            return 0.0, 0.0
        n = sum(c for _, _, c in points)
        if len({w for w, _, _ in points}) > 1:
            mw = sum(c * w for w, _, c in points) / n
            my = sum(c * y for _, y, c in points) / n
            column = (sum(c * (w - mw) * (y - my) for w, y, c in points)
                      / sum(c * (w - mw) ** 2 for w, _, c in points))
            if column < 0.0:   # wider never cheaper
                return max(my, 0.0), 0.0
            if my - column * mw >= 0.0:
                return my - column * mw, column
        # no jump: a share per column through plain
        return 0.0, max(0.0, sum(c * w * y for w, y, c in points) / sum(c * w * w for w, _, c in points))

    def observe(self, batch: int, k: int, seconds: float, draft_seconds: float) -> None:
        """A step at k (0: plain) took `seconds`, `draft_seconds` of them drafting."""
        costs = self.buckets.setdefault(self.bucket(batch), Bucket())
        rest = max(seconds - draft_seconds, 1e-9)
        # a step that drafted nothing (a hybrid's step on suffix decoding alone) says nothing of
        # a draft's price; counted as free it pulled the price toward 0
        if k > 0 and draft_seconds > 0:
            per_draft = draft_seconds / k
            costs.draft = per_draft if not costs.draft else self._toward(costs.draft, per_draft)
        if k not in costs.seen:   # a width's first step here runs cold: it teaches nothing
            costs.seen.add(k)
            return
        if costs.level is None:   # the bucket's first warm step: the unit and the yardstick
            costs.reprice()
            costs.level, costs.ratio, costs.samples = rest, {k: 1.0}, {k: [1.0]}
            costs.yardstick = costs.last_k = k
            costs.priced = k == 0
            return
        ratio, samples = costs.ratio, costs.samples
        moved = k != costs.yardstick and k == costs.last_k and k in ratio
        if moved and (k or costs.priced):   # not plain steps still being measured
            costs.yardstick = k   # the running width moved here
            costs.reprice()
        if k == costs.yardstick:   # the level follows the host's speed
            costs.level = self._toward(costs.level, rest / ratio[k])
        else:   # another width: a ratio to the yardstick's level
            costs.reprice()
            recent = samples.setdefault(k, [])
            recent[:] = recent[-(self.RATIO_MEMORY - 1):] + [rest / costs.level]
            ratio[k] = statistics.median(recent)
            if k == 0:   # keep plain steps the unit: rescale the ratios, the level with them
                unit = ratio[0]
                ratio.update({w: r / unit for w, r in ratio.items()})
                for recent in samples.values():
                    recent[:] = [r / unit for r in recent]
                costs.level *= unit
        costs.last_k = k
        if costs.yardstick == 0 or len(samples.get(0, ())) >= self.PLAIN_SAMPLES:
            costs.priced = True

    def _toward(self, average: float, seen: float) -> float:
        """One step of a moving average toward `seen`, clipped to OUTLIER times the average."""
        seen = min(max(seen, average / self.OUTLIER), average * self.OUTLIER)
        return average + self.LEVEL_EMA * (seen - average)


def _closest(bucket: int, candidates: list[int]) -> int | None:
    """The candidate bucket nearest this one in powers of two; ties go to the larger, whose
    widths cost more on a compute-bound verifier (so borrowed prices lean toward measuring)."""
    return min(candidates, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b),
               default=None)


@dataclasses.dataclass
class Bucket:
    """What the steps at one batch-size bucket measured (StepCost)."""
    seen: set[int] = dataclasses.field(default_factory=set)   # widths stepped here
    draft: float | None = None      # seconds per draft forward (moving average)
    level: float | None = None      # seconds of a plain step now; None before a warm step
    yardstick: int = 0              # the width whose steps move the level
    last_k: int = 0                 # the last step's width
    ratio: dict[int, float] = dataclasses.field(default_factory=dict)   # {k: cost in plain steps}
    samples: dict[int, list[float]] = dataclasses.field(default_factory=dict)   # {k: recent ratios}
    prices: dict[int, float] = dataclasses.field(default_factory=dict)  # {k: relative(k)}, kept
    priced: bool = False            # plain decoding measured here (for good)
    line: tuple[float, float] | None = None   # fit(), kept with the prices
    spread: float | None = None               # scatter(), kept with the prices

    def reprice(self) -> None:
        """A measurement changed the ratios: every kept price (and the fit under it) goes."""
        self.prices.clear()
        self.line = self.spread = None
