"""n > 1 (parallel sampling, parallel_sampling.py): a request's n samples are n child sequences,
sample i seeded seed + i as vLLM derives it, so each equals a lone request with that seed, and under
the gumbel coupling the target-only seeded output, on both methods; the siblings of child 0 reuse
its cached prompt on the block store; abort and failure reach every sample; bad n / best_of are
refused with messages that say what is accepted.
"""
from __future__ import annotations

import random

import pytest

from exspec import InvalidRequestError, SamplingParams
from exspec.kv.blocks import BLOCK_SIZE
from exspec.engine.parallel_sampling import ParallelSampling

from enginekit import assert_seeded_equivalent, make_engine, make_prompts, run_schedule

PROMPT = [random.Random(3).randrange(1, 250) for _ in range(100)]   # 6 full blocks + 4 tokens


def samples_by_index(engine, request_id, prompt, params):
    """Run one request to the end; {index: tokens}, {index: finish_reason}, its outputs."""
    outputs, finished, _ = run_schedule(engine, {0: [(request_id, prompt)]}, {}, params)
    outs = outputs[request_id]
    tokens, reasons = {}, {}
    for out in outs:
        tokens.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            assert out.index not in reasons, f"sample {out.index} ended twice: {outs}"
            reasons[out.index] = out.finish_reason
    return tokens, reasons, outs


def test_n_samples_give_n_outputs_and_one_final_output(pairs):
    engine = make_engine(pairs, method="exspec")
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    tokens, reasons, outs = samples_by_index(engine, "r", [4, 5, 6, 7], params)
    assert sorted(tokens) == [0, 1, 2], f"sample indices {sorted(tokens)}"
    assert all(len(t) == 12 for t in tokens.values()), {i: len(t) for i, t in tokens.items()}
    assert reasons == {0: "length", 1: "length", 2: "length"}, reasons
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, \
        "the request must end with exactly one finished output, its last"
    assert len({tuple(t) for t in tokens.values()}) > 1, f"seeds seed + i gave equal samples: {tokens}"
    [c0, c1, c2] = engine.generate([[4, 5, 6, 7]], params)
    assert [c.index for c in (c0, c1, c2)] == [0, 1, 2]
    assert [c0.token_ids, c1.token_ids, c2.token_ids] == [tokens[0], tokens[1], tokens[2]], \
        "generate's samples differ from the online API's for the same seed"


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_sample_i_equals_a_lone_request_seeded_seed_plus_i_and_the_target_alone(
        pairs, seeded_reference, method):
    """vLLM's derivation (child i: seed + i) under speculation equals the target-only output."""
    engine = make_engine(pairs, method=method, num_speculative_tokens=4)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=9, count=3)
    n, seed = 3, 40
    params = [SamplingParams(n=n, max_tokens=20, temperature=0.9, top_p=0.95, seed=seed + 10 * j)
              for j in range(len(prompts))]
    samples = engine.generate(prompts, params)
    assert len(samples) == n * len(prompts)
    lone = engine.generate([p for p in prompts for _ in range(n)],
                           [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95,
                                           seed=sp.seed + i) for sp in params for i in range(n)])
    rows = []
    for j, (prompt, sp) in enumerate(zip(prompts, params)):
        for i in range(n):
            got, alone = samples[j * n + i], lone[j * n + i]
            assert got.index == i and got.error is None, got
            assert got.token_ids == alone.token_ids, (
                f"{method} prompt {j} sample {i}: {got.token_ids} but a lone request with seed "
                f"{sp.seed + i} gave {alone.token_ids}")
            rows.append((f"prompt {j} sample {i}", prompt,
                         SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=sp.seed + i),
                         got.token_ids, True))
    assert assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"],
                                    label=method) == 0
    assert engine.stats()["accepted_tokens"] > 0, "no draft was accepted: speculation did not run"


def test_greedy_samples_are_identical_and_the_target_greedy_output(pairs, reference):
    engine = make_engine(pairs, method="exspec")
    prompt = [9, 8, 7, 6, 5]
    outs = engine.generate([prompt], SamplingParams(n=2, max_tokens=16))
    assert outs[0].token_ids == outs[1].token_ids == reference(pairs["llama", "target"], prompt, 16)


def test_siblings_are_fed_only_what_the_first_samples_cached_prompt_lacks(pairs):
    """On the block store child 0 is prefilled alone; its siblings join a tick later and find its
    full blocks cached: n = 3 on a 100-token prompt feeds the target 100 + 2 x 4 tokens."""
    engine = make_engine(pairs, method="exspec")
    engine.generate([PROMPT], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1))
    stats = engine.stats()
    tail = len(PROMPT) % BLOCK_SIZE or BLOCK_SIZE
    assert stats["prefill_tokens_target"] == len(PROMPT) + 2 * tail, stats
    assert stats["prefix_cache_hits"] == 2 * (len(PROMPT) - tail), stats


def test_siblings_admitted_with_the_first_sample_share_nothing(pairs, monkeypatch):
    """Negative control of the test above: not held back, the three children are prefilled in one
    batch and each is fed the whole prompt."""
    add = ParallelSampling.add
    monkeypatch.setattr(ParallelSampling, "add",
                        lambda self, rid, children, hold: add(self, rid, children, False))
    engine = make_engine(pairs, method="exspec")
    engine.generate([PROMPT], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1))
    assert engine.stats()["prefill_tokens_target"] == 3 * len(PROMPT)


@pytest.mark.parametrize("when", ["at once", "after the first tokens"])
def test_abort_ends_every_sample(pairs, when):
    """abort(request_id) reaches every child, the held siblings included (at once), and the
    request then ends with one finished output."""
    engine = make_engine(pairs, method="exspec")
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
    aborts = {0: ["r"]} if when == "at once" else {3: ["r"]}
    outputs, finished, _ = run_schedule(engine, {0: [("r", PROMPT)]}, aborts, params)
    reasons = {o.index: o.finish_reason for o in outputs["r"] if o.finish_reason is not None}
    assert reasons == {0: "abort", 1: "abort", 2: "abort"}, reasons
    assert finished["r"].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.pool.num_running == 0 and not engine.pool.waiting
    tokens = sum(len(o.new_token_ids) for o in outputs["r"])
    assert tokens < 3 * 40, "the samples ran to max_tokens: the abort did not reach them"


def test_a_failing_sample_aborts_its_siblings_and_fails_the_request(pairs):
    """One row's forward fails (fault injection; batch 1, so each sample steps alone): the
    request ends with that error, and its sibling is aborted at once, before the next injected
    fault could fail it too or it ran to max_tokens."""
    every = 30
    engine = make_engine(pairs, method="exspec", max_batch_size=1,
                         fault_injection={"forward_error_every": every})
    params = SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=3, ignore_eos=True)
    tokens, reasons, outs = samples_by_index(engine, "r", [3, 4, 5], params)
    assert outs[-1].finished and outs[-1].finish_reason == "error", outs[-1]
    assert "injected fault" in outs[-1].error, outs[-1].error
    assert set(reasons) == {0, 1} and "error" in reasons.values(), reasons
    assert all(len(t) < 60 for t in tokens.values()), {i: len(t) for i, t in tokens.items()}
    assert engine.faults.forwards < 2 * every, \
        f"{engine.faults.forwards} forwards: the sibling ran on after the failure"


@pytest.mark.parametrize("kwargs,message", [
    (dict(n=0), r"n must be an integer in \[1, 16\]"),
    (dict(n=17), r"n must be an integer in \[1, 16\]"),
    (dict(n="2"), r"n must be an integer"),
    (dict(n=2, best_of=3), r"best_of=3 is not supported with n=2.*absent or equal to n"),
    (dict(best_of=2), r"best_of=2 is not supported with n=1"),
    (dict(n=2, seed=2**63 - 1), r"seed \+ i < 2\^63"),
])
def test_bad_n_and_best_of_are_refused_with_a_message(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_best_of_equal_to_n_is_accepted_and_n_over_the_queue_refused(pairs):
    assert SamplingParams(n=3, best_of=3).n == 3
    engine = make_engine(pairs, method="exspec", max_queue_len=2)
    with pytest.raises(InvalidRequestError, match="max_queue_len = 2"):
        engine.add_request("r", [1, 2], SamplingParams(n=3))


def test_each_sample_of_a_structured_request_has_its_own_matcher(pairs):
    """Structured outputs with n > 1: each child compiles its own grammar, so every sample
    keeps to the choice while the samples differ, each equal to a lone request with seed + i."""
    engine = make_engine(pairs, method="exspec")
    choice = ["alpha", "beta gamma", "delta", "epsilon"]
    params = SamplingParams(n=4, max_tokens=24, temperature=1.5, seed=21,
                            structured_outputs={"choice": choice})
    samples = engine.generate([[7, 8, 9]], params)
    lone = engine.generate([[7, 8, 9]] * 4, [SamplingParams(
        max_tokens=24, temperature=1.5, seed=21 + i, structured_outputs={"choice": choice})
        for i in range(4)])
    eos = pairs["llama", "eos"]
    texts = [engine.tokenizer.decode([t for t in s.token_ids if t != eos]) for s in samples]
    assert all(t in choice for t in texts), texts
    assert [s.token_ids for s in samples] == [s.token_ids for s in lone]
    assert len(set(texts)) > 1, f"four seeds chose the same word: {texts}"


def test_a_request_id_equal_to_a_running_sample_id_is_refused_both_ways(pairs):
    """Sample i of request "r" runs as "i_r": a request named "0_r" while it runs (or "r" with
    n > 1 while a request "1_r" runs) would share a sequence id and swap outputs; both are refused,
    and the ids are free again once the first request ends."""
    engine = make_engine(pairs, method="exspec")
    sampled = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1)
    engine.add_request("r", [1, 2, 3], sampled)
    with pytest.raises(InvalidRequestError, match="'0_r' is already in flight"):
        engine.add_request("0_r", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.add_request("1_q", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="sample id '1_q' is a request already in flight"):
        engine.add_request("q", [1, 2, 3], sampled)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("0_r", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.add_request("q", [1, 2, 3], sampled)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finals) == {"0_r", "q"} and all(o.finish_reason == "length" for o in finals.values())
