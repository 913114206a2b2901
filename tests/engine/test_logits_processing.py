"""vLLM's logits processing (penalties, min_p, min_tokens, logit_bias, allowed_token_ids,
bad_words) is exact under speculation: for every parameter, at a value that changes the output,
eqspec and exspec give the target-only output (method "autoregressive", the same processing one
token at a time) token for token, greedy and seeded (gumbel), at batch 1 and in mixed batches of 4
where every row asks for something else. The make-test part runs one llama pair; the gpt2 pair
and more k are slow.
"""
from __future__ import annotations

import pytest
import torch

from exspec import InvalidRequestError, SamplingParams
from exspec.sampling.logits_processing import RowProcessing, bad_words_token_ids

from enginekit import first_difference, make_engine, make_prompts

MAX_TOKENS = 20
PROMPTS = 4


def case_values(tokenizer, eos: int, off_outputs: list[list[int]]) -> dict[str, dict]:
    """One value per parameter that changes the output of these prompts (checked below)."""
    first_tokens = sorted({out[0] for out in off_outputs if out})
    return {
        "repetition_penalty": dict(repetition_penalty=1.8),
        "repetition_penalty_below_1": dict(repetition_penalty=0.5),
        "frequency_penalty": dict(frequency_penalty=2.0),
        "presence_penalty": dict(presence_penalty=2.0),
        "min_p": dict(min_p=0.3),
        # a token the unprocessed output starts with, as a stop token held back by min_tokens
        "min_tokens": dict(min_tokens=MAX_TOKENS - 2, stop_token_ids=[first_tokens[-1]]),
        "logit_bias": dict(logit_bias={str(first_tokens[0]): -100.0, 7: 4.0}),
        "allowed_token_ids": dict(allowed_token_ids=list(range(40, 90)) + [eos]),
        "bad_words": dict(bad_words=[_bad_word(tokenizer, off_outputs)]),
    }


def _bad_word(tokenizer, off_outputs) -> str:
    """A word the unprocessed output contains as two or more tokens (a multi-token ban)."""
    for out in off_outputs:
        for i in range(len(out) - 2):
            word = tokenizer.decode(out[i:i + 3])
            ids = bad_words_token_ids(tokenizer, [word])
            if word.strip() and ids and len(ids[0]) >= 2 and _contains(out, ids[0]):
                return word
    raise AssertionError("no multi-token word in the outputs")


def _contains(seq, part) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.fixture(scope="module")
def engines(pairs):
    """engines(arch, method, batch, k): one engine per cell, built once for the module."""
    built = {}

    def get(arch, method, batch, k=4):
        if (arch, method, batch, k) not in built:
            built[arch, method, batch, k] = make_engine(
                pairs, arch, "noisy", method=method, num_speculative_tokens=k,
                max_batch_size=batch, max_num_seqs=16)
        return built[arch, method, batch, k]
    return get


def sampled(values: dict, seed: int) -> dict:
    return dict(values, temperature=0.6, seed=seed) if seed is not None else values


def run(engine, prompts, params_list) -> list[list[int]]:
    outs = engine.generate(prompts, params_list)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def check_exact(engines, pairs, arch, method, batch, k, seeded: bool):
    """Every parameter, every prompt: speculative == autoregressive, and the parameter changes
    the output of at least one prompt."""
    tokenizer = engines(arch, "autoregressive", 1).tokenizer
    eos = pairs[arch, "eos"]
    prompts = make_prompts(320, eos, seed=batch * 10 + k, count=PROMPTS, max_len=12)
    seed = 1000 if seeded else None

    def params(values, i):
        return SamplingParams(max_tokens=MAX_TOKENS, **sampled(values, seed and seed + i))

    reference = engines(arch, "autoregressive", 1)
    off = run(reference, prompts, [params({}, i) for i in range(PROMPTS)])
    cases = case_values(tokenizer, eos, off)
    rows = [(name, i) for name in cases for i in range(PROMPTS)]
    all_params = [params(cases[name], i) for name, i in rows]
    all_prompts = [prompts[i] for _, i in rows]
    expected = run(reference, all_prompts, all_params)
    got = run(engines(arch, method, batch, k), all_prompts, all_params)
    for j, (name, i) in enumerate(rows):
        at = first_difference(got[j], expected[j])
        assert at is None, (f"{method} B={batch} k={k} {'seeded' if seeded else 'greedy'} "
                            f"{name}={cases[name]} prompt {i} differs at output position {at}: "
                            f"got {got[j][at:at + 5]}, expected {expected[j][at:at + 5]}")
    for name in cases:
        changed = any(expected[j] != off[i] for j, (n, i) in enumerate(rows) if n == name)
        if name == "min_p" and not seeded:   # it keeps the top token: greedy never changes
            assert not changed, "min_p changed a greedy output"
        else:
            assert changed, f"{name}={cases[name]} changes no output: the case tests nothing"
    stats = engines(arch, method, batch, k).stats()
    assert stats["accepted_tokens"] > 0, "the drafts were never accepted: the draft proposes under another rule"


@pytest.mark.parametrize("method,batch,seeded", [
    ("eqspec", 4, False), ("eqspec", 4, True), ("exspec", 4, False), ("exspec", 4, True),
    ("exspec", 1, True), pytest.param("exspec", 1, False, marks=pytest.mark.slow)])
def test_processing_is_exact_under_speculation(engines, pairs, method, batch, seeded):
    check_exact(engines, pairs, "llama", method, batch, 4, seeded)


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method,batch,k", [("eqspec", 1, 2), ("eqspec", 4, 7), ("exspec", 4, 1)])
def test_processing_is_exact_on_gpt2_and_other_k(engines, pairs, method, batch, k, seeded):
    check_exact(engines, pairs, "gpt2", method, batch, k, seeded)


def test_ignoring_the_drafts_in_the_history_breaks_exactness(engines, pairs, monkeypatch):
    """Negative control: verification positions processed with the committed history alone (the
    drafts before each position left out) give other tokens than the target alone."""
    apply = RowProcessing.apply

    def committed_only(self, logits, drafts=None, first=0):
        return torch.cat([apply(self, logits[:, t:t + 1]) for t in range(logits.shape[1])], dim=1)

    monkeypatch.setattr(RowProcessing, "apply", committed_only)
    with pytest.raises(AssertionError, match="differs at output position"):
        check_exact(engines, pairs, "llama", "exspec", 4, 4, seeded=False)


def test_bad_words_tokenised_as_vllm_does(engines):
    """Each word left-stripped, and again after a space when that gives other ids of the same length."""
    tokenizer = engines("llama", "autoregressive", 1).tokenizer
    plain = tokenizer.encode("the", add_special_tokens=False)
    spaced = tokenizer.encode(" the", add_special_tokens=False)
    expected = [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])
    assert bad_words_token_ids(tokenizer, ["  the"]) == expected


@pytest.mark.parametrize("values,message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3."),
    (dict(repetition_penalty=0), "repetition_penalty must be greater than zero, got 0."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(logit_bias={"x": 1.0}), "logit_bias must map token ids"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(min_tokens=2, stop=["x"]), "min_tokens with stop strings is not supported"),
])
def test_out_of_range_values_are_refused_in_vllms_words(values, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**values)
    assert message in str(err.value)


def test_token_ids_outside_the_vocabulary_are_refused(engines):
    engine = engines("llama", "autoregressive", 1)
    with pytest.raises(InvalidRequestError, match=r"token_id\(s\) \[5000\] in logit_bias contain out-of-vocab"):
        engine.add_request("a", [1, 2], SamplingParams(logit_bias={5000: 1.0}))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids contains out-of-vocab token id!"):
        engine.add_request("b", [1, 2], SamplingParams(allowed_token_ids=[1, 5000]))


def test_a_bad_words_prefix_is_matched_on_generated_tokens_only(pairs, engines):
    """vLLM matches a multi-token bad word's prefix against the output alone: a prompt ending
    with the prefix does not ban the word's last token as the first output token."""
    engine = engines("llama", "exspec", 4)
    tokenizer = engine.tokenizer
    for prompt in make_prompts(320, pairs["llama", "eos"], seed=21, count=16):
        (first,) = engine.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids
        word = tokenizer.decode([prompt[-1], first])
        ids = bad_words_token_ids(tokenizer, [word])
        if word.strip() and ids and ids[0] == [prompt[-1], first]:
            break
    else:
        raise AssertionError("no prompt whose last token and first output make a two-token word")
    banned = engine.generate([prompt], SamplingParams(max_tokens=1, bad_words=[word]))[0]
    assert banned.token_ids == [first], "the prompt's last token matched the word's prefix"
