"""Seeded sampling under the gumbel coupling: the speculative output equals the target-only seeded
output (each token argmax(log p + g(seed, position)), enginekit.seeded_reference) token for token,
for eqspec and exspec at any k and batch size, with adaptive k, a random k schedule, arrivals
and aborts, and in any batch composition. Rejection sampling, equal only in distribution, is
the negative control. Temperatures, top-k and top-p vary per row, one row in five is greedy.
"""
import random

import pytest
import torch

from exspec import SamplingParams
from exspec.sampling.noise import uniforms
from exspec.engine.adaptive_k import AdaptiveK
from exspec.engine.scheduler import Scheduler

from enginekit import GPT2_MAX_POS, assert_seeded_equivalent, make_engine, make_prompts, run_schedule

VARIANTS = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9),
            dict(temperature=1.3, top_k=20), dict(temperature=0.9, top_p=0.95, top_k=40), dict()]
MAX_TOKENS = [24, 1, 40, 7, 32, 2, 24, 16]


def seeded_params(count: int, first_seed: int = 100) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], seed=first_seed + i,
                           **VARIANTS[i % len(VARIANTS)]) for i in range(count)]


def generate_rows(engine, prompts, params):
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return [(f"row {i}", p, sp, o.token_ids, True) for i, (o, p, sp) in enumerate(zip(outs, prompts, params))]


CASES = [  # (arch, draft, method, k, batch, adaptive_k): methods x k x batch, pairwise
    ("llama", "noisy", "eqspec", 1, 1, False),
    ("llama", "noisy", "eqspec", 5, 8, False),
    ("llama", "independent", "exspec", 3, 3, False),
    ("llama", "noisy", "exspec", 5, 8, True),
    ("gpt2", "noisy", "exspec", 4, 16, True),
    ("gpt2", "otherarch", "eqspec", 8, 4, True),
    ("llama", "noisy", "autoregressive", 0, 4, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_seeded_output_equals_target_only_seeded_output(pairs, seeded_reference, case):
    arch, draft, method, k, batch, adaptive = case
    prompts = make_prompts(320, pairs[arch, "eos"], seed=k * 100 + batch, count=12)
    params = seeded_params(len(prompts))
    engine = make_engine(pairs, arch, draft, method=method, num_speculative_tokens=k,
                         max_batch_size=batch, max_num_seqs=16, adaptive_k=adaptive)
    rows = generate_rows(engine, prompts, params)
    max_len = GPT2_MAX_POS if arch == "gpt2" else 256
    ties = assert_seeded_equivalent(rows, seeded_reference, pairs[arch, "target"], max_len,
                                    label="/".join(map(str, case)))
    assert ties <= 1, f"{ties} rows ended at a float tie: the guard hides too much"
    stats = engine.stats()
    if k:
        assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], "drafts must be both kept and rejected"


def test_any_k_schedule_gives_the_same_tokens(pairs, seeded_reference, monkeypatch):
    """k drawn at random per step, 0 (plain decoding, draft catch-up) included: the noise of a
    position does not depend on how many tokens a step drafts."""
    rng = random.Random(5)
    monkeypatch.setattr(Scheduler, "k_for", lambda self, group: rng.choice([0, 0, 1, 2, 3, 5, 7]))
    prompts = make_prompts(320, pairs["llama", "eos"], seed=31, count=10)
    params = seeded_params(len(prompts), first_seed=7)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4)
    rows = generate_rows(engine, prompts, params)
    assert assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"]) == 0
    assert engine.stats()["plain_steps"] > 0 and engine.stats()["draft_tokens"] > 0


def test_rounds_stopped_at_an_unsure_draft_keep_seeded_output(pairs, seeded_reference, monkeypatch):
    """Adaptive k's confidence stop under the gumbel coupling: a round that ends early
    verifies fewer positions, each with its own noise, so the tokens stay the target's."""
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, group, cap, *rest: cap)
    prompts = make_prompts(320, pairs["gpt2", "eos"], seed=43, count=10)
    params = seeded_params(len(prompts), first_seed=11)
    engine = make_engine(pairs, "gpt2", "noisy", method="exspec", max_batch_size=4,
                         adaptive_k=True, draft_stop_confidence=0.2)
    rows = generate_rows(engine, prompts, params)
    assert assert_seeded_equivalent(rows, seeded_reference, pairs["gpt2", "target"], GPT2_MAX_POS) <= 1
    stats = engine.stats()
    ks = {s["k"] for s in stats["steps_by_shape"]}
    assert stats["draft_stopped_steps"] > 0 and 5 in ks and ks - {5}, stats["steps_by_shape"]


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_arrivals_and_aborts_keep_seeded_output(pairs, seeded_reference, method):
    rng = random.Random(11)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=41, count=16)
    params = dict(zip((f"r{i}" for i in range(16)), seeded_params(16, first_seed=300)))
    arrivals, arrived_at = {}, {}
    for i, p in enumerate(prompts):
        arrived_at[f"r{i}"] = tick = rng.randint(0, 20)
        arrivals.setdefault(tick, []).append((f"r{i}", p))
    aborts = {}
    for rid in rng.sample(sorted(params), 4):
        aborts.setdefault(arrived_at[rid] + rng.randint(0, 3), []).append(rid)
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=4, max_num_seqs=8,
                         adaptive_k=True, max_skipped_ticks=4)
    outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)
    assert set(finished) == set(params), "every request ends exactly once"
    rows = [(rid, prompts[i], params[rid], [t for o in outputs[rid] for t in o.new_token_ids],
             finished[rid].finish_reason != "abort") for i, rid in enumerate(f"r{i}" for i in range(16))]
    assert sum(not complete for *_, complete in rows) >= 2, "too few aborts took effect"
    assert assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"], label=method) == 0


def test_seeded_request_is_the_same_in_any_engine_and_batch(pairs, seeded_reference):
    """Two engines, two batch compositions, speculative and autoregressive: one answer."""
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    crowd = [[9, 9], prompt, [1] * 11, [4, 2], [8] * 5, [3]]
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(5)]
    answers = {}
    for method, batch in (("exspec", 1), ("exspec", 4), ("autoregressive", 1), ("autoregressive", 4)):
        engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=batch,
                             adaptive_k=True)
        answers[method, batch, "alone"] = engine.generate([prompt], params)[0].token_ids
        engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=batch,
                             adaptive_k=True)
        answers[method, batch, "crowd"] = engine.generate(crowd, [others[0], params] + others[1:])[1].token_ids
    expected, _ = seeded_reference(pairs["llama", "target"], prompt, params)
    assert len(expected) > 5, expected
    wrong = {where: got for where, got in answers.items() if got != expected}
    assert not wrong, f"expected {expected}, got {wrong}"


def test_twin_draft_proposes_with_the_same_noise(pairs):
    """A draft identical to the target sees the same processed distribution and the same noise,
    so under the gumbel coupling every draft is accepted."""
    prompts = make_prompts(320, pairs["llama", "eos"], seed=51, count=8)
    engine = make_engine(pairs, "llama", "twin", method="exspec", max_batch_size=4)
    engine.generate(prompts, seeded_params(len(prompts), first_seed=900))
    stats = engine.stats()
    assert stats["draft_tokens"] > 50 and stats["accepted_tokens"] == stats["draft_tokens"], stats


def test_rejection_coupling_is_not_the_target_only_sample(pairs, seeded_reference):
    """Negative control: rejection sampling keeps the distribution, not the sample, so the same
    seeds give other tokens than the target-only seeded output for most rows."""
    prompts = make_prompts(320, pairs["llama", "eos"], seed=61, count=8)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=500 + i) for i in range(8)]
    engine = make_engine(pairs, "llama", "noisy", method="eqspec", sampling_coupling="rejection")
    outs = engine.generate(prompts, params)
    same = sum(o.token_ids == seeded_reference(pairs["llama", "target"], p, sp)[0]
               for o, p, sp in zip(outs, prompts, params))
    assert same <= 2, f"{same} of 8 rejection-sampled rows equal the gumbel reference"


def test_requests_without_a_seed_are_each_their_own_sample(pairs):
    """No seed: each request draws a fresh one (from the engine's seed), so the same prompt sent
    three times gives three samples, and a fresh engine with the same seed the same three."""
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    runs = [[o.token_ids for o in make_engine(pairs, "llama", "noisy", method="exspec").generate(
        [[5, 6, 7]] * 3, params)] for _ in range(2)]
    assert len({tuple(t) for t in runs[0]}) == 3, f"unseeded requests repeated a sample: {runs[0]}"
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_bits_on_cuda_equal_the_cpu_bits():
    seeds = torch.tensor([0, 1, 2**63 - 1, 123456789])
    positions = torch.tensor([[0, 1], [7, 8], [2**31 - 1, 5], [300, 301]])
    cpu = uniforms(seeds, positions, 50_000)
    assert torch.equal(uniforms(seeds.cuda(), positions.cuda(), 50_000).cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_seeded_output_on_cuda_equals_the_cpu_reference(pairs, seeded_reference, method):
    prompts = make_prompts(320, pairs["llama", "eos"], seed=71, count=8)
    engine = make_engine(pairs, "llama", "noisy", method=method, device="cuda", max_batch_size=4,
                         adaptive_k=True)
    rows = generate_rows(engine, prompts, seeded_params(len(prompts), first_seed=700))
    ties = assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"], label=f"cuda {method}")
    assert ties <= 1, f"{ties} rows ended at a float tie"
