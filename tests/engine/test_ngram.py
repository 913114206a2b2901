"""The n-gram proposer (prompt lookup, no draft model), beyond the conformance battery every
proposer runs (test_proposers.py: greedy and seeded equal target-only, both methods, B 1/4/8,
arrivals, aborts, penalties, grammars, n > 1, prefix hits): the compiled path, ragged proposals
on a context-sensitive target; each row verifies only its own proposal, so a row without a match
feeds the target one token; adaptive k counts only what was proposed.

Random tiny targets seldom repeat themselves, so most tests use a *cyclic* target: a Llama whose
layers barely touch the residual (scaled by LEAK) and whose head maps token x to its successor in
a fixed permutation of short cycles. Its greedy output follows the cycles, which the proposer
learns from the output itself; prompts walk a cycle with one token changed, so a proposal read
from the prompt is accepted up to the change and rejected there.
"""
import random

import pytest
import torch

from exspec import SamplingParams
from exspec.models import compiled
from exspec.demo.tiny import build_tokenizer, llama
from exspec.spec.ngram import NgramIndex, NgramProposer
from exspec.engine.runner import ModelRunner
from exspec.engine.adaptive_k import AdaptiveK
from exspec.engine.step_cost import StepCost

from enginekit import assert_equivalent, make_engine, make_prompts
from test_pool import G
from test_transfers import assert_within_budget, audited_run

CYCLE, LEAK, GAIN = 6, 0.01, 8.0


def cyclic_target(path, vocab: int) -> list[int]:
    """Save the cyclic target at `path`; returns each token's successor."""
    model = llama(vocab, seed=5, layers=2, hidden=64, heads=4, kv_heads=2, max_positions=256)
    rng = random.Random(0)
    order = list(range(1, vocab))   # 0 is EOS: never reached
    rng.shuffle(order)
    successor = [0] * vocab
    for i in range(0, len(order), CYCLE):
        cycle = order[i:i + CYCLE]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            successor[a] = b
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LEAK)
            layer.mlp.down_proj.weight.mul_(LEAK)
        embed = model.model.embed_tokens.weight
        unit = embed / embed.norm(dim=-1, keepdim=True)
        model.lm_head.weight.copy_(GAIN * unit[torch.tensor(successor).argsort()])
    model.save_pretrained(path)
    return successor


@pytest.fixture(scope="module")
def cyclic(pairs, tmp_path_factory):
    path = tmp_path_factory.mktemp("cyclic") / "target"
    successor = cyclic_target(path, len(build_tokenizer()))
    return str(path), successor


def walk_prompts(successor, count: int, seed: int = 0) -> list[list[int]]:
    """A walk along a cycle with one token changed, then its first two tokens again."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        walk = [rng.randrange(1, len(successor))]
        for _ in range(rng.randint(7, 12)):
            walk.append(successor[walk[-1]])
        walk[rng.randint(3, len(walk) - 2)] = rng.randrange(1, len(successor))
        prompts.append(walk + walk[:2])
    return prompts


def ngram_engine(pairs, target, **overrides):
    config = dict(target_model=target, draft_model=None, proposer="ngram", prompt_lookup_max=3,
                  prompt_lookup_min=2, num_speculative_tokens=4)
    return make_engine(pairs, **{**config, **overrides})


def scan_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by rescanning the history: the latest earlier occurrence (one that
    something follows) of the longest suffix, n from max_n down to min_n."""
    last = len(tokens)
    for n in range(min(max_n, last - 1), min_n - 1, -1):
        for start in range(last - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[last - n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (2, 4), (1, 5)])
def test_the_incremental_index_proposes_what_a_rescan_proposes(min_n, max_n):
    """A row's index is extended as the row grows (by 1 to 6 tokens a step); at every length
    its proposal equals the rescan's, on histories that repeat (a small vocabulary)."""
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(20):
        tokens, index = [], NgramIndex(min_n, max_n)
        while len(tokens) < 300:
            tokens += [rng.randrange(4 + trial % 5) for _ in range(rng.randint(1, 6))]
            k = rng.randint(1, 5)
            assert index.lookup(tokens, k) == scan_lookup(tokens, k, min_n, max_n), (trial, len(tokens))


def test_a_rows_index_lives_until_its_request_ends(pairs, cyclic):
    target, successor = cyclic
    engine = ngram_engine(pairs, target)
    proposer = engine.runner.proposer
    engine.add_request("r", walk_prompts(successor, 1)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step(), engine.step()
    assert len(proposer.indexes) == 1
    while engine.has_unfinished():
        engine.step()
    assert len(proposer.indexes) == 0


def test_proposer_proposes_what_followed_the_latest_longest_match():
    propose = NgramProposer(min_n=2, max_n=3).lookup
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]   # the latest of two 3-gram matches
    assert propose([4, 2, 3, 8, 1, 2, 3], 3) == [8, 1, 2]               # 3-grams miss, a 2-gram matches
    assert propose([1, 2, 3, 4, 5, 6], 4) == []                          # nothing repeats
    assert propose([5, 5, 5], 4) == [5]                                  # runs up to the end
    assert propose([1, 2, 3, 1, 2], 0) == []


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_ragged_proposals_on_a_context_sensitive_target_match_target_greedy(pairs, reference, method):
    """A random target (every token depends on all before it, at its position): single-token
    matches make many proposals of every length, nearly all rejected."""
    prompts = make_prompts(320, pairs["gpt2", "eos"], seed=21, count=8)
    engine = ngram_engine(pairs, pairs["gpt2", "target"], method=method, prompt_lookup_min=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert_equivalent(outs, prompts, [30] * len(prompts), reference, pairs["gpt2", "target"], 128, method)
    assert engine.stats()["draft_tokens"] > 20


def test_unshifted_ragged_logits_break_equivalence(pairs, cyclic, reference, monkeypatch):
    """Negative control: read each row's verified logits from the first columns of its
    left-padded verification instead of shifting them by its padding."""
    original = torch.Tensor.gather

    def no_shift(self, dim, index, *args, **kwargs):
        return original(self, dim, index - index[:, :1], *args, **kwargs)

    def verify_unshifted(self, *args, **kwargs):
        monkeypatch.setattr(torch.Tensor, "gather", no_shift)
        try:
            return verify(self, *args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "gather", original)

    verify = ModelRunner._verify_ragged
    monkeypatch.setattr(ModelRunner, "_verify_ragged", verify_unshifted)
    target, successor = cyclic
    prompts = walk_prompts(successor, 6, seed=4)
    outs = ngram_engine(pairs, target, max_batch_size=4).generate(prompts, SamplingParams(max_tokens=24))
    with pytest.raises(AssertionError, match="differs at output position"):
        assert_equivalent(outs, prompts, [24] * len(prompts), reference, target, 256)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_each_row_feeds_the_target_only_its_own_proposal(pairs, cyclic, method):
    """Counted on the target's forwards: a step feeds each row its pending token and its own
    proposal, nothing for the other rows' longer ones; a step where no row matched is plain."""
    target, successor = cyclic
    engine = ngram_engine(pairs, target, method=method, max_batch_size=4)
    fed, steps = [], []   # real tokens per target step forward; per step, each row's proposal
    forward, propose, step = engine.runner.forward, engine.runner.proposer.propose_indexed, engine.runner.step

    def counting_forward(model, kv, ids, pos, valid, counts, keep, decode=True):
        if decode:
            fed.append(sum(counts))
        return forward(model, kv, ids, pos, valid, counts, keep, decode=decode)

    def recording_propose(row, k):
        steps[-1].append(propose(row, k))
        return steps[-1][-1]

    def recording_step(group, k, *args):
        steps.append([])
        return step(group, k, *args)

    engine.runner.forward = counting_forward
    engine.runner.proposer.propose_indexed, engine.runner.step = recording_propose, recording_step
    # two rows that follow the cycles (they propose) and two random ones (they seldom match)
    prompts = walk_prompts(successor, 2) + make_prompts(320, 0, seed=3, count=8)[-2:]
    engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(fed) == len(steps) == engine.stats()["steps"]
    assert fed == [len(rows) + sum(map(len, rows)) for rows in steps]
    assert any(min(map(len, rows)) == 0 < max(map(len, rows)) for rows in steps), \
        "no step mixed rows with and without a match"
    fed.clear(), steps.clear()   # random rows alone: steps where neither matched are plain
    engine.generate(prompts[2:], SamplingParams(max_tokens=20, ignore_eos=True))
    assert fed == [len(rows) + sum(map(len, rows)) for rows in steps]
    assert any(fed_here == len(rows) == 2 for fed_here, rows in zip(fed, steps)), "no step was plain"


def test_adaptive_k_counts_a_proposal_that_ends_early_as_rejected_after_it():
    """A row that proposed n < k drafts committed nothing at depth n + 1, so the hazards give
    the yield per row-step, rows without a match included: a proposer that seldom matches
    loses to a cheaper plain step (counting only the rows that proposed, it kept speculating on
    open-ended prompts at B = 8 on the real pair: 0.90x autoregressive)."""
    adaptive = AdaptiveK(4)
    adaptive.observe(batch=3, k=4, seconds=1.0, draft_seconds=0.0, accepted=[4, 0, 2], proposed=[4, 0, 2])
    assert adaptive.verified == [3.0, 2.0, 2.0, 1.0]
    assert adaptive.rejected == [1.0, 0.0, 1.0, 0.0]
    # 8 rows: one matches and keeps all 4 proposals every step, 7 propose nothing
    seldom = AdaptiveK(4)
    for _ in range(30):
        seldom.observe(8, 4, 1.6, 0.0, [4] + [0] * 7, [4] + [0] * 7)
    seldom.observe(8, 0, 1.0, 0.0, [0] * 8)          # a plain step: 1 / 1.6 of a speculative one
    assert seldom.tokens_by_k(seldom.acceptance)[4] < 1.6   # 1 + 4/8 measured, not 5
    # wide speculation is ruled out (k = 4: ~1.5 tokens a row-step for 1.6 s); priced by width
    # (a plain step 1.0 s, each more verified column 0.15 s), k = 1's 1.16 tokens for 1.15 s is
    # on a par with plain decoding, so either may follow
    assert seldom.choose(G(8, 4, seldom.acceptance), 4) in (0, 1)


def test_adaptive_k_keeps_speculating_on_repeats(pairs, cyclic):
    target, successor = cyclic
    engine = ngram_engine(pairs, target, adaptive_k=True, max_batch_size=4)
    engine.generate(walk_prompts(successor, 4, seed=7), SamplingParams(max_tokens=40))
    assert engine.stats()["mean_accepted_length"] > 2.0


@pytest.mark.parametrize("method", [pytest.param("eqspec", marks=pytest.mark.slow), "exspec"])
def test_compiled_ngram_path_matches_target_greedy(pairs, cyclic, reference, monkeypatch, method):
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    target, successor = cyclic
    prompts = walk_prompts(successor, 4, seed=9)
    engine = ngram_engine(pairs, target, method=method, max_batch_size=3, enforce_eager=False)
    assert engine.warm_up.graphs > 0, "nothing was compiled"
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    torch._dynamo.reset()
    assert_equivalent(outs, prompts, [20] * len(prompts), reference, target, 256, f"compiled {method}")
    assert engine.stats()["accepted_tokens"] > 0


def test_rejection_coupling_keeps_greedy_rows_exact_beside_sampled_ones(pairs, cyclic, reference):
    """Under rejection sampling q is one-hot at the proposed token: a greedy row accepts exactly
    the target's argmax, whatever the sampled rows beside it do."""
    target, successor = cyclic
    prompts = walk_prompts(successor, 4, seed=11)
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.9, seed=1),
              SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=1.1, seed=2)]
    engine = ngram_engine(pairs, target, sampling_coupling="rejection", max_batch_size=4)
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs)
    assert_equivalent(outs[::2], prompts[::2], [20, 20], reference, target, 256, "rejection")
    assert engine.stats()["accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_ngram_steps_copy_once_each_way(pairs, cyclic, reference, method):
    """Proposals are made on the host, so they ride the step's one upload with the pending
    tokens (design: "The fast decode path"): rows arriving and leaving, greedy and sampled."""
    target, successor = cyclic
    prompts = walk_prompts(successor, 6, seed=13)
    engine = ngram_engine(pairs, target, method=method, max_batch_size=4)
    arrivals = {0: [("r0", prompts[0]), ("r1", prompts[1])], 3: [("r2", prompts[2])],
                5: [("r3", prompts[3]), ("r4", prompts[4]), ("r5", prompts[5])]}
    params = {f"r{i}": SamplingParams(max_tokens=8 + 3 * i, seed=i, temperature=0.9 if i % 2 else 0.0)
              for i in range(6)}
    outputs, finished, records, ticks = audited_run(engine, arrivals, {}, params)
    assert_within_budget(records, ticks, f"ngram {method}:")
    assert engine.stats()["accepted_tokens"] > 0
    for i in range(0, 6, 2):   # the greedy rows: target-only output
        tokens = [t for out in outputs[f"r{i}"] for t in out.new_token_ids]
        assert tokens == reference(target, prompts[i], params[f"r{i}"].max_tokens), f"r{i}"


def priced_adaptive(keeping: int, gamma: float = 0.5) -> AdaptiveK:
    """AdaptiveK after steps of 8 rows at k = 3 on a verifier whose plain step costs 1 s and each
    more verified column `gamma` s, where every row proposes 3 tokens and `keeping` rows of 8
    keep them all, the others none."""
    adaptive = AdaptiveK(5)
    for _ in range(20):
        adaptive.observe(8, 3, 1.0 + gamma * 3, 0.0, [3] * keeping + [0] * (8 - keeping), [3] * 8)
    for _ in range(1 + StepCost.PLAIN_SAMPLES):   # plain steps price the width (the first runs cold)
        adaptive.observe(8, 0, 1.0, 0.0, [0] * 8)
    return adaptive


def test_proposals_known_before_the_step_are_verified_only_as_wide_as_pays():
    """AdaptiveK.width, for lookup proposers: each row commits its pending token at any width,
    so two rows of eight proposing one token they keep a quarter of the time do not pay for a
    column costing half a step (a plain step instead), and all eight proposing tokens they keep
    7 times in 8 do; before plain decoding is measured (width unpriced) proposals go whole."""
    assert AdaptiveK(5).width(8, [1, 0, 3]) == 3
    weak = priced_adaptive(keeping=2)
    assert weak.costs.relative(8, 1) == pytest.approx(1.5)   # a column: half a plain step
    assert weak.kept_hazards()[0] == pytest.approx(0.75, abs=0.02)
    assert weak.width(8, [1, 1, 0, 0, 0, 0, 0, 0]) == 0
    strong = priced_adaptive(keeping=7)
    assert strong.width(8, [3] * 8) == 3
    assert strong.width(8, [3, 1] + [0] * 6) == 0, "two proposing rows of eight: a column costs more"
    cheap = priced_adaptive(keeping=7, gamma=0.02)   # a memory-bound verifier: width nearly free
    assert cheap.width(8, [3, 1] + [0] * 6) == 3


def test_a_batch_size_met_later_prices_proposals_with_the_borrowed_prices():
    """A lookup proposer's rows at a batch size not priced yet, once another is: `choose` gives
    the cap (no plain steps forced) and `width` cuts as the priced bucket's prices say, scaled
    to this bucket's running width, instead of verifying every proposal whole."""
    from exspec.engine.group import Group
    weak = priced_adaptive(keeping=2)   # bucket 8: a column costs half a plain step
    for _ in range(2):   # bucket 2's first (cold) and first warm step, at k = 3
        weak.observe(2, 3, 1.25, 0.0, [0, 0], [3, 3])
    assert weak.costs.has(2) and not weak.costs.priced(2) and weak.costs.donor(2) == 8
    assert weak.costs.relative(2, 1) == pytest.approx(1.5 / 2.5)   # k = 1 over k = 3, as at B = 8
    rows = Group([], None, None)
    rows.seqs = [None, None]
    assert weak.choose(rows, 5, per_step=True) == 5
    assert weak.width(2, [1, 0]) == 0, "one row proposing a token kept a quarter of the time"
    assert AdaptiveK(5).width(2, [1, 0]) == 1, "nothing priced anywhere: proposals go whole"


def test_a_width_cut_to_plain_is_probed_again_more_rarely_each_time():
    weak = priced_adaptive(keeping=2)
    widths = [weak.width(8, [2] + [0] * 7) for _ in range(8 + 16 + 1)]
    assert widths.count(2) == 2 and widths[7] == 2 and widths[23] == 2, widths


def test_a_probe_after_plain_steps_verifies_proposals_whole():
    """The first speculative step after a plain one (with a draft model adaptive k's probe;
    with lookup proposals the step after the one that measures plain decoding) is there to
    measure: its width is not priced, else a pessimistic price would cut it to plain and never
    learn otherwise."""
    from exspec.config import EngineConfig
    from exspec.engine.group import Group
    from exspec.engine.scheduler import Scheduler
    from exspec.spec.ngram import NgramProposer
    config = EngineConfig(target_model="t", draft_model=None, proposer="ngram", method="exspec",
                          adaptive_k=True)
    scheduler = Scheduler(config, NgramProposer(2, 3))
    group = Group([], None, None)
    group.k = 3
    assert scheduler.pricing(group) is not None
    group.k = 0
    assert scheduler.pricing(group) is None


def test_proposals_are_priced_by_their_own_length():
    """A lookup proposer proposes long where it is sure: here one row of eight proposes 5 tokens
    and keeps them all, seven propose 1 and lose it; each more verified column costs 5% of a
    plain step. Priced at one rate for every length (7 of 8 first tokens lost) the long proposal
    would be cut to plain; priced by its length it is verified whole, and a lone one-token
    proposal is still cut."""
    adaptive = AdaptiveK(5)
    for _ in range(20):
        adaptive.observe(8, 5, 1.0 + 0.05 * 5, 0.0, [5] + [0] * 7, [5] + [1] * 7)
    for _ in range(1 + StepCost.PLAIN_SAMPLES):
        adaptive.observe(8, 0, 1.0, 0.0, [0] * 8)
    assert adaptive.kept_hazards()[0] > 0.8 and adaptive.kept_hazards(5)[0] < 0.25
    assert adaptive.width(8, [5] + [0] * 7) == 5
    assert adaptive.width(8, [1] + [0] * 7) == 0


def test_a_cut_proposal_counts_toward_its_own_length_not_the_cut():
    """Sure 5-token proposals cut to 3 (every verified token kept) and genuine 3-token guesses
    (the first token lost) at B = 8: the cut proposals' kept tokens count toward length 5, so
    3-token proposals look as unsure as they are and 5-token ones as sure. Counted at the cut
    length they made 3-token proposals look sure and left length 5 unmeasured (prior-driven)."""
    adaptive = AdaptiveK(5)
    for _ in range(20):
        adaptive.observe(8, 3, 1.0 + 0.05 * 3, 0.0, [3] * 4 + [0] * 4, [3] * 8, [5] * 4 + [3] * 4)
    assert adaptive.kept_hazards(5)[0] < 0.1 and adaptive.kept_hazards(3)[0] > 0.8
    assert sum(adaptive.proposed_verified[2]) == pytest.approx(sum(adaptive.proposed_rejected[2]))
    # rows that proposed as long as they were verified: as before
    plain = AdaptiveK(5)
    for _ in range(20):
        plain.observe(8, 3, 1.15, 0.0, [3] * 4 + [0] * 4, [3] * 8)
    assert plain.kept_hazards(3)[0] == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_cut_proposals_reach_adaptive_k_at_their_proposed_length(pairs, cyclic, reference,
                                                                 monkeypatch, method):
    """Through the engine, with every priced step cut to 2 while rows propose up to 4: each
    step's observation carries, per row, the length it proposed beside what was verified, and
    what they differ by is exactly the tokens the steps cut (`cut_proposal_tokens`); outputs
    stay the target's. (Without the plumbing adaptive k would silently count cut proposals at
    the cut length again.)"""
    target, successor = cyclic
    seen = []
    observe = AdaptiveK.observe

    def spy(self, batch, k, seconds, draft_seconds, accepted, proposed=None, lengths=None):
        if k:
            seen.append((proposed, lengths))
        return observe(self, batch, k, seconds, draft_seconds, accepted, proposed, lengths)
    monkeypatch.setattr(AdaptiveK, "observe", spy)
    monkeypatch.setattr(AdaptiveK, "width", lambda self, batch, lengths, drafted=True: min(2, max(lengths)))
    engine = ngram_engine(pairs, target, method=method, adaptive_k=True, max_batch_size=4)
    prompts = walk_prompts(successor, 6, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert_equivalent(outs, prompts, [30] * len(prompts), reference, target, 256, method)
    cut = engine.stats()["cut_proposal_tokens"]
    assert cut > 0 and all(lengths is not None for _, lengths in seen)
    assert sum(length - n for proposed, lengths in seen
               for n, length in zip(proposed, lengths)) == cut
    assert any(length > n for proposed, lengths in seen for n, length in zip(proposed, lengths))


def test_with_proposals_known_before_the_step_k_is_only_the_rows_cap():
    """Per step (a lookup proposer), adaptive k leaves the pricing to `width` and k is the cap:
    plain steps first measure plain decoding at the bucket, then k stays at the cap even
    where rows keep little (the group-level choice would fall to plain: `width` cuts what does
    not pay, proposal by proposal)."""
    weak = AdaptiveK(5)
    for _ in range(20):
        weak.observe(8, 3, 2.5, 0.0, [0] * 8, [3] + [0] * 7)
    assert weak.choose(G(8, 3, weak.acceptance), 5, per_step=True) == 0, "plain unmeasured: measure it"
    for _ in range(StepCost.PLAIN_SAMPLES):   # the first ran cold; the last prices the width
        weak.observe(8, 0, 1.0, 0.0, [0] * 8)
        assert weak.choose(G(8, 3, weak.acceptance), 5, per_step=True) == 0, "plain still measured"
    weak.observe(8, 0, 1.0, 0.0, [0] * 8)
    assert weak.choose(G(8, 3, weak.acceptance), 5) == 0
    assert weak.choose(G(8, 3, weak.acceptance), 5, per_step=True) == 5
    assert weak.width(8, [3] + [0] * 7) == 0
