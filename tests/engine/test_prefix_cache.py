"""Prefix caching on the block store keeps outputs exact and frees a block only when no row holds
it (design: "Prefix caching").

Requests share a 40-token "system prompt" (two full blocks and a partial one) on the tiny Llama
pair; a second wave arrives after the first has been prefilled, so its prompts start from cached
blocks in both models. Every output is compared with the target alone (greedy: Hugging Face
generate; seeded: the gumbel reference), and the prefill each model was fed is counted.
"""
from __future__ import annotations

import logging
import random

import pytest

from exspec import EngineConfig, LLMEngine, SamplingParams
from exspec.kv.blocks import BLOCK_SIZE
from exspec.models.loading import ModelPair
from exspec.kv.block_cache import BlockCache

from enginekit import assert_equivalent, assert_seeded_equivalent, make_engine, run_schedule
from test_architectures import tokenizer
from tiny_archs import build

SYSTEM = [random.Random(7).randrange(1, 250) for _ in range(40)]


def chat_prompts(seed: int, lengths=(3, 9, 20, 1, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(1, 250) for _ in range(n)] for n in lengths]


def two_waves(engine, first, second, params):
    """`second` arrives once `first` has been prefilled; returns {id: tokens}, the final outputs."""
    arrivals = {0: [(f"a{i}", p) for i, p in enumerate(first)],
                2: [(f"b{i}", p) for i, p in enumerate(second)]}
    outputs, finished, _ = run_schedule(engine, arrivals, {}, params)
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    return tokens, finished


def assert_fed_only_what_missed(engine):
    """Each model's prefill was fed every admitted prompt token except the cached ones."""
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0, stats
    fed = stats["prefix_cache_queries"] - stats["prefix_cache_hits"]
    assert stats["prefill_tokens_target"] == fed, stats
    assert stats["prefill_tokens_draft"] >= fed, stats   # plus any catch-up after plain steps


@pytest.mark.parametrize("k,batch", [(3, 4), pytest.param(1, 8, marks=pytest.mark.slow),
                                     pytest.param(5, 2, marks=pytest.mark.slow)])
def test_cached_prefixes_keep_greedy_output_exact(pairs, reference, k, batch):
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=k, max_batch_size=batch)
    first, second = chat_prompts(1), chat_prompts(2)
    tokens, _ = two_waves(engine, first, second, SamplingParams(max_tokens=24))
    ids = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(second))]
    outs = [type("Out", (), {"token_ids": tokens[i], "error": None}) for i in ids]
    assert_equivalent(outs, first + second, [24] * len(ids), reference,
                      pairs["llama", "target"], 256, label=f"k={k} batch={batch}")
    assert_fed_only_what_missed(engine)
    # every second-wave prompt started from the two cached system-prompt blocks
    assert engine.stats()["prefix_cache_hits"] >= 2 * BLOCK_SIZE * len(second)


def test_cached_prefixes_keep_seeded_output_exact(pairs, seeded_reference):
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=4, max_batch_size=4)
    first, second = chat_prompts(3), chat_prompts(4)
    params = {f"{w}{i}": SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + j)
              for j, (w, i) in enumerate([("a", i) for i in range(5)] + [("b", i) for i in range(5)])}
    tokens, finished = two_waves(engine, first, second, params)
    rows = [(rid, (first if rid[0] == "a" else second)[int(rid[1:])], params[rid], tokens[rid], True)
            for rid in params]
    assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"], label="seeded")
    assert_fed_only_what_missed(engine)


def test_only_full_blocks_before_the_last_prompt_token_are_reused(pairs):
    """A prompt of exactly two blocks reuses one (its last token is fed for the first token's
    logits); one token more reuses both; a prompt sharing 20 tokens reuses one block."""
    engine = make_engine(pairs, method="exspec")
    base = SYSTEM[:32] + [7] * 32
    engine.generate([base], SamplingParams(max_tokens=2))
    hits = []
    for prompt in (base[:32], base[:33], base[:20] + [9] * 30):
        before = engine.stats()["prefix_cache_hits"]
        engine.generate([prompt], SamplingParams(max_tokens=2))
        hits.append(engine.stats()["prefix_cache_hits"] - before)
    assert hits == [16, 32, 16], hits


def store_state(engine):
    """Per store: (cached blocks, cached blocks some table holds, blocks neither free nor cached)."""
    out = []
    for store in engine.pool.prefix.stores:
        cache = store.prefix
        taken = set(range(1, store.num_blocks)) - store.free_set - set(cache.refs)
        out.append((len(cache.refs), sum(r > 0 for r in cache.refs.values()), len(taken)))
    return out


def test_abort_while_sharing_keeps_the_other_row_exact_and_frees_nothing_it_holds(pairs, reference):
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3)
    warm, a, b = chat_prompts(5, lengths=(2, 6, 11))
    engine.generate([warm], SamplingParams(max_tokens=2))   # caches the system prompt's blocks
    arrivals = {0: [("a", a), ("b", b)]}
    outputs, finished, _ = run_schedule(engine, arrivals, {3: ["a"]}, SamplingParams(max_tokens=30))
    assert finished["a"].finish_reason == "abort"
    got = [t for o in outputs["b"] for t in o.new_token_ids]
    assert got == reference(pairs["llama", "target"], b, 30), "b changed when a, sharing its prefix, left"
    # all rows gone: every block is free or cached and unused
    assert all(held == 0 and taken == 0 for _, held, taken in store_state(engine)), store_state(engine)


def early_release(release):
    """The negative control's bug: a cached block another row still holds is freed anyway when
    one row lets go of it."""
    def released(self, blocks):
        shared = [b for b in blocks if self.refs.get(b, 0) > 1]
        return release(self, blocks) + shared
    return released


def shared_then_reused(pairs, reference):
    """Row "long" and row "short" share the system prompt's blocks; "short" leaves, then "new"
    arrives with another prompt and takes free blocks. Returns whether "long" stayed exact."""
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3)
    warm, long_, short = chat_prompts(6, lengths=(2, 4, 5))
    engine.generate([warm], SamplingParams(max_tokens=2))
    other = [random.Random(9).randrange(1, 250) for _ in range(60)]
    arrivals = {0: [("long", long_), ("short", short)], 4: [("new", other)]}
    params = {"long": SamplingParams(max_tokens=40), "short": SamplingParams(max_tokens=2),
              "new": SamplingParams(max_tokens=10)}
    outputs, _, _ = run_schedule(engine, arrivals, {}, params)
    got = [t for o in outputs["long"] for t in o.new_token_ids]
    return got == reference(pairs["llama", "target"], long_, 40)


def test_a_shared_block_is_freed_only_when_no_row_holds_it(pairs, reference):
    assert shared_then_reused(pairs, reference)


def test_freeing_a_shared_block_early_breaks_the_row_still_holding_it(pairs, reference, monkeypatch):
    """Negative control: with the first leaver freeing the shared blocks, "new" overwrites them
    while "long" still reads them."""
    monkeypatch.setattr(BlockCache, "release", early_release(BlockCache.release))
    assert not shared_then_reused(pairs, reference)


def test_eviction_under_a_tight_budget_keeps_outputs_exact_and_counts_shared_blocks_once(pairs, reference):
    """A pool of 16 blocks per model: distinct prompts evict the unused cached blocks, outputs
    stay exact, the reservations never pass the budget, and two requests sharing a prefix fit
    side by side where two without it would not."""
    budget = 2 * 15 * BLOCK_SIZE   # both models; each store: 15 blocks + scratch
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=2, max_num_kv_tokens=budget)
    rng = random.Random(11)
    distinct = [[rng.randrange(1, 250) for _ in range(70)] for _ in range(4)]
    for prompt in distinct:   # one at a time: each prompt's blocks stay cached, then get evicted
        out = engine.generate([prompt], SamplingParams(max_tokens=30))[0]
        assert out.token_ids == reference(pairs["llama", "target"], prompt, 30)
    assert all(store.num_blocks <= 16 for store in engine.pool.prefix.stores)
    first_again = engine.stats()["prefix_cache_hits"]
    engine.generate([distinct[0]], SamplingParams(max_tokens=2))
    assert engine.stats()["prefix_cache_hits"] == first_again, "evicted blocks were found again"

    # peak of a 70-token prompt + 30 tokens + k: 7 blocks per model. Two fit only by sharing
    # the four cached blocks of the prefix (7 + 3 per model, not 14).
    shared = distinct[1][:65]
    engine.generate([shared], SamplingParams(max_tokens=2))   # caches its first four blocks
    prompts = [shared + [1, 2, 3, 4, 5], shared + [6, 7, 8, 9, 10]]
    arrivals = {0: [("x", prompts[0]), ("y", prompts[1])]}
    running_together, reserved = [], []
    ticks = 0
    for rid, prompt in arrivals[0]:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=30))
    outs = {"x": [], "y": []}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
        running_together.append(engine.pool.num_running)
        reserved.append(engine.stats()["pool_kv_tokens_reserved"])
        ticks += 1
    assert max(running_together) == 2, "the shared prefix was reserved twice"
    assert max(reserved) <= budget, reserved
    for rid, prompt in zip("xy", prompts):
        assert outs[rid] == reference(pairs["llama", "target"], prompt, 30), rid


def test_caching_off_is_said_at_load_where_it_cannot_be_exact(pairs, caplog):
    with caplog.at_level(logging.WARNING, logger="exspec"):
        eqspec = make_engine(pairs, method="eqspec")
        sliding = _tiny_engine("mistral", sliding_window=5)
        alibi = _tiny_engine("mpt")
        on = make_engine(pairs, method="exspec")
    assert eqspec.pool.prefix is None and sliding.pool.prefix is None and alibi.pool.prefix is None
    assert on.pool.prefix is not None
    lines = [r.getMessage() for r in caplog.records if "enable_prefix_caching is off" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "method eqspec" in lines[0] and "sliding-window" in lines[1] and "ALiBi" in lines[2], lines
    off = make_engine(pairs, method="exspec", enable_prefix_caching=False)
    assert off.pool.prefix is None and "prefix_cache_hits" not in off.stats()


def _tiny_engine(model_type: str, **config) -> LLMEngine:
    target, draft = build(model_type, seed=3, **config)
    pair = ModelPair(tokenizer(), target, draft, set(), 256)
    return LLMEngine(EngineConfig(target_model=model_type, draft_model=model_type, method="exspec",
                                  num_speculative_tokens=3, adaptive_k=False), pair=pair)


def test_a_tick_failing_after_a_claim_lets_the_claimed_blocks_go(pairs, monkeypatch):
    """A hit's blocks are held from admission; when the tick fails before the row's group
    holds them, they go back to the cache unused (else they would be held for good)."""
    engine = make_engine(pairs, method="exspec")
    warm, prompt = chat_prompts(8, lengths=(2, 3))
    engine.generate([warm], SamplingParams(max_tokens=2))
    monkeypatch.setattr(engine.runner, "new_group", lambda seqs: 1 / 0)
    engine.add_request("failed", prompt, SamplingParams(max_tokens=2))
    engine.step()   # admitted and claimed, then the tick fails (the pool's last resort)
    assert engine.stats()["prefix_cache_hits"] == 2 * BLOCK_SIZE
    assert all(held == 0 and taken == 0 for _, held, taken in store_state(engine)), store_state(engine)
