"""One hostile request never fails its neighbours. Values a step cannot carry (past float32 or
int64, a top_p or penalty that is 0 in float32, an unsatisfiable grammar) are refused at
add_request naming the field; a row whose constraints leave no token allowed ends alone with a
clear error at the same position as on the target-only path, never with an arbitrary token;
every innocent row batched beside it equals target-only. Also the in-process API's edges: an
abort that races its request's end, generate's prompts and params of different lengths.
"""
from __future__ import annotations

import pytest

from exspec import InvalidRequestError, SamplingParams

from enginekit import assert_equivalent, make_engine, make_prompts, run_schedule

HUGE = 1e39   # past float32's range


@pytest.mark.parametrize("field, value, words", [
    ("temperature", HUGE, "temperature"),
    ("repetition_penalty", HUGE, "repetition_penalty"),
    ("repetition_penalty", 1e-46, "repetition_penalty"),   # 0 in float32: a division by zero
    ("top_p", 1e-46, "top_p"),                             # 0 in float32: nothing kept
    ("logit_bias", {5: HUGE}, "logit_bias"),
])
def test_values_a_step_cannot_carry_are_refused_naming_the_field(field, value, words):
    with pytest.raises(InvalidRequestError, match=words):
        SamplingParams(**{"max_tokens": 8, "temperature": 0.8, field: value})


def test_min_tokens_past_the_default_max_tokens_is_refused_at_add_request(pairs):
    engine = make_engine(pairs, method="exspec")
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        engine.add_request("r", [5, 6, 7], SamplingParams(min_tokens=2**63))


def test_a_tiny_temperature_is_raised_as_vllm_raises_it():
    assert SamplingParams(temperature=1e-40).temperature == 0.01
    assert SamplingParams(temperature=0.0).greedy


def test_a_top_k_past_int64_samples_as_top_k_off(pairs):
    engine = make_engine(pairs, method="exspec")
    prompts = make_prompts(320, pairs["llama", "eos"], seed=2, count=2)
    off, huge = (engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.9, seed=3,
                                                          top_k=top_k)) for top_k in (0, 2**63))
    assert [o.token_ids for o in huge] == [o.token_ids for o in off]


def test_an_unsatisfiable_regex_is_refused_at_add_request(pairs):
    engine = make_engine(pairs, method="exspec")
    with pytest.raises(InvalidRequestError, match="admits no output"):
        engine.add_request("r", "hello", SamplingParams(structured_outputs={"regex": r"[^\s\S]"}))


def banned_everywhere(eos: int, **extra) -> SamplingParams:
    """Only EOS allowed, and EOS held back by min_tokens: position 0 allows nothing."""
    return SamplingParams(max_tokens=12, allowed_token_ids=[eos], min_tokens=4, **extra)


def ended_grammar(**extra) -> SamplingParams:
    """A one-word choice: once the word is out only EOS may follow, which min_tokens holds back."""
    return SamplingParams(max_tokens=12, structured_outputs={"choice": ["ab"]}, min_tokens=8, **extra)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("hostile", ["banned_everywhere", "ended_grammar"])
def test_a_row_left_without_tokens_ends_alone_with_an_error(pairs, reference, method, hostile):
    """Beside it, a greedy row and a seeded row; draft stop on (adaptive k: its confidences at
    a position with no token must not fail the group)."""
    eos = pairs["llama", "eos"]
    bad = banned_everywhere(eos) if hostile == "banned_everywhere" else ended_grammar()
    prompts = make_prompts(320, eos, seed=4, count=3)
    params = [SamplingParams(max_tokens=12), bad, SamplingParams(max_tokens=12, temperature=0.8, seed=6)]
    outs = make_engine(pairs, method=method, adaptive_k=True, max_batch_size=4).generate(prompts, params)
    alone = make_engine(pairs, method="autoregressive", draft_model=None).generate(prompts, params)
    assert outs[1].finish_reason == "error" and "no token is allowed" in outs[1].error, outs[1]
    assert (outs[1].token_ids, outs[1].error) == (alone[1].token_ids, alone[1].error), \
        "the hostile row must end where the target-only path ends it"
    assert eos not in outs[1].token_ids and 0 not in outs[1].token_ids
    assert_equivalent(outs[:1], prompts[:1], [12], reference, pairs["llama", "target"], 256, method)
    assert outs[2].error is None and outs[2].token_ids == alone[2].token_ids


def test_an_abort_that_races_its_requests_end_does_not_reach_the_next_request(pairs):
    """abort(id) lands while the tick that finishes the request runs; the id is then free and a
    new request under it must run to its end."""
    engine = make_engine(pairs, method="exspec")
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1))   # its first token ends it
    begin = engine.pool.begin_tick

    def begin_with_an_abort():
        engine.abort("r")   # from another thread, as it were: after the tick took its aborts
        return begin()

    engine.pool.begin_tick = begin_with_an_abort
    outs = engine.step()
    engine.pool.begin_tick = begin
    assert [o.finish_reason for o in outs] == ["length"]
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.finish_reason, o.num_output_tokens) for o in finals] == [("length", 4)]


def test_generate_refuses_prompts_and_params_of_different_lengths(pairs):
    engine = make_engine(pairs, method="exspec")
    with pytest.raises(ValueError, match="lengths"):
        engine.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2)])
    with pytest.raises(ValueError, match="lengths"):
        engine.generate([[5, 6]], [SamplingParams(max_tokens=2)] * 2)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_a_row_left_without_tokens_mid_flight_leaves_arriving_and_running_rows_exact(
        pairs, reference, seeded_reference, method):
    """The hard case: rows arrive tick by tick into running groups (EXSPEC merges them), the
    hostile one joins mid-flight and ends with its error a few tokens in, one row is aborted;
    every other row equals its target-only output (greedy and seeded)."""
    eos = pairs["llama", "eos"]
    prompts = make_prompts(320, eos, seed=9, count=5)
    ids = ["a", "b", "hostile", "c", "d"]
    params = {"a": SamplingParams(max_tokens=20), "b": SamplingParams(max_tokens=20, temperature=0.9, seed=5),
              "hostile": ended_grammar(), "c": SamplingParams(max_tokens=20),
              "d": SamplingParams(max_tokens=20, temperature=0.7, seed=8)}
    arrivals = {0: [("a", prompts[0])], 1: [("b", prompts[1])], 3: [("hostile", prompts[2])],
                4: [("c", prompts[3])], 6: [("d", prompts[4])]}
    engine = make_engine(pairs, method=method, adaptive_k=True, max_batch_size=4)
    outputs, finished, _ = run_schedule(engine, arrivals, {9: ["c"]}, params)
    tokens = {rid: [t for o in outputs[rid] for t in o.new_token_ids] for rid in ids}
    alone = make_engine(pairs, method="autoregressive", draft_model=None).generate(
        [prompts[2]], [params["hostile"]])[0]
    assert finished["hostile"].finish_reason == "error" and "no token is allowed" in finished["hostile"].error
    assert tokens["hostile"] == alone.token_ids and alone.finish_reason == "error"
    target = pairs["llama", "target"]
    for rid, prompt in zip(ids, prompts):
        if rid == "hostile":
            continue
        out = finished[rid]
        assert out.error is None, (rid, out.error)
        complete = out.finish_reason != "abort"
        if params[rid].greedy:
            expected = reference(target, prompt, 20)
        else:
            expected, _ = seeded_reference(target, prompt, params[rid])
        assert tokens[rid] == (expected if complete else expected[:len(tokens[rid])]), rid
    assert finished["c"].finish_reason in ("abort", "length", "stop")


def hostile_values(eos: int, vocab: int):
    """field -> values a hostile or careless client sends: out of range, past float32 or int64,
    NaN and infinities, conflicting constraints, grammars nothing satisfies."""
    nan, inf = float("nan"), float("inf")
    return {
        "temperature": [HUGE, -1.0, nan, inf, 1e-40, 0.0, 50.0],
        "top_p": [0.0, -0.5, 1.5, 1e-46, nan],
        "top_k": [-5, 2**63, 2**31, 10**30],
        "min_p": [-1.0, 2.0, nan],
        "repetition_penalty": [0.0, -1.0, HUGE, 1e-46, inf],
        "frequency_penalty": [HUGE, -HUGE, nan, 2.0],
        "presence_penalty": [HUGE, -2.0, inf],
        "logit_bias": [{5: HUGE}, {5: -HUGE}, {-1: 5.0}, {10**9: 1.0}, {eos: -100.0}],
        "allowed_token_ids": [[], [-1], [10**9], [eos], [eos + 1]],
        "min_tokens": [2**63, -1, 100],
        "max_tokens": [0, -1, 2**63, 1],
        "stop_token_ids": [[-1], [10**12], [eos + 2]],
        "bad_words": [[""], ["zz" * 500], ["a"]],
        "structured_outputs": [{"choice": []}, {"regex": "("}, {"regex": r"[^\s\S]"},
                               {"json": {"type": "banana"}}, {"choice": ["ab"]}],
        "seed": [-1, 2**64],
        "n": [0, -1, 10**6],
        "logprobs": [-1, 10**6],
    }


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_fuzz_hostile_values_beside_innocent_rows(pairs, method):
    """Random hostile values (1-3 fields each) batched with a greedy and a seeded innocent row,
    round after round on one engine: every hostile request is refused with InvalidRequestError
    or ends (stop, length, or error with a message); none raises anything else or fails a group;
    every innocent output equals its target-only output."""
    import random
    rng = random.Random(1234 if method == "exspec" else 4321)
    eos = pairs["llama", "eos"]
    values = hostile_values(eos, 320)
    prompts = make_prompts(320, eos, seed=11, count=4)
    innocent = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.8, seed=9)]
    expected = [o.token_ids for o in make_engine(pairs, method="autoregressive", draft_model=None)
                .generate(prompts[:2], innocent)]
    engine = make_engine(pairs, method=method, adaptive_k=True, max_batch_size=4)
    refused = ended = 0
    for round_ in range(30):
        hostile = []
        for _ in range(2):
            fields = rng.sample(sorted(values), rng.choice([1, 1, 1, 2, 3]))
            kwargs = {"max_tokens": 10, **{f: rng.choice(values[f]) for f in fields}}
            try:
                hostile.append((kwargs, SamplingParams(**kwargs)))
            except InvalidRequestError:
                refused += 1
        ids = []
        for i, params in enumerate(innocent):
            engine.add_request(f"{round_}-ok{i}", prompts[i], params)
        for j, (kwargs, params) in enumerate(hostile):
            try:
                engine.add_request(f"{round_}-bad{j}", prompts[2 + j], params)
                ids.append(f"{round_}-bad{j}")
            except InvalidRequestError:
                refused += 1
        finals, tokens = {}, {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    finals[o.request_id] = o
        for i in range(2):
            rid = f"{round_}-ok{i}"
            assert finals[rid].error is None and tokens[rid] == expected[i], (round_, hostile)
        for rid in ids:
            out = finals[rid]
            assert out.finish_reason in ("stop", "length", "error"), (rid, out)
            assert out.finish_reason != "error" or out.error, (rid, out)
            ended += 1
    print(f"\n{method}: {refused} hostile requests refused, {ended} ran to their end")
    assert refused and ended, (refused, ended)   # both kinds met
