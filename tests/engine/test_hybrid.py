"""Suffix decoding with an EAGLE-3 head (spec/hybrid.py): each row, each step, takes the proposal
expected to keep more, through the one verification. Its exactness is the conformance suite's
(test_proposers.py's "eagle3_suffix" case: greedy, seeded, both methods, batch 1 to 8, arrivals,
aborts, every feature); here: that a run takes both sources, that the choice follows the rule
and learns from what was kept, and its configuration's spelling.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from exspec import EngineConfig, SamplingParams
from exspec.spec.hybrid import Eagle3SuffixProposer as HybridProposer, HybridPlan
from exspec.spec.lookup import StandaloneRow
from exspec.spec.suffix import SuffixProposer
from exspec.utils.stats import Stats
from exspec.vllm_args import translate

from exspec.spec.proposer import Proposal
from exspec.utils.transfer import Transfers, Upload

from enginekit import assert_equivalent, assert_seeded_equivalent
from test_eagle3 import deep  # noqa: F401 (a fixture)
from test_proposers import PROPOSERS, assert_exact_through_arrivals_and_aborts, eagle3_suffix, engine_for, seeded


class _Model:
    """The model proposer's part of a step the choice never reads (its drafts, its cache)."""
    models = kv_models = ()
    vocab = None

    def commit(self, state, width, accepted, kept):
        pass

    commit_undrafted = commit


def _hybrid() -> HybridProposer:
    return HybridProposer(_Model(), SuffixProposer(max_tree_depth=8))


RUNNER = SimpleNamespace(stats=Stats(["cpu"]))
REPEATS = StandaloneRow([5, 6, 7, 8, 9] * 4 + [5, 6], 22)       # suffix decoding: 7 8 9 5, sure
UNSEEN = StandaloneRow([11, 3, 17, 40, 2, 29, 13, 31, 19, 23], 10)   # no match: the head's


def test_each_row_takes_the_source_expected_to_keep_more():
    hybrid = _hybrid()
    plan = hybrid.plan(RUNNER, [REPEATS, UNSEEN], 4)
    assert isinstance(plan, HybridPlan) and plan.width == 4
    assert plan.suffix == [[7, 8, 9, 5], []]
    assert plan.caps == [4, 4]
    # the rule: suffix decoding's calibrated score against the head's expected kept at the cap
    assert hybrid.suffix_expected(REPEATS, plan.scores[0]) > hybrid.head_expected(REPEATS, 4)
    assert hybrid.chosen == {"suffix": 1, "head": 1, "plain": 0}
    # a row on suffix decoding alone: the step verifies its proposal's width, not k
    assert hybrid.plan(RUNNER, [REPEATS], 4).width == 4
    assert hybrid.plan(RUNNER, [REPEATS], 3).width == 3


def test_a_head_that_keeps_everything_takes_the_row_back_from_suffix_decoding():
    """The estimates move with what the verification kept: the head, told it keeps all 4 drafts
    of the unseen row step after step, comes to beat suffix decoding's sure proposal (whose
    score is at most 4, while the head at 4 drafts approaches 4 too, then a suffix proposal
    that keeps nothing of its score loses)."""
    hybrid = _hybrid()
    seqs = [REPEATS, UNSEEN]
    for _ in range(30):
        hybrid.plan(RUNNER, seqs, 4)
        hybrid.commit(None, 4, [0, 4], torch.tensor([0, 4]))   # suffix kept 0, the head 4
    plan = hybrid.plan(RUNNER, seqs, 4)
    assert plan.suffix == [[], []], "suffix decoding kept nothing of its score: the head's row"
    assert hybrid.head_expected(REPEATS, 4) > hybrid.suffix_expected(REPEATS, plan.scores[0])


def test_a_row_seen_to_keep_suffix_proposals_while_the_head_misses_stays_on_suffix_decoding():
    hybrid = _hybrid()
    for _ in range(30):
        plan = hybrid.plan(RUNNER, [REPEATS], 4)
        hybrid.commit(None, 4, [4 if plan.suffix[0] else 0], torch.tensor([4]))
    assert hybrid.plan(RUNNER, [REPEATS], 4).suffix == [[7, 8, 9, 5]]


class _Prices:
    """Adaptive k's prices as the plan reads them: a verification 1 s plus 0.1 s a column, and
    `draft` seconds a draft forward."""

    def __init__(self, draft: float):
        self.draft = draft

    def width(self, lengths, drafted=True):
        return max(lengths)

    def seconds(self, width, drafts):
        return 1.0 + 0.1 * width + self.draft * drafts


def test_where_drafts_cost_more_than_they_add_the_step_runs_on_suffix_decoding_alone():
    """REPEATS takes suffix decoding, UNSEEN the head. With drafts cheap the head drafts (a
    mixed step at k); priced dear (a draft forward as dear as the verification) the step
    verifies REPEATS' proposal alone and UNSEEN its pending token: no drafts, width 4, UNSEEN's
    cap 0. A row whose weaker suffix proposal lost to the head takes it in such a step."""
    mixed = _hybrid().plan(RUNNER, [REPEATS, UNSEEN], 4, _Prices(draft=0.0))
    assert mixed.drafts and mixed.caps == [4, 4] and mixed.suffix == [[7, 8, 9, 5], []]
    hybrid = _hybrid()
    alone = hybrid.plan(RUNNER, [REPEATS, UNSEEN], 4, _Prices(draft=1.5))
    assert not alone.drafts and alone.width == 4 and alone.caps == [4, 0]
    assert alone.tokens == [[7, 8, 9, 5], []] and hybrid.chosen == {"suffix": 1, "head": 0, "plain": 1}
    # the head expected to keep everything: REPEATS' sure proposal loses to it row by row, yet
    # with drafts dear the step verifies that proposal rather than draft
    keen = _hybrid()
    keen.head_expected = lambda row, cap: float(cap)
    assert keen.plan(RUNNER, [REPEATS], 4, _Prices(draft=0.0)).suffix == [[]]
    alone = keen.plan(RUNNER, [REPEATS], 4, _Prices(draft=10.0))
    assert alone.tokens == [[7, 8, 9, 5]] and not alone.drafts and alone.offered == [[]]
    # nothing for suffix decoding to verify: the head drafts whatever it costs
    assert _hybrid().plan(RUNNER, [UNSEEN], 4, _Prices(draft=10.0)).drafts


def test_a_step_on_suffix_decoding_alone_verifies_the_width_that_pays():
    """Without drafts the proposals are priced as a lookup proposer's (adaptive k's width, with
    no draft price): cut to it, their lengths before the cut reported (adaptive k counts what
    was kept per proposed length), and a cut proposal teaches the suffix estimates nothing (its
    score was for the whole). Priced at 0: a plain step."""
    widths = []

    class Cut(_Prices):
        def width(self, lengths, drafted=True):
            widths.append((lengths, drafted))
            return 2
    hybrid = _hybrid()
    plan = hybrid.plan(RUNNER, [REPEATS, UNSEEN], 4, Cut(draft=1.5))
    assert widths == [([4, 0], False)]
    assert (plan.width, plan.tokens, plan.caps, plan.lengths) == (2, [[7, 8], []], [2, 0], [4, 0])
    before = hybrid._row(REPEATS).suffix.trials[:]
    hybrid.commit(None, 2, [2, 0], torch.tensor([2, 0]))
    assert hybrid._row(REPEATS).suffix.trials == before, "a cut proposal's score is not its"

    class Plain(_Prices):
        def width(self, lengths, drafted=True):
            return 0
    assert hybrid.plan(RUNNER, [REPEATS, UNSEEN], 4, Plain(draft=1.5)).width == 0


def test_a_constrained_row_always_takes_the_heads_drafts():
    hybrid = _hybrid()
    row = StandaloneRow(list(REPEATS.tokens), 22)
    row.grammar = object()   # its masks follow the head's drafts (hybrid.py)
    assert hybrid.plan(RUNNER, [row], 4).suffix == [[]]
    # and its group drafts however dear drafts are priced
    assert hybrid.plan(RUNNER, [REPEATS, row], 4, _Prices(draft=10.0)).drafts


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("name", ["eagle3_suffix", "draft_model_suffix"])
def test_one_run_takes_both_sources_and_stays_exact(pairs, reference, method, name):
    """The conformance case's prompts at batch 4 (some asked again): rows take suffix decoding
    in some steps and the model in others, and every output is the target's."""
    case = (name, *PROPOSERS[name](pairs, None))
    _, target, _, prompts = case
    engine = engine_for(pairs, case, method, max_batch_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert_equivalent(outs, prompts, [40] * len(prompts), reference, target, 256, f"hybrid {method}")
    chosen = engine.proposer.chosen
    assert chosen["suffix"] > 0 and chosen["head"] > 0, chosen
    stats = engine.stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]


def test_model_json_takes_the_hybrid_with_vllms_eagle3_and_suffix_keys():
    out, _ = translate({"model": "/t", "speculative_config": {
        "method": "eagle3_suffix", "model": "/h", "num_speculative_tokens": 4,
        "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.2}})
    assert (out["proposer"], out["draft_model"], out["num_speculative_tokens"]) == ("eagle3_suffix", "/h", 4)
    assert (out["suffix_decoding_max_tree_depth"], out["suffix_decoding_min_token_prob"]) == (16, 0.2)
    with pytest.raises(ValueError, match="the EAGLE-3 head's folder"):
        translate({"model": "/t", "speculative_config": {"method": "eagle3_suffix"}})
    with pytest.raises(ValueError, match="only for method 'suffix' or 'eagle3_suffix'"):
        translate({"model": "/t", "speculative_config": {
            "method": "eagle3", "model": "/h", "suffix_decoding_max_tree_depth": 16}})
    with pytest.raises(ValueError, match="proposer 'eagle3_suffix' needs draft_model"):
        EngineConfig(target_model="/t", proposer="eagle3_suffix")
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        EngineConfig(target_model="/t", draft_model="/h", proposer="eagle3_suffix",
                     suffix_decoding_max_tree_depth=0)
    config = EngineConfig(target_model="/t", draft_model="/h", proposer="eagle3_suffix",
                          suffix_decoding_max_tree_depth=16)
    assert config.speculative_config.suffix_decoding_max_tree_depth == 16


def _alone_every_other_step(monkeypatch):
    """The priced choice forced: every other step runs on suffix decoding alone (rows without a
    proposal verify nothing, a step where none has one is plain), the others as the rows chose."""
    calls = []

    def alone(*args):
        calls.append(len(calls) % 2 == 0)
        return calls[-1]
    monkeypatch.setattr(HybridProposer, "_alone_pays", staticmethod(alone))
    return calls


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_steps_on_suffix_decoding_alone_beside_rows_that_verify_nothing_stay_exact(
        pairs, reference, seeded_reference, monkeypatch, method):
    """Steps priced to run on suffix decoding alone, in turn with mixed ones: greedy rows are
    the target's greedy output and seeded rows its seeded output, at batch 4 with prompts asked
    again; some row-steps verified nothing beside rows that verified suffix proposals."""
    calls = _alone_every_other_step(monkeypatch)
    case = ("eagle3_suffix", *eagle3_suffix(pairs, None))
    _, target, _, prompts = case
    engine = engine_for(pairs, case, method, max_batch_size=4)
    outs = engine.generate(prompts + prompts[:4], SamplingParams(max_tokens=32))
    assert_equivalent(outs, prompts + prompts[:4], [32] * (len(prompts) + 4), reference, target, 256,
                      f"hybrid alone {method}")
    chosen = engine.proposer.chosen
    assert chosen["suffix"] > 0 and chosen["head"] > 0 and chosen["plain"] > 0 and any(calls), chosen
    params = seeded(8, max_tokens=24)
    outs = engine.generate(prompts[:8] + prompts[:8], params + params)
    rows = [(f"row {i}", p, sp, o.token_ids, True)
            for i, (o, p, sp) in enumerate(zip(outs, prompts[:8] + prompts[:8], params + params))]
    assert_seeded_equivalent(rows, seeded_reference, target, label=f"hybrid alone seeded {method}")


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_steps_on_suffix_decoding_alone_through_arrivals_and_aborts_stay_exact(
        pairs, reference, seeded_reference, monkeypatch, method):
    """The same forced choice through the conformance suite's hardest schedule: rows arriving
    into running groups, two aborted mid-flight, greedy and seeded rows side by side. Adaptive
    k's choices and widths fixed (a cycle with plain steps; proposals verified whole), not this
    machine's step costs, which on a slow verifier chose plain steps nearly throughout."""
    from exspec.engine.adaptive_k import AdaptiveK
    cycle = itertools.cycle([3, 3, 0, 2, 3])
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, per_step=False: min(next(cycle), cap))
    monkeypatch.setattr(AdaptiveK, "width", lambda self, batch, lengths, drafted=True: max(lengths))
    _alone_every_other_step(monkeypatch)
    case = ("eagle3_suffix", *eagle3_suffix(pairs, None))
    engine = assert_exact_through_arrivals_and_aborts(pairs, reference, seeded_reference, case, method)
    chosen = engine.proposer.chosen
    assert chosen["suffix"] > 0 and chosen["head"] > 0 and chosen["plain"] > 0, chosen


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_seeded_rows_on_suffix_decoding_equal_target_only_seeded(pairs, seeded_reference, method):
    """Under gumbel a prompt asked again with its seed has the same output, which suffix
    decoding then proposes from the global tree: those steps verify suffix proposals in sampled
    rows, and every row is the target-only seeded output."""
    case = ("eagle3_suffix", *eagle3_suffix(pairs, None))
    _, target, _, prompts = case
    prompts = prompts[:8]
    params = seeded(len(prompts), max_tokens=32)
    engine = engine_for(pairs, case, method, max_batch_size=4)
    outs = engine.generate(prompts + prompts, params + params)
    rows = [(f"row {i}", p, sp, o.token_ids, True)
            for i, (o, p, sp) in enumerate(zip(outs, prompts + prompts, params + params))]
    assert_seeded_equivalent(rows, seeded_reference, target, label=f"hybrid seeded {method}")
    chosen = engine.proposer.chosen
    assert chosen["suffix"] > 0 and chosen["head"] > 0, chosen


class _Drafts(_Model):
    """A model proposer whose drafts and q are fixed: [B, 3] tokens, q uniform over 8 ids."""

    def stage(self, runner, state, seqs, plan, upload):
        return None, {}

    def propose(self, runner, state, seqs, plan, staged, sent, step):
        tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
        return Proposal(3, tokens, torch.full((2, 3, 8), 1 / 8))


def test_a_suffix_rows_drafts_and_q_replace_the_heads_in_the_one_verification():
    """Row 0 takes suffix decoding's [7, 5] (cap 2): its drafts become [7, 5, filler] and its q
    a point mass at each (rejection sampling's rule for a proposal known on the host); row 1
    keeps the head's drafts and q."""
    hybrid = HybridProposer(_Drafts(), SuffixProposer(max_tree_depth=8))
    plan = HybridPlan(3, [2, 3], suffix=[[7, 5], []])
    upload = Upload()
    staged, _ = hybrid.stage(None, None, [None, None], plan, upload)
    sent = upload.send(Transfers("cpu"))
    proposal = hybrid.propose(None, None, [None, None], plan, staged, sent, None)
    assert proposal.tokens.tolist() == [[7, 5, 0], [4, 5, 6]]
    assert proposal.q[0].tolist() == torch.nn.functional.one_hot(torch.tensor([7, 5, 0]), 8).float().tolist()
    assert torch.equal(proposal.q[1], torch.full((3, 8), 1 / 8))


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_greedy_rows_beside_sampled_ones_under_rejection_sampling_stay_exact(pairs, reference, method):
    """Under the rejection coupling a group with a sampled row verifies by rejection sampling,
    q and all: the greedy rows' suffix proposals (q one-hot at them, the filler past the cap)
    must still give the target's greedy output, and the sampled rows finish without error."""
    case = ("eagle3_suffix", *eagle3_suffix(pairs, None))
    _, target, _, prompts = case
    prompts = prompts[:6] + prompts[:6]
    params = [SamplingParams(max_tokens=32) if i % 3 else
              SamplingParams(max_tokens=32, seed=7 + i, temperature=0.8) for i in range(len(prompts))]
    engine = engine_for(pairs, case, method, max_batch_size=4, sampling_coupling="rejection")
    outs = engine.generate(prompts, params)
    greedy = [i for i in range(len(prompts)) if i % 3]
    assert_equivalent([outs[i] for i in greedy], [prompts[i] for i in greedy], [32] * len(greedy),
                      reference, target, 256, f"hybrid rejection {method}")
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert engine.proposer.chosen["suffix"] > 0


def test_a_suffix_rows_token_at_its_cap_is_an_exact_sample_of_the_targets_p():
    """Rejection sampling with q one-hot at a suffix proposal [s] and at the filler f after it
    (cap 1): where s is kept, the token committed at the cap, the filler accepted with p(f) or
    the residual drawn without it, is distributed as p there (sampler.accept, many uniforms)."""
    from exspec.sampling.sampler import accept
    n, vocab, s, f = 40000, 5, 2, 3
    gen = torch.Generator().manual_seed(0)
    p_cap = torch.tensor([0.1, 0.2, 0.05, 0.4, 0.25])
    p = torch.stack([torch.nn.functional.one_hot(torch.tensor(s), vocab).float(), p_cap, p_cap])
    drafts = torch.tensor([[s, f]]).expand(n, 2)
    q = torch.nn.functional.one_hot(drafts, vocab).float()
    accepted, tokens = accept(drafts, q, p.expand(n, 3, vocab), torch.rand(n, 2, generator=gen),
                              torch.rand(n, generator=gen))
    assert bool((accepted >= 1).all())   # s is the target's only token there
    seen = torch.bincount(tokens[:, 1], minlength=vocab).float() / n
    assert (seen - p_cap).abs().max() < 0.01, (seen, p_cap)


def test_the_head_drafts_what_it_computes_offline_after_steps_on_suffix_decoding(deep, monkeypatch):
    """After steps whose kept tokens suffix decoding proposed, the head's first draft is still
    its offline one-pass prediction over the finished sequence at that position: it took every
    committed token, with the true features, including those of steps it did not draft at all
    (every row on suffix decoding: the model runs no forward there)."""
    from exspec.models import compiled
    from exspec.models.eagle3 import load_head
    from exspec.spec.eagle3 import Eagle3Proposer
    from exspec import LLMEngine
    from eagle3kit import first_drafts
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    root, _, head_dir, prompts = deep
    seen = []
    propose = Eagle3Proposer.propose

    def recording(self, runner, state, seqs, plan, staged, sent, step):
        proposal = propose(self, runner, state, seqs, plan, staged, sent, step)
        seen.extend((s, s.num_tokens, d) for s, d in zip(seqs, proposal.tokens[:, 0].tolist()))
        return proposal

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    plans = []
    plan = HybridProposer.plan

    def planning(self, runner, seqs, k, pricing=None):
        plans.append(plan(self, runner, seqs, k, pricing))
        return plans[-1]

    monkeypatch.setattr(HybridProposer, "plan", planning)
    # suffix decoding wherever it proposes anything: many suffix steps, kept in part, between
    # head steps (the rule is not what this test is about)
    monkeypatch.setattr(HybridProposer, "head_expected", lambda self, row, cap: 0.0)
    engine = LLMEngine(EngineConfig(target_model=str(root / "target"), draft_model=head_dir,
                                    proposer="eagle3_suffix", method="exspec", num_speculative_tokens=3,
                                    adaptive_k=False, max_batch_size=2))
    waves = [engine.generate(prompts[:3], SamplingParams(max_tokens=40, ignore_eos=True))
             for _ in range(2)]   # asked again: suffix decoding proposes the first answers
    assert all(o.finish_reason == "length" and o.error is None for wave in waves for o in wave)
    assert [o.token_ids for o in waves[0]] == [o.token_ids for o in waves[1]]
    assert engine.proposer.chosen["suffix"] > 5 and engine.proposer.chosen["head"] > 5, engine.proposer.chosen
    drafting = [p for p in plans if p.width and p.drafts]
    undrafted = [p for p in plans if p.width and not p.drafts]
    assert len(undrafted) > 5 and all(all(p.suffix) for p in undrafted)
    # at most k forwards in each step the head drafts (a round may stop early), none in the others
    assert seen and engine.stats()["draft_forwards"] <= 3 * len(drafting)
    assert len(seen) == sum(len(p.caps) for p in drafting), "the head drafted in an all-suffix step"
    head = load_head(head_dir, engine.target, torch.float32, "cpu")
    offline = {}
    for seq, m, draft in seen:
        key = id(seq)
        if key not in offline:
            offline[key] = first_drafts(engine.target, head, list(seq.tokens))
        assert draft == offline[key][m - 1], f"the head's draft at position {m} is not its offline one"
