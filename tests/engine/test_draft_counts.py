"""Draft counters a user can trust: a draft counts as accepted only where the output kept it, and a
row never drafts more tokens than it has left (design: "Definitions", acceptance_rate)."""
import pytest

from exspec import SamplingParams

from enginekit import make_engine, make_prompts

K = 5


def run(engine, prompts, params):
    """Every output of every tick, per request, in order."""
    outs = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        outs[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def twin_counts(n: int, max_tokens: int, k: int = K) -> int:
    """Drafts a request alone with a twin draft (every draft accepted) verifies and keeps, whose
    output has n tokens: the prefill commits the first; a step with `left` tokens to go drafts
    min(k, left) and commits them and the target's next token, as far as the output reaches."""
    out, drafts = 1, 0
    while out < n:
        d = min(k, max_tokens - out)
        c = min(d + 1, n - out)
        drafts += min(d, c)
        out += c
    return drafts


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_each_tick_counts_only_drafts_its_output_kept_and_none_past_max_tokens(pairs, method):
    """Per tick and request: the drafts counted as accepted are among the tokens it committed,
    and the drafts it verified fit in the tokens it had left, whatever ended it (max_tokens,
    EOS, a stop token id) and whatever the draft (noisy: rejections; twin: none)."""
    eos = pairs["llama", "eos"]
    prompts = make_prompts(320, eos, seed=5, count=12)
    for draft in ("noisy", "twin"):
        engine = make_engine(pairs, "llama", draft, method=method, num_speculative_tokens=K,
                             max_batch_size=4)
        params = [SamplingParams(max_tokens=m, ignore_eos=i % 3 == 0,
                                 stop_token_ids=[7 + i] if i % 4 == 1 else [])
                  for i, m in enumerate([1, 2, 3, 4, 6, 7, 9, 11, 13, 20, 20, 25])]
        outs = run(engine, prompts, params)
        for rid, p in zip(outs, params):
            made = drafted = accepted = 0
            for out in outs[rid]:
                new = len(out.new_token_ids)
                got_d = out.num_draft_tokens - drafted
                got_a = out.num_accepted_draft_tokens - accepted
                assert got_a <= new, (f"{draft} {rid}: {got_a} drafts counted accepted in a tick "
                                      f"that committed {new} tokens")
                assert got_d <= p.max_tokens - made, (
                    f"{draft} {rid}: {got_d} drafts verified with {p.max_tokens - made} tokens left")
                made, drafted, accepted = out.num_output_tokens, out.num_draft_tokens, out.num_accepted_draft_tokens
            assert accepted <= drafted and accepted <= made - 1, (draft, rid, accepted, drafted, made)
        stats = engine.stats()
        last = [o[-1] for o in outs.values()]
        assert stats["draft_tokens"] == sum(o.num_draft_tokens for o in last)
        assert stats["accepted_tokens"] == sum(o.num_accepted_draft_tokens for o in last)
        assert stats["accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 6, 7, 8, 12, 20])
def test_a_twin_draft_counts_every_kept_draft_up_to_max_tokens(pairs, max_tokens):
    """With every draft accepted, a request's counts are the drafts its output holds: max_tokens
    20 at k = 5 steps 5 + 5 + 5 drafts (6 tokens each) and, with one token left, drafts 1."""
    engine = make_engine(pairs, "llama", "twin", method="exspec", num_speculative_tokens=K)
    [out] = engine.generate([[11, 12, 13]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    expected = twin_counts(len(out.token_ids), max_tokens)
    assert (out.num_draft_tokens, out.num_accepted_draft_tokens) == (expected, expected), out
    assert engine.stats()["acceptance_rate"] in (1.0, None)


def test_a_stop_token_inside_an_accepted_run_cuts_the_counts_with_the_output(pairs):
    """A stop token id that is the twin's sixth draft of a step at k = 8: the step verified 8
    drafts and the target accepted them all, but the output keeps 6 and counts 6 of 6."""
    engine = make_engine(pairs, "llama", "twin", num_speculative_tokens=8, max_batch_size=4)
    prompt = [11, 12, 13]
    full = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = full[6]
    assert full.index(stop_at) == 6, "the test needs a token first seen at position 6"
    before = engine.stats()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                     stop_token_ids=[stop_at]))
    assert out.token_ids == full[:7] and out.finish_reason == "stop"
    assert (out.num_draft_tokens, out.num_accepted_draft_tokens) == (6, 6), out
    after = engine.stats()
    assert after["accepted_tokens"] - before["accepted_tokens"] == 6
    assert after["draft_tokens"] - before["draft_tokens"] == 6


def test_a_stop_string_inside_an_accepted_run_cuts_the_counts_with_the_output(pairs):
    """A stop string ending inside a twin's accepted run: the drafts counted are those of the
    tokens kept (the stop string's tokens are not part of the output's text but are its tokens)."""
    engine = make_engine(pairs, "llama", "twin", num_speculative_tokens=8, max_batch_size=4)
    full = engine.generate(["hello world"], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    stop = next(full.text[i:i + 2] for i in range(3, len(full.text) - 2)
                if full.text[i:i + 2].strip() and full.text.find(full.text[i:i + 2]) == i)
    [out] = engine.generate(["hello world"], SamplingParams(max_tokens=9, ignore_eos=True,
                                                            stop=[stop]))
    assert out.finish_reason == "stop" and len(out.token_ids) < 9, out
    kept = len(out.token_ids) - 1   # the prefill's token is the only one not drafted
    assert (out.num_draft_tokens, out.num_accepted_draft_tokens) == (kept, kept), out
