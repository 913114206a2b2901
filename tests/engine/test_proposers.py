"""The proposer conformance suite: every proposer (proposer.py) runs the same equivalence battery
(a draft model, an EAGLE-3 head, prompt lookup, suffix decoding).
A new proposer joins by adding one line to PROPOSERS: the target it is tested against, its
config, and prompts on which it both proposes and misses.

Each case holds the one promise: greedy output == target-only greedy (Hugging Face generate at
batch 1), seeded == target-only seeded, in EQSPEC and EXSPEC; at batch 1, 4 and 8; with requests
arriving and aborted mid-flight; under penalties and logits processors, structured outputs, n > 1
and prefix-cache hits (those against the engine's own target-only path, `autoregressive`, whose
equality with the independent references the other cases and test_equivalence.py hold). Every
case also checks that the proposer's drafts were verified and some kept, so that equality
proves something.
"""
from __future__ import annotations

import tempfile

import pytest

from exspec import SamplingParams

from enginekit import (assert_equivalent, assert_seeded_equivalent, first_difference, make_engine,
                       make_prompts, run_schedule)
from eagle3kit import train_head
from test_ngram import cyclic_target, walk_prompts
from exspec.demo.tiny import build_tokenizer


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory):
    path = tmp_path_factory.mktemp("cyclic") / "target"
    return str(path), cyclic_target(path, len(build_tokenizer()))


def draft_model(pairs, cyclic):
    """A draft model (a noisy copy of the target) on random prompts."""
    target = pairs["llama", "target"]
    return target, dict(draft_model=pairs["llama", "noisy"]), make_prompts(320, pairs["llama", "eos"], seed=7)


def eagle3(pairs, cyclic):
    """An EAGLE-3 head (trained here for the target, reduced draft vocabulary) on random prompts."""
    target = pairs["llama", "target"]
    prompts = make_prompts(320, pairs["llama", "eos"], seed=7)
    head = _eagle3_head(target, prompts + [p for wave in prefix_waves(prompts) for p in wave])
    return target, dict(draft_model=head, proposer="eagle3"), prompts


def ngram(pairs, cyclic):
    """Prompt lookup on a target whose outputs repeat (cycles), prompts that match and miss."""
    target, successor = cyclic
    prompts = walk_prompts(successor, 12, seed=3) + make_prompts(320, 0, seed=3, count=4)
    return target, dict(draft_model=None, proposer="ngram", prompt_lookup_max=3,
                        prompt_lookup_min=2), prompts


def suffix(pairs, cyclic):
    """Suffix decoding on the same target and prompts: each row's own tree, and the global tree
    of earlier outputs as the cases' requests end."""
    target, successor = cyclic
    prompts = walk_prompts(successor, 12, seed=3) + make_prompts(320, 0, seed=3, count=4)
    return target, dict(draft_model=None, proposer="suffix", suffix_decoding_max_tree_depth=8), prompts


def eagle3_suffix(pairs, cyclic):
    """Suffix decoding with the EAGLE-3 head (hybrid.py): the head's target and prompts, and some
    of them again, which suffix decoding proposes from the earlier requests' outputs where
    they repeat (test_hybrid.py checks that both are taken)."""
    target, config, prompts = eagle3(pairs, cyclic)
    return (target, {**config, "proposer": "eagle3_suffix", "suffix_decoding_max_tree_depth": 8},
            prompts + prompts[:6])


def draft_model_suffix(pairs, cyclic):
    """Suffix decoding with the draft model, as eagle3_suffix with the head."""
    target, config, prompts = draft_model(pairs, cyclic)
    return (target, {**config, "proposer": "draft_model_suffix", "suffix_decoding_max_tree_depth": 8},
            prompts + prompts[:6])


PROPOSERS = {"draft_model": draft_model, "eagle3": eagle3, "ngram": ngram, "suffix": suffix,
             "eagle3_suffix": eagle3_suffix, "draft_model_suffix": draft_model_suffix}


_heads: dict = {}


def _eagle3_head(target: str, prompts) -> str:
    """The head, trained once per session on the target's continuations of these prompts, so
    that its drafts are often kept (eagle3kit.py); its 2 layers' inputs are its features."""
    if target not in _heads:
        out = tempfile.mkdtemp(prefix="eagle3-head-")
        _heads[target] = train_head(target, out, (0, 1, 1), prompts, draft_size=200)
    return _heads[target]
METHODS = ["eqspec", "exspec"]


@pytest.fixture(params=list(PROPOSERS))
def proposer(request, pairs, cyclic):
    """(name, target path, config, prompts) of one proposer."""
    return (request.param, *PROPOSERS[request.param](pairs, cyclic))


def engine_for(pairs, proposer, method, **overrides):
    _, target, config, _ = proposer
    return make_engine(pairs, target_model=target, method=method, num_speculative_tokens=4,
                       **{**config, **overrides})


def target_only(pairs, proposer, method):
    """The engine's own target-only path on the method's layout (the reference where the
    independent references do not reach: penalties, grammars, n > 1)."""
    _, target, _, _ = proposer
    return make_engine(pairs, target_model=target, draft_model=None, method=method,
                       num_speculative_tokens=0)


def assert_speculated(engine, label):
    stats = engine.stats()
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], \
        f"{label}: drafts must be both kept and rejected ({stats['accepted_tokens']} of {stats['draft_tokens']})"


def seeded(count: int, first_seed: int = 40, max_tokens: int = 20) -> list[SamplingParams]:
    temps = [0.7, 1.0, 0.8, 1.2, 0.9]
    return [SamplingParams(max_tokens=max_tokens, seed=first_seed + i, temperature=temps[i % 5],
                           top_p=0.95 if i % 3 == 1 else 1.0, top_k=20 if i % 3 == 2 else 0)
            for i in range(count)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_equals_target_only_greedy(pairs, reference, proposer, method, batch):
    name, target, _, prompts = proposer
    engine = engine_for(pairs, proposer, method, max_batch_size=batch, max_num_seqs=max(batch, 8))
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    label = f"{name} {method} B={batch}"
    assert_equivalent(outs, prompts, [20] * len(prompts), reference, target, 256, label)
    assert_speculated(engine, label)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_equals_target_only_seeded(pairs, seeded_reference, proposer, method):
    name, target, _, prompts = proposer
    engine = engine_for(pairs, proposer, method, max_batch_size=4)
    params = seeded(len(prompts))
    outs = engine.generate(prompts, params)
    rows = [(f"row {i}", p, sp, o.token_ids, True) for i, (o, p, sp) in enumerate(zip(outs, prompts, params))]
    assert_seeded_equivalent(rows, seeded_reference, target, label=f"{name} {method}")
    assert engine.stats()["accepted_tokens"] > 0, f"{name} {method}: no seeded draft was kept"


@pytest.mark.parametrize("method", METHODS)
def test_arrivals_and_aborts_keep_every_row_exact(pairs, reference, seeded_reference, proposer, method):
    """Requests join running groups tick by tick and two are aborted mid-flight; greedy rows and
    seeded rows each equal their target-only output (an aborted one: a prefix of it)."""
    assert_exact_through_arrivals_and_aborts(pairs, reference, seeded_reference, proposer, method)


def assert_exact_through_arrivals_and_aborts(pairs, reference, seeded_reference, proposer, method):
    """The test above's run (adaptive k, batch 4, arrivals every third tick, two aborts, greedy
    and seeded rows); returns its engine."""
    name, target, _, prompts = proposer
    engine = engine_for(pairs, proposer, method, max_batch_size=4, adaptive_k=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    arrivals = {3 * i: [(rid, p)] for i, (rid, p) in enumerate(zip(ids, prompts))}
    aborts = {7: [ids[1]], 16: [ids[4]]}
    sampled = dict(zip(ids[::2], seeded(len(ids[::2]), max_tokens=24)))
    params = {rid: sampled.get(rid, SamplingParams(max_tokens=24)) for rid in ids}
    outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)
    rows = []
    for rid, prompt in zip(ids, prompts):
        complete = finished[rid].finish_reason != "abort"
        assert finished[rid].error is None, f"{name} {method} {rid}: {finished[rid].error}"
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        if rid in sampled:
            rows.append((rid, prompt, params[rid], tokens, complete))
        else:
            expected = reference(target, prompt, 24)
            assert tokens == (expected if complete else expected[:len(tokens)]), \
                f"{name} {method} {rid} (greedy) differs from target-only"
    assert_seeded_equivalent(rows, seeded_reference, target, label=f"{name} {method}")
    assert finished[ids[1]].finish_reason == "abort"
    assert engine.stats()["accepted_tokens"] > 0
    return engine


def against_target_only(pairs, proposer, method, params, prompts=None, **overrides):
    """Outputs of the proposer's engine and the target-only engine for the same requests."""
    prompts = prompts or proposer[3][:6]
    engine = engine_for(pairs, proposer, method, **overrides)
    got = engine.generate(prompts, params)
    expected = target_only(pairs, proposer, method).generate(prompts, params)
    return engine, got, expected


def assert_same_outputs(got, expected, label):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.error is None, f"{label} output {i}: {g.error}"
        at = first_difference(g.token_ids, e.token_ids)
        assert at is None, (f"{label} output {i} (sample {g.index}) differs from target-only at "
                            f"{at}: got {g.token_ids[at:at + 5]}, expected {e.token_ids[at:at + 5]}")


@pytest.mark.parametrize("method", METHODS)
def test_penalties_and_logits_processors_equal_target_only(pairs, proposer, method):
    name = proposer[0]
    params = [SamplingParams(max_tokens=20, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, frequency_penalty=0.6, presence_penalty=0.4),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, min_p=0.1),
              SamplingParams(max_tokens=20, logit_bias={5: 3.0, 9: -2.0}),
              SamplingParams(max_tokens=20, min_tokens=10, temperature=0.9, seed=4, presence_penalty=0.5),
              SamplingParams(max_tokens=20)]
    engine, got, expected = against_target_only(pairs, proposer, method, params)
    assert_same_outputs(got, expected, f"{name} {method} penalties")
    assert engine.stats()["accepted_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_structured_outputs_equal_target_only(pairs, proposer, method):
    name = proposer[0]
    constraints = [{"regex": r"[a-z]{2,6}@(foo|bar)\.(com|org)"}, {"choice": ["alpha", "beta gamma"]},
                   None, {"regex": r"(ab|cd){3,8}"}]
    params = [SamplingParams(max_tokens=20, structured_outputs=c, temperature=t, seed=9 + i)
              for i, (c, t) in enumerate(zip(constraints, [0.0, 0.8, 0.0, 0.9]))]
    engine, got, expected = against_target_only(pairs, proposer, method, params, proposer[3][:4])
    assert_same_outputs(got, expected, f"{name} {method} structured")
    assert engine.stats()["accepted_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_n_samples_equal_target_only(pairs, proposer, method):
    name = proposer[0]
    params = [SamplingParams(max_tokens=20, n=3, temperature=0.8, seed=21),
              SamplingParams(max_tokens=20, n=2)]
    engine, got, expected = against_target_only(pairs, proposer, method, params, proposer[3][:2])
    assert [g.index for g in got] == [0, 1, 2, 0, 1]
    assert_same_outputs(got, expected, f"{name} {method} n > 1")
    assert engine.stats()["accepted_tokens"] > 0


def prefix_waves(prompts):
    """Two waves of prompts that share a 40-token prefix."""
    shared = [t for p in prompts for t in p][:40]
    return [shared + p[:6] for p in prompts[:3]], [shared + p[-5:] for p in prompts[3:7]]


def test_prefix_cache_hits_keep_output_exact(pairs, reference, proposer):
    """EXSPEC's block store: a second wave of prompts sharing the first wave's 40-token prefix
    starts from cached blocks in every store (the target's and the proposer's) and stays exact."""
    name, target, _, prompts = proposer
    engine = engine_for(pairs, proposer, "exspec", max_batch_size=4)
    first, second = prefix_waves(prompts)
    for wave in (first, second):
        outs = engine.generate(wave, SamplingParams(max_tokens=16))
        assert_equivalent(outs, wave, [16] * len(wave), reference, target, 256, f"{name} prefix")
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= 32 * len(second), stats
    assert stats["accepted_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_each_request_end_reaches_the_proposer_once_with_its_reason(pairs, proposer, method):
    """`Proposer.request_done`: every sequence once, as it ends (length, stop, abort, error),
    so a proposer that learns across requests can leave aborted and failed ones out."""
    name, _, _, prompts = proposer
    engine = engine_for(pairs, proposer, method, max_batch_size=4)
    heard = []
    engine.proposer.request_done = lambda row, reason: heard.append((row.request_id, reason))
    eos = pairs["llama", "eos"]
    params = {"long": SamplingParams(max_tokens=40, ignore_eos=True),
              "short": SamplingParams(max_tokens=3),
              "aborted": SamplingParams(max_tokens=40, ignore_eos=True),
              "failed": SamplingParams(max_tokens=8, allowed_token_ids=[eos], stop_token_ids=[eos],
                                       min_tokens=4)}
    arrivals = {0: [(rid, prompts[i]) for i, rid in enumerate(params)]}
    _, finished, _ = run_schedule(engine, arrivals, {4: ["aborted"]}, params)
    assert sorted(heard) == sorted((rid, out.finish_reason) for rid, out in finished.items()), name
    assert dict(heard) == {"long": "length", "short": dict(heard)["short"], "aborted": "abort",
                           "failed": "error"}
    assert dict(heard)["short"] in ("length", "stop")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", ["prefill", "step"])
def test_a_row_that_raises_fails_alone_and_its_neighbours_stay_exact(
        pairs, reference, seeded_reference, proposer, method, where):
    """Any exception while prefilling or stepping one row fails that row alone (fault injection:
    a bug only one request triggers, raised as the prefill or the step's commit reaches it, after
    the rows before it took theirs). `prefill`: the culprit arrives with five others and their
    shared prefill raises; `step`: it arrives three ticks later and the step it shares with the
    running rows raises mid-commit. Each neighbour keeps what it committed, is prefilled again
    alone and stepped alone until a step succeeds, and equals target-only, greedy and seeded."""
    name, target, _, prompts = proposer
    innocents = prompts[:5]
    token = next(t for t in range(1, 300) if all(t not in p for p in innocents))
    culprit = innocents[0][:4] + [token] + innocents[1][:4]
    key = "row_prefill_error_token" if where == "prefill" else "row_error_token"
    engine = engine_for(pairs, proposer, method, max_batch_size=8, fault_injection={key: token})
    ids = [f"r{i}" for i in range(len(innocents))]
    arrivals = {0: list(zip(ids, innocents))}
    arrivals.setdefault(0 if where == "prefill" else 3, []).append(("bad", culprit))
    sampled = dict(zip(ids[1::2], seeded(2, max_tokens=20)))
    params = {rid: sampled.get(rid, SamplingParams(max_tokens=20)) for rid in ids + ["bad"]}
    outputs, finished, _ = run_schedule(engine, arrivals, {}, params)
    label = f"{name} {method} {where}"
    bad = finished["bad"]
    assert bad.finish_reason == "error" and "injected fault" in bad.error, f"{label}: {bad}"
    rows = []
    for rid, prompt in zip(ids, innocents):
        assert finished[rid].error is None, f"{label} {rid}: {finished[rid].error}"
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        if rid in sampled:
            rows.append((rid, prompt, params[rid], tokens, True))
        else:
            at = first_difference(tokens, list(reference(target, prompt, 20)))
            assert at is None, f"{label} {rid} (greedy) differs from target-only at {at}"
    assert_seeded_equivalent(rows, seeded_reference, target, label=label)
    stats = engine.stats()
    assert stats["isolated_rows"] >= len(innocents) - (where == "step"), stats["isolated_rows"]
    assert engine.pool.num_running == 0 and not engine.pool.waiting


@pytest.mark.parametrize("method", METHODS)
def test_rows_waiting_to_be_prefilled_again_can_be_aborted_and_new_ones_arrive(
        pairs, reference, proposer, method):
    """The hard moment of failure isolation: right after a shared step raised, its rows wait at
    the front of the queue to be prefilled again. An abort then ends that row at once (no token
    after it, one final output), a request arriving then is served beside the recovering rows,
    and every other row still equals target-only greedy."""
    name, target, _, prompts = proposer
    innocents = prompts[:4]
    token = next(t for t in range(1, 300) if all(t not in p for p in innocents + prompts[4:6]))
    culprit = innocents[0][:4] + [token] + innocents[1][:4]
    engine = engine_for(pairs, proposer, method, max_batch_size=8,
                        fault_injection={"row_error_token": token})
    params = SamplingParams(max_tokens=20)
    ids = [f"r{i}" for i in range(len(innocents))]
    for rid, prompt in zip(ids + ["bad"], innocents + [culprit]):
        engine.add_request(rid, prompt, params)
    outputs, aborted_tokens = {}, None
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if aborted_tokens is None and engine.pool.waiting and engine.pool.waiting[0].isolated:
            waiting = [s.request_id for s in engine.pool.waiting if s.isolated]
            assert "r3" in waiting, waiting
            engine.abort("r3")   # while it waits to be prefilled again
            aborted_tokens = sum(len(o.new_token_ids) for o in outputs.get("r3", []))
            engine.add_request("late", prompts[4], params)
    label = f"{name} {method}"
    assert aborted_tokens is not None, f"{label}: no row was ever waiting to be prefilled again"
    finals = {rid: [o for o in outs if o.finished] for rid, outs in outputs.items()}
    assert all(len(f) == 1 for f in finals.values()), f"{label}: final outputs {finals}"
    assert finals["bad"][0].finish_reason == "error"
    r3 = [t for o in outputs["r3"] for t in o.new_token_ids]
    assert finals["r3"][0].finish_reason == "abort" and len(r3) == aborted_tokens, label
    assert r3 == list(reference(target, innocents[3], 20))[:len(r3)], f"{label}: r3 before its abort"
    for rid, prompt in zip(ids[:3] + ["late"], innocents[:3] + [prompts[4]]):
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        assert finals[rid][0].error is None, f"{label} {rid}: {finals[rid][0].error}"
        assert tokens == list(reference(target, prompt, 20)), f"{label} {rid} differs from target-only"
    assert engine.pool.num_running == 0 and not engine.pool.waiting
