"""Suffix decoding (spec/suffix.py): the suffix tree against the definition, by brute force (every
substring's count of occurrences, as sequences grow and are removed; every proposal), the global
tree fed only by requests that ended as asked and bounded, the vLLM keys, and the engine's output
exact with it (the conformance battery runs it too: test_proposers.py)."""
from __future__ import annotations

import random

import pytest

from exspec import SamplingParams
from exspec.spec.suffix import SuffixProposer, SuffixTree

from enginekit import make_engine
from exspec.demo.tiny import build_tokenizer
from test_ngram import cyclic_target


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory):
    path = tmp_path_factory.mktemp("cyclic") / "target"
    return str(path), cyclic_target(path, len(build_tokenizer()))


def occurrences(corpus: list[list[int]], s: list[int]) -> int:
    n = len(s)
    return sum(seq[p:p + n] == s for seq in corpus for p in range(len(seq) - n + 1))


def substrings(corpus, depth):
    return {tuple(seq[p:p + n]) for seq in corpus for n in range(1, depth + 1)
            for p in range(len(seq) - n + 1)}


def assert_counts(tree: SuffixTree, corpus, depth, vocab):
    for s in substrings(corpus, depth):
        assert tree.count(list(s)) == occurrences(corpus, list(s)), s
    rng = random.Random(len(corpus))
    for _ in range(50):   # strings that may never occur
        s = [rng.randrange(vocab) for _ in range(rng.randint(1, depth))]
        assert tree.count(s) == occurrences(corpus, s), s


def oracle_speculate(corpus, context, depth, max_tokens, factor, min_prob):
    """The definition: every suffix match (shorter than the context, at most depth tokens),
    the most frequent continuation (lowest id on ties) while its probability holds; the
    highest score wins, the longer match on a tie."""
    context = context[-depth:]
    best, best_score = [], 0.0
    vocab = sorted({t for seq in corpus for t in seq})
    for m in range(1, len(context)):
        s = context[len(context) - m:]
        if occurrences(corpus, s) == 0:
            break
        limit = min(max_tokens, int(m * factor + 1e-6))
        out, score, prob = [], 0.0, 1.0
        while len(out) < limit and len(s) < depth:
            counts = {t: occurrences(corpus, s + [t]) for t in vocab}
            tok = max(counts, key=lambda t: (counts[t], -t))
            if counts[tok] == 0:
                break
            prob *= counts[tok] / occurrences(corpus, s)
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            s = s + [tok]
        if score >= best_score:
            best, best_score = out, score
    return best, best_score


@pytest.mark.parametrize("seed", range(24))
def test_counts_and_proposals_equal_the_definition_as_sequences_grow_and_go(seed):
    rng = random.Random(seed)
    depth, vocab = rng.choice([3, 5, 8]), rng.choice([2, 3, 5])
    tree, corpus = SuffixTree(depth), []
    for seq_id in range(4):
        tokens: list[int] = []
        corpus.append(tokens)
        while len(tokens) < rng.randint(10, 40):   # grown in chunks, as a row commits
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
            tree.extend(seq_id, tokens)
            assert_counts(tree, corpus, depth, vocab)
    for _ in range(20):
        context = [rng.randrange(vocab) for _ in range(rng.randint(2, depth + 3))]
        args = (rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4]))
        got = tree.speculate(context, *args)
        want = oracle_speculate(corpus, context, depth, *args)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (context, args)
    for seq_id in rng.sample(range(4), 3):   # removed in any order
        tree.remove(seq_id)
        corpus[seq_id] = []
        assert_counts(tree, corpus, depth, vocab)
    left = [seq for seq in corpus if seq]
    assert tree.root.count == sum(map(len, left))


def test_a_row_proposes_from_its_own_tree_grown_by_its_new_tokens_only():
    """A row's proposal comes from its own prompt + output (the local tree), and the tree
    grows by the tokens committed since the last step only."""
    proposer = SuffixProposer(max_tree_depth=8)

    class Row:
        def __init__(self, tokens):
            self.tokens, self.num_prompt_tokens = tokens, len(tokens)

        @property
        def output_ids(self):
            return self.tokens[self.num_prompt_tokens:]

    row = Row([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert proposer.propose_row(row, 4) == [7, 8]   # "5 6" seen once: follows it, m = 2 caps it
    row.tokens += [7, 8, 9]
    assert proposer.propose_row(row, 2) == [1, 2]
    assert proposer.local[row]._covered[0] == len(row.tokens)


def test_only_requests_that_end_as_asked_enter_the_global_tree_and_it_stays_bounded():
    proposer = SuffixProposer(max_tree_depth=6, max_cached_requests=2)

    class Row:
        def __init__(self, prompt, output):
            self.tokens, self.num_prompt_tokens = prompt + output, len(prompt)

        @property
        def output_ids(self):
            return self.tokens[self.num_prompt_tokens:]

    answer = [40, 41, 42, 43, 44]
    for reason in ("abort", "error"):
        row = Row([1, 2], answer)
        proposer.propose_row(row, 3)
        proposer.request_done(row, reason)
        assert row not in proposer.local and len(proposer.global_tree) == 0, reason
    asking = Row([9, 40, 41], [])
    assert proposer.propose_row(asking, 3) == []   # nothing learnt from the aborted one
    for i, reason in enumerate(("stop", "length", "stop")):
        proposer.request_done(Row([1, 2], answer if i == 0 else [60 + i, 61 + i]), reason)
    assert len(proposer.global_tree) == 2   # max_cached_requests: the oldest (the answer) went
    assert proposer.propose_row(Row([9, 40, 41], []), 3) == []
    proposer.request_done(Row([1, 2], answer), "stop")
    assert proposer.propose_row(Row([9, 40, 41], []), 3) == [42, 43]   # m = 2 caps it at 2


def test_the_global_tree_holds_at_most_max_cached_tokens_evicting_the_oldest_first():
    """Capped by tokens as well as requests (a few long answers outweigh thousands of short
    ones): past the cap the oldest outputs go, whole, until the rest fit; an output longer than
    the cap never enters (it would evict everything, itself too)."""
    proposer = SuffixProposer(max_tree_depth=6, max_cached_tokens=10)

    class Row:
        def __init__(self, output):
            self.tokens, self.num_prompt_tokens = [1] + output, 1

        @property
        def output_ids(self):
            return self.tokens[1:]

    answers = [[40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63]]
    for answer in answers:
        proposer.request_done(Row(answer), "stop")
    assert len(proposer.global_tree) == 2 and proposer.cached_tokens == 8   # 12 > 10: one went
    assert proposer.global_tree.root.count == 8
    assert proposer.global_tree.count([40, 41]) == 0, "the oldest answer should have gone"
    assert proposer.global_tree.count([50, 51]) == proposer.global_tree.count([60, 61]) == 1
    proposer.request_done(Row(list(range(100, 111))), "length")   # 11 tokens: over the cap
    assert proposer.cached_tokens == 8 and proposer.global_tree.count([100, 101]) == 0
    proposer.request_done(Row([70, 71, 72, 73, 74, 75, 76, 77, 78]), "stop")   # 9: only it fits
    assert len(proposer.global_tree) == 1 and proposer.global_tree.root.count == 9
    assert proposer.global_tree.count([60, 61]) == 0 and proposer.global_tree.count([70, 71]) == 1


def test_the_engine_passes_max_cached_tokens_to_the_proposer(pairs, cyclic):
    engine = make_engine(pairs, target_model=cyclic[0], draft_model=None, proposer="suffix",
                         num_speculative_tokens=4, suffix_decoding_max_cached_tokens=7)
    assert engine.proposer.max_cached_tokens == 7
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(engine.proposer.global_tree) == 0   # 8 output tokens: over the cap


def test_the_engine_with_suffix_decoding_is_exact_and_learns_across_requests(pairs, cyclic):
    """A request repeating an earlier answer is proposed that answer from the global tree (the
    prompt alone holds nothing to look up) and keeps it; every output equals target-only."""
    target, successor = cyclic
    rng = random.Random(11)
    start = rng.randrange(1, len(successor))
    prompt = [start]   # one token: its own tree has nothing to propose
    engine = make_engine(pairs, target_model=target, draft_model=None, proposer="suffix",
                         num_speculative_tokens=8, adaptive_k=False)
    plain = make_engine(pairs, target_model=target, draft_model=None, method="autoregressive",
                        num_speculative_tokens=0)
    params = SamplingParams(max_tokens=6, ignore_eos=True)   # within one cycle: no repeat
    [reference] = plain.generate([prompt], params)
    [first] = engine.generate([prompt], params)
    assert engine.stats()["draft_tokens"] == 0   # nothing to look up yet
    [again] = engine.generate([prompt], params)
    assert first.token_ids == again.token_ids == reference.token_ids
    assert engine.stats()["accepted_tokens"] >= 3, engine.stats()


@pytest.mark.parametrize("config, words", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
])
def test_suffix_keys_out_of_range_are_refused_naming_them(config, words):
    from exspec import EngineConfig
    with pytest.raises(ValueError, match=words):
        EngineConfig(target_model="t", proposer="suffix", **config)


def test_forget_drops_what_was_learnt_across_requests():
    proposer = SuffixProposer(max_tree_depth=6)

    class Row:
        tokens, num_prompt_tokens, output_ids = [1, 40, 41, 42], 1, [40, 41, 42]
    proposer.request_done(Row(), "stop")
    asking = type("Asking", (), {"tokens": [9, 40, 41], "num_prompt_tokens": 3, "output_ids": []})()
    assert proposer.propose_row(asking, 3) == [42]
    proposer.forget()
    assert proposer.propose_row(type(asking)(), 3) == [] and len(proposer.global_tree) == 0


def test_through_the_engine_an_aborted_request_never_feeds_the_global_tree(pairs, cyclic):
    """The wiring, not only the proposer: a request aborted mid-flight (and one whose row ends
    with an error) leaves the global tree empty; one that ends with length enters it."""
    target, successor = cyclic
    engine = make_engine(pairs, target_model=target, draft_model=None, proposer="suffix",
                         num_speculative_tokens=4, adaptive_k=False)
    engine.add_request("aborted", [3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort("aborted")
    # only EOS allowed and EOS held back: no token is allowed, the row ends with an error
    engine.add_request("failed", [3, 4, 5], SamplingParams(max_tokens=8, allowed_token_ids=[0],
                                                           min_tokens=4))
    ends = {}
    while engine.has_unfinished():
        ends.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert ends == {"aborted": "abort", "failed": "error"}
    assert len(engine.proposer.global_tree) == 0
    engine.generate([[3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(engine.proposer.global_tree) == 1
