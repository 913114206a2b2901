"""Greedy speculative output equals target-only greedy (HF generate, batch 1), exactly, every row.

k x batch size is crossed in full on one pair (four cells in `make test`, each k and each batch
size once; the rest in `make test-slow`); architectures x drafts x methods are covered
pairwise (each combination once, with k and batch size rotating). Prompts span many lengths,
EOS stops some rows mid-run, max_tokens ranges from 1 up, and on GPT-2 one prompt ends within k
tokens of the model's maximum length.
"""
import itertools

import pytest

from exspec import SamplingParams
from exspec.engine.adaptive_k import AdaptiveK

from enginekit import GPT2_MAX_POS, assert_equivalent, make_engine, make_prompts

MAX_TOKENS = [24, 1, 40, 7, 32, 2, 24, 16]


def _run(pairs, reference, arch, draft, method, k, batch, max_len=256, long_prompt=False):
    eos = pairs[arch, "eos"]
    prompts = make_prompts(320, eos, seed=k * 100 + batch)
    max_tokens = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]
    if long_prompt:  # ends within k tokens of the model's maximum length
        prompts.append(make_prompts(320, eos, seed=7, count=8, max_len=max_len - 3)[-1])
        max_tokens.append(16)
    engine = make_engine(pairs, arch, draft, method=method, num_speculative_tokens=k,
                         max_batch_size=batch, max_num_seqs=max(batch, 16))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert_equivalent(outs, prompts, max_tokens, reference, pairs[arch, "target"], max_len,
                      label=f"{arch}/{draft}/{method} k={k} B={batch}")
    return outs, engine.stats()


# make test runs four cells that take each k and each batch size once; make test-slow the rest
IN_CI = {(1, 1), (3, 8), (5, 16), (8, 3)}
K_BY_BATCH = [pytest.param(k, b, marks=() if (k, b) in IN_CI else pytest.mark.slow)
              for k, b in itertools.product([1, 3, 5, 8], [1, 3, 8, 16])]


@pytest.mark.parametrize("k,batch", K_BY_BATCH)
def test_every_k_and_batch_size_matches_target_greedy(pairs, reference, k, batch):
    outs, stats = _run(pairs, reference, "gpt2", "noisy", "eqspec", k, batch,
                       max_len=GPT2_MAX_POS, long_prompt=True)
    reasons = {o.finish_reason for o in outs}
    assert {"stop", "length"} <= reasons, "the matrix must include EOS stops and length stops"
    assert stats["accepted_tokens"] > 0 and stats["accepted_tokens"] < stats["draft_tokens"]


PAIRWISE = [(arch, draft, method)
            for arch in ("llama", "gpt2")
            for draft in ("noisy", "independent", "othershape", "otherarch")
            for method in ("eqspec", "exspec")]


@pytest.mark.parametrize("index", range(len(PAIRWISE)), ids=lambda i: "-".join(PAIRWISE[i]))
def test_architectures_drafts_and_methods_match_target_greedy(pairs, reference, index):
    arch, draft, method = PAIRWISE[index]
    k = [1, 3, 5, 8][index % 4]
    batch = [1, 3, 8, 16][(index // 2) % 4]
    max_len = GPT2_MAX_POS if arch == "gpt2" else 256
    _run(pairs, reference, arch, draft, method, k, batch, max_len=max_len, long_prompt=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_autoregressive_matches_target_greedy(pairs, reference, arch):
    max_len = GPT2_MAX_POS if arch == "gpt2" else 256
    _run(pairs, reference, arch, "noisy", "autoregressive", 0, 8, max_len=max_len, long_prompt=True)


def test_exspec_and_eqspec_give_identical_outputs(pairs):
    prompts = make_prompts(320, pairs["llama", "eos"], seed=3, count=16)
    results = {}
    for method in ("eqspec", "exspec"):
        engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=4)
        results[method] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=30))]
    assert results["eqspec"] == results["exspec"]


@pytest.mark.parametrize("method,batch", [("eqspec", 8), ("exspec", 1), ("exspec", 4)])
def test_rounds_stopped_at_an_unsure_draft_match_target_greedy(pairs, reference, monkeypatch,
                                                               method, batch):
    """Adaptive k's confidence stop: a round of drafts ends at a draft token its draft gives
    less than draft_stop_confidence, and the target verifies the shorter round. k is pinned at
    its cap (the choice is not under test); the threshold stops some rounds mid-way, not all."""
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, *rest: cap)
    prompts = make_prompts(320, pairs["gpt2", "eos"], seed=41, count=12)
    max_tokens = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]
    engine = make_engine(pairs, "gpt2", "noisy", method=method, adaptive_k=True,
                         draft_stop_confidence=0.2, max_batch_size=batch, max_num_seqs=16)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert_equivalent(outs, prompts, max_tokens, reference, pairs["gpt2", "target"], GPT2_MAX_POS,
                      label=f"{method} B={batch} stopped rounds")
    stats = engine.stats()
    ks = {s["k"] for s in stats["steps_by_shape"]}
    assert stats["draft_stopped_steps"] > 0 and 5 in ks and ks - {5}, stats["steps_by_shape"]


@pytest.mark.parametrize("method,batch", [("eqspec", 4), ("exspec", 1)])
def test_auto_draft_stop_calibrates_on_every_verified_draft_and_matches_target_greedy(
        pairs, reference, monkeypatch, method, batch):
    """The "auto" stop (draft_stop.py) sees each step's draft confidences through the step's
    one device-to-host copy: with its decay off, the accepted drafts it counted are exactly those
    the target accepted in the steps planned at k >= 2 (every step is planned at k = 5 but near
    a row's max_tokens, where k is what the rows have left; each of those steps is observed,
    stopped or not: where auto stops depends on measured step times), and outputs stay the
    target's greedy ones."""
    from exspec.engine.runner import ModelRunner
    from exspec.spec.draft_stop import DraftStop
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, *rest: cap)
    monkeypatch.setattr(DraftStop, "DECAY", 1.0)
    accepted = []   # per step planned at k >= 2 (one a stop could cut), its accepted drafts
    step = ModelRunner.step

    def counted_step(self, group, k, *rest):
        result = step(self, group, k, *rest)
        if k >= 2:
            accepted.append(sum(result.num_accepted))
        return result
    monkeypatch.setattr(ModelRunner, "step", counted_step)
    prompts = make_prompts(320, pairs["gpt2", "eos"], seed=43, count=8)
    max_tokens = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]
    engine = make_engine(pairs, "gpt2", "noisy", method=method, adaptive_k=True,
                         draft_stop_confidence="auto", max_batch_size=batch, max_num_seqs=16)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert_equivalent(outs, prompts, max_tokens, reference, pairs["gpt2", "target"], GPT2_MAX_POS,
                      label=f"{method} B={batch} auto stop")
    stats, stop = engine.stats(), engine.pool.scheduler.draft_stop
    assert sum(stop.accepted) == pytest.approx(sum(accepted))
    assert sum(accepted) < sum(stop.verified) <= stats["draft_tokens"]
