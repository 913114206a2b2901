"""Nothing compiles after READY: a randomized serving session on the compiled path (design: "The
fast decode path"). After the engine's warm-up, requests arrive at random ticks and some are
aborted; they share prompt prefixes (prefix-cache hits), some prompts are longer than a tick's
token budget (chunked prefill), some ask for n > 1 samples or a structured output, each caps its
own k (plain steps among speculative ones, adaptive k moving), and contexts grow across the
block store's table buckets. Dynamo's counters must not move, nothing may be logged as a new
shape, and every greedy token is the target-only one.

Dynamo's guards decide recompiles, so Dynamo's "eager" backend covers both methods quickly;
inductor's lowering may add guards of its own, so the served backend runs the session too, with
inductor's counters.
"""
import logging
import random

import pytest
import torch
import torch._dynamo.utils

from exspec import SamplingParams
from exspec.models import compiled

from enginekit import make_engine, run_schedule
from test_compiled import NEW_SHAPE

MAX_BATCH = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()   # each engine's models are new: start from an empty code cache
    yield
    torch._dynamo.reset()


def compile_counts() -> dict:
    """Dynamo's graphs and breaks, and inductor's graph compilations (FX graph cache lookups:
    a hit or a miss is one graph built for inductor)."""
    inductor = torch._dynamo.utils.counters["inductor"]
    return {**compiled.dynamo_counts(),
            "inductor_graphs": inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"]
            + inductor["fxgraph_cache_bypass"]}


def session(eos: int, vocab: int, seed: int, count: int):
    """Random requests: (arrivals, aborts, params, prompts). Prompts of 1-150 tokens, half of
    them starting with one of two shared 40-token prefixes; max_tokens up to 90, so contexts run
    from a block to past 128 columns (table widths 1 .. 16 blocks)."""
    rng = random.Random(seed)
    token = lambda: rng.choice([t for t in range(1, vocab) if t != eos])   # noqa: E731
    prefixes = [[token() for _ in range(40)] for _ in range(2)]
    arrivals, aborts, params, prompts = {}, {}, {}, {}
    for i in range(count):
        rid = f"r{i}"
        # one-token prompts too: a cache of one column is a size torch specialises
        body = [token() for _ in range(rng.choice([1, 2, 5, 17, 60, 110]))]
        prompt = (rng.choice(prefixes) + body) if i % 2 else body
        prompts[rid] = prompt
        kind = i % 5
        extra = {}
        if kind == 3:
            extra = dict(n=2, temperature=0.9, seed=i)
        elif kind == 4:
            extra = dict(structured_outputs={"choice": ["alpha beta", "gamma"]})
        params[rid] = SamplingParams(max_tokens=rng.randint(3, 90), ignore_eos=rng.random() < 0.3,
                                     num_speculative_tokens=rng.choice([None, None, 0, 1, 2]),
                                     **extra)
        tick = rng.randint(0, 30)
        arrivals.setdefault(tick, []).append((rid, prompt))
        if rng.random() < 0.2:
            aborts.setdefault(tick + rng.randint(1, 6), []).append(rid)
    return arrivals, aborts, params, prompts


# inductor (C++ kernels): its lowering may add guards of its own, so the served backend runs the
# session too; a cold warm-up of the pair takes 1-3 minutes on 2 cores
@pytest.mark.parametrize("method,backend,proposer,attention_backend", [
    ("exspec", "eager", "draft_model", None), ("eqspec", "eager", "draft_model", None),
    ("exspec", "inductor", "draft_model", None),
    # the hybrid: suffix decoding's proposals and the draft's through the same graphs
    ("exspec", "eager", "draft_model_suffix", None),
    # the block store read in place (kv/in_place.py): a graph per query width
    ("exspec", "eager", "draft_model", "FLEX_ATTENTION"),
    # its kernels' block lists, compiled: a cold warm-up compiles 17 FlexAttention graphs
    # (test_in_place.py checks them compiled on every `make test`)
    pytest.param("exspec", "inductor", "draft_model", "FLEX_ATTENTION", marks=pytest.mark.slow)])
def test_a_random_session_compiles_nothing_after_warm_up(pairs, reference, method, backend, proposer,
                                                         attention_backend, monkeypatch, caplog):
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", backend)
    if proposer == "draft_model_suffix":   # suffix decoding wherever it proposes: rows of both kinds
        from exspec.spec.hybrid import HybridProposer
        monkeypatch.setattr(HybridProposer, "head_expected", lambda self, row, cap: 0.0)
    in_place = {} if attention_backend is None else dict(attention_backend=attention_backend,
                                                         max_num_kv_tokens=2 * 6 * 256)
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=MAX_BATCH,
                         max_num_seqs=6, adaptive_k=True, num_speculative_tokens=4,
                         max_num_batched_tokens=64, enforce_eager=False, proposer=proposer,
                         **in_place)
    assert engine.warm_up.graph_breaks == 0, engine.warm_up.describe()
    before = compile_counts()
    if backend == "inductor":
        assert before["inductor_graphs"] >= engine.warm_up.graphs > 0, before
    vocab = len(engine.tokenizer)
    arrivals, aborts, params, prompts = session(pairs["llama", "eos"], vocab, seed=7, count=24)
    with caplog.at_level(logging.WARNING, logger="exspec"):
        outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)

    assert compile_counts() == before, f"after warm-up: {before} -> {compile_counts()}"
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]
    # the session met what it claims to: every row count, plain and speculative steps,
    # prefix-cache hits and chunked prefills
    stats = engine.stats()
    shapes = stats["steps_by_shape"]
    assert {s["rows"] for s in shapes} >= set(range(1, MAX_BATCH + 1)), shapes
    assert 0 in {s["k"] for s in shapes} and max(s["k"] for s in shapes) >= 2, shapes
    if method == "exspec":
        assert stats["prefix_cache_hits"] > 0, stats
    if proposer == "draft_model_suffix":
        assert min(engine.proposer.chosen.values()) > 0, engine.proposer.chosen
    assert any(len(p) > 64 for p in prompts.values()) and any(len(p) == 1 for p in prompts.values())
    for rid, prompt in prompts.items():
        p = params[rid]
        if p.n > 1 or p.structured_outputs is not None or finished[rid].finish_reason == "abort":
            continue
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        ref = reference(pairs["llama", "target"], prompt, p.max_tokens)   # stops at EOS
        got = tokens[:len(ref)] if p.ignore_eos else tokens
        assert got == ref, f"{rid}: got {tokens}, expected {ref}"


def test_inputs_of_other_strides_compile_nothing_after_warm_up(pairs, monkeypatch, caplog):
    """Dynamo guards strides as well as sizes: the benchmark's forward costs feed positions
    broadcast over rows (stride 0), which compiled a new graph after the warm-up (seen with
    inductor on the deep-narrow pair) until the runner made compiled inputs contiguous."""
    from exspec.bench.paths import forward_costs
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4,
                         num_speculative_tokens=3, enforce_eager=False)
    before = compile_counts()
    with caplog.at_level(logging.WARNING, logger="exspec"):
        rows = forward_costs(engine, [1, 4], 3, repeats=1)
    assert len(rows) == 4
    assert compile_counts() == before, f"after warm-up: {before} -> {compile_counts()}"
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]


@pytest.mark.parametrize("method", ["autoregressive", "eqspec"])
def test_a_one_token_prompt_alone_compiles_nothing_after_warm_up(pairs, reference, method, monkeypatch,
                                                                 caplog):
    """The padded layout's cache holds one column after a one-token prompt, a size torch gives a
    graph of its own (the warm-up's prompts are longer): seen in make demo as "1 rows, 1 tokens,
    2 KV columns" compiled after READY, until the layout padded such a cache to two columns."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=2,
                         num_speculative_tokens=0 if method == "autoregressive" else 3,
                         enforce_eager=False)
    before = compile_counts()
    prompt = [7]
    with caplog.at_level(logging.WARNING, logger="exspec"):
        out = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert compile_counts() == before, f"after warm-up: {before} -> {compile_counts()}"
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]
    assert out.token_ids == reference(pairs["llama", "target"], prompt, 8)


def static_session(pairs, reference, proposer, monkeypatch, caplog, attention_backend=None):
    """A random session on the compiled path with static shapes (the eager backend): the
    engine, after it checked every output against the target alone."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(compiled, "STATIC_SHAPES", True)
    if proposer == "draft_model_suffix":
        from exspec.spec.hybrid import HybridProposer
        monkeypatch.setattr(HybridProposer, "head_expected", lambda self, row, cap: 0.0)
    in_place = {} if attention_backend is None else dict(attention_backend=attention_backend,
                                                         max_num_kv_tokens=2 * 6 * 256)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=MAX_BATCH,
                         max_num_seqs=6, adaptive_k=True, num_speculative_tokens=K,
                         max_num_batched_tokens=64, enforce_eager=False, proposer=proposer,
                         **in_place)
    before = compile_counts()
    arrivals, aborts, params, prompts = session(pairs["llama", "eos"], len(engine.tokenizer), seed=7, count=24)
    with caplog.at_level(logging.INFO, logger="exspec"):
        outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)
    assert compile_counts() == before, f"after warm-up: {before} -> {compile_counts()}"
    for rid, prompt in prompts.items():
        p = params[rid]
        if p.n > 1 or p.structured_outputs is not None or finished[rid].finish_reason == "abort":
            continue
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        ref = reference(pairs["llama", "target"], prompt, p.max_tokens)
        got = tokens[:len(ref)] if p.ignore_eos else tokens
        assert got == ref, f"{rid}: got {tokens}, expected {ref}"
    return engine


K = 4


@pytest.mark.parametrize("proposer,attention_backend", [
    ("draft_model", None), ("draft_model_suffix", None),
    ("draft_model", "FLEX_ATTENTION")])   # CUDA graphs reading in place: pad rows in the BlockMask
def test_with_static_shapes_a_random_session_meets_only_shapes_the_warm_up_built(
        pairs, reference, proposer, attention_backend, monkeypatch, caplog):
    """CUDA graphs' rule on the CPU: a graph per concrete (rows, tokens, KV columns), every one
    built in the warm-up, any other run eagerly. In a random session (every row count, plain and
    speculative steps of every width, contexts crossing table buckets) the target runs only
    shapes the warm-up built, and the draft only those and its catch-up forwards wider than
    k + 1 (after plain steps), so on a GPU nothing would be captured after READY; outputs exact."""
    from exspec.engine.runner import ModelRunner
    pieced, in_pieces = [], ModelRunner._in_pieces   # forwards wider than the graphs built
    monkeypatch.setattr(ModelRunner, "_in_pieces", lambda self, *a: pieced.append(a[2].shape[1]) or in_pieces(self, *a))
    engine = static_session(pairs, reference, proposer, monkeypatch, caplog, attention_backend)
    target = engine.runner.decode_forwards[engine.target]
    slots = engine.runner.kv_layout.store(engine.target).num_blocks * 16 if attention_backend else None
    shapes = compiled.static_shapes(MAX_BATCH, K, engine.max_model_len, slots)
    # rows in buckets: 3 rows run as 4 (a pad row), so no 3-row graph is built
    assert {r for r, _, _ in shapes} == {1, 2, 4}
    assert len(shapes) == 3 * K * len({c for _, _, c in shapes})
    assert attention_backend or max(c for _, _, c in shapes) >= 256
    for forward in engine.runner.decode_forwards.values():
        assert forward.static_shapes and forward.in_place == bool(attention_backend)
        assert forward.shapes >= {forward.key(s) for s in shapes}
    assert target.eager_forwards == 0, sorted(target.eager_shapes)
    # the draft's catch-ups after more than K plain steps went in pieces through its graphs
    draft = engine.runner.decode_forwards[engine.proposer.models[0]]
    assert draft.widest == K + 1 and draft.eager_forwards == 0, sorted(draft.eager_shapes)
    assert pieced and min(pieced) > K + 1, pieced
    steps = {(s["rows"], s["k"]) for s in engine.stats()["steps_by_shape"]}
    assert {r for r, _ in steps} >= set(range(1, MAX_BATCH + 1)) and {k for _, k in steps} >= {0, 1, K}, steps


def test_a_shape_the_static_warm_up_left_out_runs_eagerly_and_exactly(pairs, reference, monkeypatch, caplog):
    """Negative control: a warm-up that leaves out the four-row bucket; the session's three-
    and four-row forwards (both padded to four rows) then run eagerly (logged, counted), and
    every output is still exact."""
    full = compiled.static_shapes
    monkeypatch.setattr(compiled, "static_shapes", lambda *a: [s for s in full(*a) if s[0] != 4])
    engine = static_session(pairs, reference, "draft_model", monkeypatch, caplog)
    target = engine.runner.decode_forwards[engine.target]
    assert target.eager_forwards > 0 and {rows for rows, _, _ in target.eager_shapes} == {4}
    assert [r for r in caplog.records if "did not build" in r.getMessage()]


def test_a_static_shape_the_warm_up_could_not_build_refuses_to_load_naming_it(pairs, monkeypatch):
    """Loading fails, naming the shape, rather than serving with a graph missing: here the
    warm-up's extra shapes are never run (a shape forward that does nothing)."""
    from exspec.errors import ModelLoadError
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(compiled, "STATIC_SHAPES", True)
    monkeypatch.setattr(compiled, "_shape_forward", lambda *a: None)
    with pytest.raises(ModelLoadError, match=r"did not build .* first \(rows, tokens, KV columns\) = "
                                             r"\(1, 2, \d+\); set enforce_eager"):
        make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                    num_speculative_tokens=2, enforce_eager=False)


def test_a_forward_wider_than_the_graphs_built_goes_in_pieces_and_computes_the_same(pairs, monkeypatch):
    """Static shapes build widths up to k + 1; a draft's catch-up after more plain steps is
    wider and goes in pieces through those graphs. Rows 7 and 2 tokens behind (left-padded,
    so the short row sits out the first piece): the same logits as the whole forward run
    eagerly, the same KV lengths, and a next token reads the same cache."""
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(compiled, "STATIC_SHAPES", True)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         num_speculative_tokens=2, enforce_eager=False)
    runner, draft = engine.runner, engine.proposer.models[0]
    forward = runner.decode_forwards[draft]
    assert forward.widest == 3
    prompts, behind = [[5, 6, 7, 8, 9], [11, 12, 13]], [[21, 22, 23, 24, 25, 26, 27], [31, 32]]

    def feed(kv, tails, starts, decode):
        ids, pos, valid = (torch.tensor(t, device=runner.device) for t in runner._ragged_rows(tails, starts))
        return runner.forward(draft, kv, ids, pos, valid.bool(), [len(t) for t in tails], keep=1, decode=decode)

    @torch.inference_mode()   # as the runner's steps
    def run(pieces: bool):
        kv = runner.kv_layout.empty(draft, 2, runner.device)
        feed(kv, prompts, [0, 0], decode=False)
        eager_before = forward.eager_forwards
        caught_up = feed(kv, behind, [len(p) for p in prompts], decode=pieces)
        assert forward.eager_forwards == eager_before   # every piece through a built graph
        lengths = list(kv.lengths)
        after = feed(kv, [[40], [41]], lengths, decode=False)
        kv.select([])
        return caught_up, lengths, after

    whole, pieced = run(False), run(True)
    assert pieced[1] == whole[1] == [12, 5]
    torch.testing.assert_close(pieced[0], whole[0])
    torch.testing.assert_close(pieced[2], whole[2])
