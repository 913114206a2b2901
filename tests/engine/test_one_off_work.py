"""One-off work stays off the step and out of adaptive k's prices: a long prompt's n-gram index or
suffix tree grows a bounded number of tokens a step (spec/lookup.py), the other rows' outputs
exact meanwhile; one outlier step moves adaptive k's choices for a few steps at most
(StepCost.OUTLIER)."""
from __future__ import annotations

import random

import pytest

from exspec import SamplingParams
from exspec.engine.adaptive_k import AdaptiveK
from exspec.spec.ngram import NgramProposer
from exspec.spec.suffix import SuffixProposer

from enginekit import make_engine
from test_ngram import cyclic  # noqa: F401 (the fixture)

BUDGET, K = 16, 4


def indexed(proposer) -> dict[str, int]:
    """Per live row (by request id), how many of its tokens its index or tree covers."""
    if isinstance(proposer, NgramProposer):
        return {row.request_id: index.covered for row, index in proposer.indexes.items()}
    return {row.request_id: tree._covered[0] for row, tree in proposer.local.items()}


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_a_long_prompt_is_indexed_a_bounded_number_of_tokens_a_step(pairs, cyclic, proposer):
    """A 200-token prompt joining a running row (the budget scaled down to 16 tokens a step, so
    a tiny model's 256 positions hold the case): no step indexes more than the budget beyond
    what a step commits per row, the prompt is indexed whole in the end, and both outputs
    equal target-only greedy."""
    target, _ = cyclic
    engine = make_engine(pairs, target_model=target, draft_model=None, proposer=proposer,
                         num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=2)
    engine.proposer.index_budget = BUDGET
    plain = make_engine(pairs, target_model=target, draft_model=None, method="autoregressive",
                        num_speculative_tokens=0)
    rng = random.Random(3)
    short, long = [5, 6, 7], [rng.randrange(1, 64) for _ in range(200)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {"short": [], "long": []}
    engine.add_request("short", short, params)
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    engine.add_request("long", long, params)
    # what a step indexed, read off the rows' indexes (a row that ended is gone from them) and
    # as the engine counts it
    before, counted = indexed(engine.proposer), engine.stats()["indexed_tokens"]
    most = most_counted = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
        now = indexed(engine.proposer)
        most = max(most, sum(n - before.get(r, 0) for r, n in now.items()))
        most_counted = max(most_counted, engine.stats()["indexed_tokens"] - counted)
        before, counted = {**before, **now}, engine.stats()["indexed_tokens"]
    assert before["long"] >= len(long), f"the long prompt indexed {before['long']} of {len(long)}"
    bound = BUDGET + 2 * (K + 1)   # the budget, and each row's tokens of one step
    assert most <= bound, f"{proposer}: a step indexed {most} tokens, more than {bound}"
    assert most <= most_counted <= bound, (most, most_counted)
    for rid, prompt in (("short", short), ("long", long)):
        [reference] = plain.generate([prompt], params)
        assert outs[rid] == reference.token_ids, f"{proposer}: request {rid} differs"


def test_the_default_budgets_scale_with_each_tokens_cost():
    """Per step: 256 tokens into a depth-24 suffix tree, 1,024 positions of n-grams 2-4;
    fewer as a token costs more (deeper trees, more n's)."""
    assert SuffixProposer(max_tree_depth=24).index_budget == 256
    assert SuffixProposer(max_tree_depth=64).index_budget == 96
    assert NgramProposer(2, 4).index_budget == 1024
    assert NgramProposer(1, 16).index_budget == 192


class Group:
    """What AdaptiveK reads of a group stepping a lookup proposer: its size."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def run_lookup_steps(ak: AdaptiveK, steps: int, slow_step: int | None = None) -> list[int]:
    """Steps as the scheduler runs them for a lookup proposer, at recorded prices (a plain step
    10 ms, each verified column 0.5 ms more, proposing 0.3 ms); rows propose 4, 4, 3 and 0
    tokens and keep 4, 4, 1. `slow_step`: that step also takes 0.8 s more, all of it drafting
    (a 16k-token prompt's suffix tree built in the draft timer, as it was). Returns each
    step's verified width."""
    batch, lengths, kept = 4, [4, 4, 3, 0], [4, 4, 1, 0]
    widths = []
    for step in range(steps):
        cap = ak.choose(Group(batch), K, per_step=True)
        width = ak.width(batch, lengths) if cap else 0
        extra = 0.8 if step == slow_step else 0.0
        if width == 0:
            ak.observe(batch, 0, 0.010, 0.0, [0] * batch)
        else:
            proposed = [min(n, width) for n in lengths]
            ak.observe(batch, width, 0.010 * (1 + 0.05 * width) + 0.0003 + extra, 0.0003 + extra,
                       [min(a, width) for a in kept], proposed, lengths)
        widths.append(width)
    return widths


def test_one_slow_step_moves_adaptive_k_for_at_most_ten_steps():
    """The real AdaptiveK at recorded prices: after one step 80x its usual time, all of it in
    drafting, the widths chosen are the ones chosen before it within 10 steps (counted whole,
    the draft price rose 30x and plain decoding ran until probes, ever rarer, repriced it)."""
    steady = run_lookup_steps(AdaptiveK(K), 80)
    choice = steady[-1]
    assert choice > 0 and steady[-20:] == [choice] * 20, steady
    ak = AdaptiveK(K)
    widths = run_lookup_steps(ak, 80 + 40, slow_step=80)
    after = widths[81 + 10:]
    assert after == [choice] * len(after), f"widths after the slow step: {widths[81:]}"
