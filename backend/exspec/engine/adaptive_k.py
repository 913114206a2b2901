"""AdaptiveK: k per group from measured acceptance and step cost (design: "EXSPEC scheduling").
The scheduler asks it for a group's k and tells it every step's outcome."""
from __future__ import annotations

from .group import Group


class AdaptiveK:
    """k per group from the tokens each k commits and measured step cost, with hysteresis.

    Committed tokens per row-step at k come from measured per-draft hazards: h_j, the share of
    rows whose draft j was verified (drafts 1 .. j-1 accepted) that rejected it. A row that
    accepted a of k drafts tells h_1 .. h_min(a+1, k), whatever k the step ran at (greedy and the
    gumbel coupling accept the same prefix at any k), and a row-step at k commits
    1 + S_1 + ... + S_k, S_j = (1 - h_1) ... (1 - h_j). Acceptance comes in runs (a row that
    accepts its first drafts tends to accept them all), so measured hazards fall with depth
    where a geometric model at one per-token rate (on the demo pair at k = 5: 3.5 predicted,
    4.7 committed) steers k too low. Every depth's counts decay with each row-step, and each
    h_j is shrunk toward h_(j-1) (h_1 toward 1 - acceptance) by PRIOR_ROWS pseudo row-steps:
    a depth no step has verified lately (the drafts beyond the current k, whose counts fade
    faster) is extrapolated from the deepest measured one instead of holding on to stale
    counts, which otherwise kept k stuck below its best after an early stretch of low
    acceptance. With no counts at all this is the geometric model at the group's acceptance,
    estimated per sequence (and pool-wide, as the prior for new sequences) as
    accepted / (accepted + rejections) over recent steps.
    Step cost at k >= 1 is modelled as rest + k x draft: a step's time besides its drafts
    (verification, acceptance, bookkeeping) and one draft forward, both moving averages (EMA)
    per batch-size bucket, updated together from every speculative step, whatever its k. Both
    are measured at the same moments, so the comparison of k's does not move with the host's
    speed: this host's speed swings by +-20% within seconds and one step's time differs from the
    next by 7% (median; 25% at the 90th percentile), more than neighbouring k's differ near the
    best (5-9% on the demo pair), and the earlier table of measured step times per k, each k
    timed at its own moments, compared k's at different speeds and settled one below its best
    (0.91 of the best fixed k at B = 1, timed tick by tick).
    The verification's width prices k too: the step besides its drafts is modelled as
    P (1 + gamma k), P a plain (one-token) step, gamma what each more verified column costs as a
    share of P: ~0 where the verifier is launch- or memory-bound (a GPU at small batch), 0.14 on
    this 2-core CPU at B = 1 for the real pair (compute-bound), more at larger batches. gamma
    comes from the one plain step measured per bucket (below): its time as a share of the
    `rest` of its moment, at the mean k `rest` was measured over (`kbar`). Costs then follow
    `rest` as it moves: P = rest / (1 + gamma kbar). Until plain decoding is measured, width
    costs nothing and a plain step is taken as costly as `rest`. A bucket not measured yet
    borrows the nearest measured bucket's costs.
    Plain decoding is measured once per batch-size bucket, by one plain step right after the
    bucket's first speculative step: its cost cannot be told from speculative steps (on a
    compute-bound verifier a one-token step costs a fraction of a k + 1 wide one, on a
    memory-bound one about as much), and taking it as costly as `rest` kept a marginal draft
    speculating at B = 8 on a CPU at 0.91x autoregressive (an optimism bonus of 1.3 on that
    guess still lost to 1.66 tokens per step). Speculation is probed again after
    PROBE_EVERY plain steps, at the k most likely to pay, and twice as rarely each time a probe
    leads back to plain decoding.
    Where proposals are known before the step (a lookup proposer: rows propose different
    lengths, many none), k is only each row's cap and `width` prices the step's actual
    proposals instead: the verified width that commits the most tokens per second, each row's
    proposal kept to it (choosing one k for the group as well capped long, sure proposals at the
    k that short ones and rows without a match pulled down: suffix decoding on the two-turn set
    at B = 8 ran at 0.93 of fixed k = 5, accepted length 3.23 vs 3.52; priced per step, 0.99).
    Its acceptance per depth is counted over proposals alone (`kept_hazards`: whether the j-th
    proposed token is kept, given the row proposed it), since the rows without a proposal are
    known this time, and per proposal length, shrunk toward all lengths': a lookup proposer
    proposes long where its match is long or its tree sure, and one rate for every length would
    cut a sure long proposal at the rate of short guesses.
    """

    # hysteresis: change k only for a 3% better expected rate. A step at another k costs nothing
    # beyond itself, and neighbouring k's near the best differ by 5-9% on the demo pair: a
    # wider margin (10% before) left k one below its best for good.
    GAIN_TO_SWITCH = 1.03
    PROBE_EVERY = 8         # plain steps before speculation is tried again (doubles up to 256)
    EMA = 0.1               # of a bucket's costs, per step measured there (~10 steps' memory)
    DECAY = 0.9             # of the pool-wide acceptance counts, per speculative step
    HAZARD_DECAY = 0.98     # of the per-draft counts, per row-step (a memory of ~50 row-steps)
    STALE_DECAY = 0.95      # of the counts of drafts beyond the step's k, per row-step
    PRIOR_ROWS = 2.0        # pseudo row-steps pulling a draft's hazard toward the one before it

    def __init__(self, max_k: int):
        self.max_k = max_k
        # per batch-size bucket, seconds: a speculative step besides its drafts, one draft
        # forward; and a plain step's time as a share of `rest` (module doc)
        self.rest: dict[int, float] = {}
        self.draft: dict[int, float] = {}
        self.plain: dict[int, float] = {}
        # the mean k `rest` is measured over (EMA), and that mean when plain was measured
        self.kbar: dict[int, float] = {}
        self.plain_at: dict[int, float] = {}
        self.recent_accepted, self.recent_rejections = 7.0, 3.0   # prior: acceptance 0.7
        self.probe_every = self.PROBE_EVERY
        # decayed counts per draft depth j (index j - 1): rows whose draft j was verified, and
        # rows that rejected it
        self.verified = [0.0] * max_k
        self.rejected = [0.0] * max_k
        # the same over proposed tokens alone, per proposal length n (index n - 1): depth j
        # counted only where a row proposed n >= j tokens
        self.proposed_verified = [[0.0] * max_k for _ in range(max_k)]
        self.proposed_rejected = [[0.0] * max_k for _ in range(max_k)]
        # `width`'s own probe: steps in a row it cut to plain although rows proposed
        self.width_probe_every = self.PROBE_EVERY
        self.cut_to_plain = 0

    @property
    def acceptance(self) -> float:
        return self.recent_accepted / (self.recent_accepted + self.recent_rejections)

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << (batch - 1).bit_length()   # 1, 2, 4, 8, 16, ...

    def _measured(self, batch: int) -> int | None:
        """The bucket whose costs stand for this batch size: its own, else the nearest measured."""
        if not self.rest:
            return None
        here = self.bucket(batch)
        if here in self.rest:
            return here
        return min(self.rest, key=lambda b: abs(b.bit_length() - here.bit_length()))

    def cost(self, batch: int, k: int) -> float | None:
        """A step's estimated seconds at k (module doc); None before any speculative step."""
        b = self._measured(batch)
        if b is None:
            return None
        gamma = self.width_cost(b)
        if gamma is None:   # width unpriced: every speculative step costs rest besides drafts
            if k == 0:
                return self.plain.get(b, 1.0) * self.rest[b]
            return self.rest[b] + k * self.draft[b]
        plain = self.rest[b] / (1.0 + gamma * self.kbar[b])
        return plain * (1.0 + gamma * k) + k * self.draft[b]

    def width_cost(self, bucket: int) -> float | None:
        """gamma: one more verified column's cost as a share of a plain step (module doc);
        None until plain decoding is measured at this bucket."""
        at = self.plain_at.get(bucket)
        if not at or bucket not in self.plain:
            return None
        return max(0.0, (1.0 / self.plain[bucket] - 1.0) / at)

    def hazards(self, acceptance: float, verified=None, rejected=None) -> list[float]:
        """h_1 .. h_max_k: each depth's measured rejection share, shrunk toward the depth before."""
        out, prior = [], 1.0 - min(max(acceptance, 0.0), 0.999)
        for v, r in zip(verified or self.verified, rejected or self.rejected):
            prior = (r + self.PRIOR_ROWS * prior) / (v + self.PRIOR_ROWS)
            out.append(prior)
        return out

    def kept_hazards(self, length: int | None = None, pooled: list[float] | None = None) -> list[float]:
        """Per depth j, the share of proposed j-th tokens (their row kept the ones before) that
        were rejected: `hazards` over proposals alone; of proposals of this length, shrunk
        toward all lengths' (`pooled`, when the caller has them) by PRIOR_ROWS pseudo row-steps."""
        if pooled is None:
            pooled = self.hazards(self.acceptance, [sum(c) for c in zip(*self.proposed_verified)],
                                  [sum(c) for c in zip(*self.proposed_rejected)])
        if length is None:
            return pooled
        return [(r + self.PRIOR_ROWS * h) / (v + self.PRIOR_ROWS) for v, r, h in
                zip(self.proposed_verified[length - 1], self.proposed_rejected[length - 1], pooled)]

    def width(self, batch: int, lengths: list[int]) -> int:
        """The verified width for proposals of these lengths (per row; a lookup proposer's)
        that commits the most tokens per second: at width w row r commits 1 + S_1 + ... +
        S_min(w, len_r), S_j the chance its first j proposed tokens are kept (`kept_hazards` of
        its length), for the step's cost at w; 0 is a plain step. Before the width is priced (plain decoding
        unmeasured at this bucket) every proposal is verified whole. A step cut to plain
        although rows proposed teaches nothing, so after `width_probe_every` of them in a row
        one is verified whole (twice as rarely each time, as `choose` probes)."""
        top = max(lengths, default=0)
        bucket = self._measured(batch)
        if top == 0 or bucket is None or self.width_cost(bucket) is None:
            return top
        pooled = self.kept_hazards()
        reach = {}   # per length n: expected tokens kept of such a proposal cut to 0 .. n
        for n in set(lengths) - {0}:
            survive, s = [0.0], 1.0
            for h in self.kept_hazards(n, pooled)[:n]:
                s *= 1.0 - h
                survive.append(survive[-1] + s)
            reach[n] = survive
        rates = [sum(1.0 + (reach[n][min(w, n)] if n else 0.0) for n in lengths) / self.cost(batch, w)
                 for w in range(top + 1)]
        best = max(range(top + 1), key=rates.__getitem__)
        if best > 0:
            self.cut_to_plain, self.width_probe_every = 0, self.PROBE_EVERY
            return best
        self.cut_to_plain += 1
        if self.cut_to_plain >= self.width_probe_every:
            self.cut_to_plain, self.width_probe_every = 0, min(2 * self.width_probe_every, 256)
            return top
        return 0

    def tokens_by_k(self, acceptance: float) -> list[float]:
        """Tokens a row-step commits at k = 0 .. max_k: 1 + the chances that drafts 1 .. k survive."""
        out, survive = [1.0], 1.0
        for h in self.hazards(acceptance):
            survive *= 1.0 - h
            out.append(out[-1] + survive)
        return out

    def choose(self, group: Group, cap: int, per_step: bool = False) -> int:
        """The group's k. `per_step`: proposals are known before each step (a lookup
        proposer), so `width` prices them step by step and k is only each row's cap: the cap,
        but for the one plain step that measures plain decoding at a bucket."""
        batch = len(group)
        here = self.bucket(batch)
        if per_step:   # nothing to weigh here: `width` prices each step
            return 0 if here in self.rest and here not in self.plain else cap
        acceptance = group.acceptance(self.acceptance)
        current = min(group.k if group.k is not None else cap, cap)
        tokens = self.tokens_by_k(acceptance)
        costs = [self.cost(batch, k) for k in range(cap + 1)]
        if costs[0] is None:
            return current   # nothing measured yet: the first step tells
        rates = [batch * tokens[k] / costs[k] for k in range(cap + 1)]
        if current == 0 and group.plain_steps_in_a_row >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, 256)
            # re-measure acceptance now and then, more rarely each time, at the k most likely
            # to pay (at low acceptance the cheapest probe, k = 1)
            return max(range(1, cap + 1), key=rates.__getitem__)
        if here in self.rest and here not in self.plain:
            return 0   # plain decoding, unmeasured at this bucket: one step measures it
        best = max(range(cap + 1), key=rates.__getitem__)
        choice = best if rates[best] > rates[current] * self.GAIN_TO_SWITCH else current
        if choice > 0 and current > 0:
            self.probe_every = self.PROBE_EVERY   # speculation pays again: probe eagerly
        return choice

    def observe(self, batch: int, k: int, seconds: float, draft_seconds: float,
                accepted: list[int], proposed: list[int] | None = None,
                lengths: list[int] | None = None) -> None:
        """A step at k took `seconds`, `draft_seconds` of them drafting; `proposed`: per row,
        the drafts it verified when rows differ (n-gram), else k each. A proposal that ended
        at n < k yielded nothing at depth n + 1: that depth counts as verified and rejected, so
        the hazards give what a row-step commits (a proposer that seldom matches yields little,
        and plain decoding wins where it is cheaper). `lengths`: per row, its proposal's length
        before `width` cut it; the kept-token counts are per that length (a cut proposal's
        tokens past the cut were never verified, which says nothing of them; counted at the
        cut length instead, a sure long proposal cut to 3 made 3-token proposals look sure
        and left the long ones' own counts thin, so they were cut again)."""
        b = self.bucket(batch)
        if k == 0:
            if b in self.rest:
                _ema(self.plain, b, seconds / self.rest[b], self.EMA)
                self.plain_at[b] = self.kbar[b]
            return
        _ema(self.rest, b, seconds - draft_seconds, self.EMA)
        _ema(self.draft, b, draft_seconds / k, self.EMA)
        _ema(self.kbar, b, float(k), self.EMA)
        proposed = proposed or [k] * len(accepted)
        self.recent_accepted = self.DECAY * self.recent_accepted + sum(accepted)
        self.recent_rejections = self.DECAY * self.recent_rejections + sum(
            a < n for a, n in zip(accepted, proposed))
        # depths beyond k measured an older regime: they fade faster than verified ones
        decays = [(self.HAZARD_DECAY if j < k else self.STALE_DECAY) ** len(accepted)
                  for j in range(self.max_k)]
        for counts in (self.verified, self.rejected, *self.proposed_verified, *self.proposed_rejected):
            counts[:] = [d * c for d, c in zip(decays, counts)]
        for a, n, length in zip(accepted, proposed, lengths or proposed):
            # drafts 1 .. a+1 were verified (depth n + 1 of a short proposal: nothing to accept)
            for j in range(min(a + 1, k)):
                self.verified[j] += 1.0
            if a < k:
                self.rejected[a] += 1.0
            for j in range(min(a + 1, n)):   # of what the row proposed, as far as verified
                self.proposed_verified[length - 1][j] += 1.0
            if a < n:
                self.proposed_rejected[length - 1][a] += 1.0


def _ema(table: dict, key, value: float, weight: float) -> None:
    """Move table[key] toward value by `weight` (the first value sets it)."""
    old = table.get(key)
    table[key] = value if old is None else old + weight * (value - old)
