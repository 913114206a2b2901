"""AdaptiveK: k per group from measured acceptance and step cost (design: "EXSPEC scheduling").
The scheduler asks it for a group's k and tells it every step's outcome."""
from __future__ import annotations

from .group import Group
from .step_cost import StepCost


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
    A step's cost at k comes from `StepCost` (step_cost.py): per batch-size bucket, a plain
    step's seconds now, what each verified width costs in plain steps (measured as ratios to the
    moment's speed, since this host's speed swings more than neighbouring k's differ), and one
    draft forward (its prices: each width's own where it stands out from a fit, a speculative
    step's own cost plus one per verified column, the fit's where it does not). A width the
    group does not run is measured by a neighbour probe: every WIDTH_PROBE_EVERY speculative
    steps at a bucket one step runs at k + 1 or k - 1 (in turn), and the group goes back to the
    k it left, hysteresis kept; each probe that leaves k where it was doubles the spacing (up to
    8 times), one that moves k resets it: a probe runs a step at a k thought worse, and once k
    has settled few probes move it. Without probes only the widths k once passed through are
    measured, and the others are extrapolated from them: one share per column, taken from the
    first, overpriced k = 2 for the EAGLE-3 head on the real pair at B = 8 (k = 1 step 1.57
    plain steps, k = 2 step 1.63: a step's own cost 0.51, a column 0.06) and kept it at k = 1,
    0.96 of fixed k = 2. Where speculation at k leads plain decoding by less than
    PLAIN_PROBE_WITHIN, the probe below k is plain decoding, PLAIN_SAMPLES plain steps each
    after a step at k (the comparison that decides whether to speculate; its price otherwise
    rests on the bucket's first plain steps for good).
    Plain decoding is measured once per batch-size bucket, by plain steps right after the
    bucket's first speculative steps (the first of each width runs cold: StepCost), or, at a
    bucket met after another was priced, only where at the other's prices speculation is within
    MEASURE_PLAIN_WITHIN of plain decoding's rate (the demo pair's B = 8 runs spent four plain
    steps of about 25 at the 2-row bucket their last rows met, where speculation runs at twice
    plain decoding's rate). Its cost
    cannot be told from speculative steps (on a compute-bound verifier a one-token step costs a
    fraction of a k + 1 wide one, on a memory-bound one about as much), and taking it as costly
    as a speculative step besides its drafts kept a marginal draft speculating at B = 8 on a
    CPU at 0.91x autoregressive (an optimism bonus of 1.3 on that
    guess still lost to 1.66 tokens per step). Speculation is probed again after
    PROBE_EVERY plain steps, at the k most likely to pay, and twice as rarely each time a probe
    leads back to plain decoding where speculation is priced below 1 / SPEC_PROBE_WITHIN of
    plain decoding's rate (nearer a tie every PROBE_EVERY plain steps).
    Where proposals are known before the step (a lookup proposer: rows propose different
    lengths, many none), k is only each row's cap and `width` prices the step's actual
    proposals instead: the verified width that commits the most tokens per second, each row's
    proposal kept to it (choosing one k for the group as well capped long, sure proposals at the
    k that short ones and rows without a match pulled down: suffix decoding on the two-turn set
    at B = 8 ran at 0.93 of fixed k = 5, accepted length 3.23 vs 3.52; priced per step, 0.99).
    It does not probe neighbouring widths: proposals of every length measure widths as they
    come, and a probe cutting a proposal by one cost the n-gram proposer 1-2% at B = 1.
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
    WIDTH_PROBE_EVERY = 16  # speculative steps at a bucket per neighbour probe (doubles up to 128)
    DECAY = 0.9             # of the pool-wide acceptance counts, per speculative step
    HAZARD_DECAY = 0.98     # of the per-draft counts, per row-step (a memory of ~50 row-steps)
    STALE_DECAY = 0.95      # of the counts of drafts beyond the step's k, per row-step
    PRIOR_ROWS = 2.0        # pseudo row-steps pulling a draft's hazard toward the one before it
    # a bucket first met after another was priced measures plain decoding only where, at the
    # other's prices, speculation's rate is within this factor of plain's (widths' relative
    # prices differ less between buckets; measured anyway, the demo pair's B = 8 runs spent
    # four plain steps of ~25 at the 2-row bucket their last rows met, at half speculation's rate)
    MEASURE_PLAIN_WITHIN = 1.5
    # where speculation at k leads plain decoding by less than this, k's neighbour probe below
    # it is a plain step: from k >= 2 the probes otherwise go to k - 1 and k + 1 only, and a
    # plain price measured dear in a bucket's first steps (cold, short prompts, a slow moment)
    # kept a draft speculating at 0.88 of plain decoding's rate for good (the real pair at
    # B = 8 ran at 0.87x autoregressive once). Near a tie a plain step costs little.
    PLAIN_PROBE_WITHIN = 1.25
    # where speculation's rate is priced within this factor below plain decoding's, its probes
    # from plain decoding stay every PROBE_EVERY steps (not ever rarer): 1.25 cost a draft
    # running at 0.85 of plain decoding's rate 2% in probes
    SPEC_PROBE_WITHIN = 1.1

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.costs = StepCost()
        # per bucket: speculative steps since its last neighbour probe, and the next probe's side
        self.since_probe: dict[int, int] = {}
        self.probe_up: dict[int, bool] = {}
        self.probe_every_width: dict[int, int] = {}   # per bucket: the probes' current spacing
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

    def cost(self, batch: int, k: int) -> float | None:
        """A step's estimated seconds at k (StepCost); None before any step."""
        return self.costs.seconds(batch, k)

    def neighbour_probe(self, batch: int, k: int, cap: int, near_plain: bool) -> int:
        """k, or every WIDTH_PROBE_EVERY speculative steps at this bucket a neighbour of it
        within 0 .. cap (k + 1 and k - 1 in turn), so the widths around k stay measured.
        `near_plain`: speculation at k leads plain decoding by less than PLAIN_PROBE_WITHIN, so
        the step below k is a plain one (plain decoding is the width that decides)."""
        b = self.costs.bucket(batch)
        if k == 0 or not self.costs.priced(b):
            return k
        self.since_probe[b] = self.since_probe.get(b, 0) + 1
        if self.since_probe[b] < self.probe_every_width.get(b, self.WIDTH_PROBE_EVERY):
            return k
        self.since_probe[b] = 0
        up = self.probe_up[b] = not self.probe_up.get(b, False)
        below = 0 if near_plain else k - 1
        sides = [k + 1, below] if up else [below, k + 1]
        return next((n for n in sides if 0 <= n <= cap), k)

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

    def pricing(self, batch: int) -> "StepPricing":
        return StepPricing(self, batch)

    def width(self, batch: int, lengths: list[int], drafted: bool = True) -> int:
        """The verified width for proposals of these lengths (per row; a lookup proposer's)
        that commits the most tokens per second: at width w row r commits 1 + S_1 + ... +
        S_min(w, len_r), S_j the chance its first j proposed tokens are kept (`kept_hazards` of
        its length), for the step's cost at w; 0 is a plain step. Before the width is priced (plain decoding
        unmeasured at this bucket) every proposal is verified whole. A step cut to plain
        although rows proposed teaches nothing, so after `width_probe_every` of them in a row
        one is verified whole (twice as rarely each time, as `choose` probes)."""
        top = max(lengths, default=0)
        bucket = self.costs.nearest(batch)
        if top == 0 or bucket is None or not self.costs.priceable(bucket):
            return top
        pooled = self.kept_hazards()
        reach = {}   # per length n: expected tokens kept of such a proposal cut to 0 .. n
        for n in set(lengths) - {0}:
            survive, s = [0.0], 1.0
            for h in self.kept_hazards(n, pooled)[:n]:
                s *= 1.0 - h
                survive.append(survive[-1] + s)
            reach[n] = survive
        # `drafted`: the proposals cost a draft price per verified width (a lookup proposer's host
        # proposing); a hybrid's step on suffix decoding alone runs no draft forward
        rates = [sum(1.0 + (reach[n][min(w, n)] if n else 0.0) for n in lengths)
                 / (self.cost(batch, w) if drafted else self.costs.seconds(batch, w, 0))
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
        but for the plain steps that measure plain decoding at a bucket."""
        batch = len(group)
        here = self.costs.bucket(batch)
        unpriced = self.costs.has(here) and not self.costs.priced(here)
        if per_step:   # nothing to weigh here: `width` prices each step (a cut to plain measures it)
            return 0 if unpriced and not self.costs.priceable(here) else cap
        acceptance = group.acceptance(self.acceptance)
        # after a neighbour probe the group weighs from the k it left
        left, group.k_before_probe = group.k_before_probe, None
        if group.plain_probe_left and left is not None:
            # a plain probe near a tie measures PLAIN_SAMPLES plain steps (one moves no median),
            # each after a step at k: two plain steps in a row would make plain decoding the
            # yardstick, and its price would not be measured (StepCost)
            group.k_before_probe = left
            if group.k == 0:
                return min(left, cap)
            group.plain_probe_left -= 1
            return 0
        current = min(left if left is not None else group.k if group.k is not None else cap, cap)
        tokens = self.tokens_by_k(acceptance)
        costs = [self.cost(batch, k) for k in range(cap + 1)]
        if costs[0] is None:
            return current   # nothing measured yet: the first step tells
        rates = [batch * tokens[k] / costs[k] for k in range(cap + 1)]
        if current == 0 and group.plain_steps_in_a_row >= self.probe_every:
            # re-measure acceptance now and then at the k most likely to pay (at low acceptance
            # the cheapest probe, k = 1): more rarely each time where speculation is priced far
            # below plain decoding, every PROBE_EVERY plain steps near a tie, where one probe
            # moves acceptance little: with the wait doubling, 15 poor steps kept a group plain
            # for 110 steps where k = 1 leads by 8% (test_pool.py)
            probe = max(range(1, cap + 1), key=rates.__getitem__)
            far = rates[probe] * self.SPEC_PROBE_WITHIN < rates[0]
            self.probe_every = min(2 * self.probe_every, 256) if far else self.PROBE_EVERY
            return probe
        if unpriced and (not self.costs.priceable(here)
                         or max(rates[1:]) < self.MEASURE_PLAIN_WITHIN * rates[0]):
            return 0   # plain decoding, unmeasured at this bucket, could win: measure it
        best = max(range(cap + 1), key=rates.__getitem__)
        choice = best if rates[best] > rates[current] * self.GAIN_TO_SWITCH else current
        if choice > 0 and current > 0:
            self.probe_every = self.PROBE_EVERY   # speculation pays again: probe eagerly
        if left is not None and not self.costs.measured(here, group.k):
            self.probe_up[here] = not self.probe_up.get(here, False)   # it ran cold: that side again
        elif left is not None:   # a probe that left k where it was: probe half as often, up to 128
            spacing = self.probe_every_width.get(here, self.WIDTH_PROBE_EVERY)
            self.probe_every_width[here] = (min(2 * spacing, 8 * self.WIDTH_PROBE_EVERY)
                                            if choice == left else self.WIDTH_PROBE_EVERY)
        near_plain = choice > 0 and rates[choice] < self.PLAIN_PROBE_WITHIN * rates[0]
        probe = self.neighbour_probe(batch, choice, cap, near_plain)
        if probe != choice:
            group.k_before_probe = choice
        if probe == 0 and near_plain:
            group.plain_probe_left = self.costs.PLAIN_SAMPLES - 1
        return probe

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
        self.costs.observe(batch, k, seconds, draft_seconds)
        if k == 0:
            return
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


class StepPricing:
    """Adaptive k's prices for one group's next step, handed to the proposer's `plan`: what a
    host proposer's proposals are cut to (`width`), and a step's seconds at a width with so
    many draft forwards (`seconds`: the hybrid weighs drafting against suffix decoding alone)."""

    def __init__(self, adaptive: AdaptiveK, batch: int):
        self.adaptive, self.batch = adaptive, batch

    def width(self, lengths: list[int], drafted: bool = True) -> int:
        """The verified width that pays for proposals of these lengths (AdaptiveK.width);
        `drafted`: whether the step pays a draft price per width (no: suffix decoding alone in
        a hybrid, whose draft price is its model's forward)."""
        return self.adaptive.width(self.batch, lengths, drafted)

    def seconds(self, width: int, drafts: int) -> float | None:
        """A step's estimated seconds verifying `width` drafts after `drafts` draft forwards;
        None before this group's batch size has a price."""
        return self.adaptive.costs.seconds(self.batch, width, drafts)
