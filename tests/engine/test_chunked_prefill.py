"""Chunked prefill (max_num_batched_tokens): a long prompt is fed in chunks between the steps of
the running rows, each prompt token once per model, and the chunk boundaries are invisible in
the output."""
import pytest

from exspec import SamplingParams
from exspec.engine.runner import ModelRunner

from enginekit import make_engine, make_prompts

BATCHED = 16          # max_num_batched_tokens
K = 3                 # the 2 short rows step 2 x (K + 1) = 8 tokens: chunks of 8 beside them
LONG = 8 * BATCHED + 20
SHORT_TOKENS = 150


def long_prompt(pairs):
    tokens = [t for p in make_prompts(320, pairs["llama", "eos"], seed=42, count=16) for t in p]
    assert len(tokens) >= LONG
    return tokens[:LONG]


def record_target_forwards(engine):
    """(batch, tokens fed, first position) of every target forward."""
    seen = []

    def hook(module, args, kwargs):
        pos = kwargs["position_ids"]
        seen.append((pos.shape[0], pos.shape[1], int(pos[:, 0].min())))
    engine.target.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def run_long_beside_short(pairs, reference, method, **overrides):
    """Two short requests decode; a long prompt arrives; every output is checked exactly."""
    config = dict(max_num_batched_tokens=BATCHED) | overrides
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=3,
                         num_speculative_tokens=K, **config)
    forwards = record_target_forwards(engine)
    shorts = make_prompts(320, pairs["llama", "eos"], seed=43, count=4)[2:4]
    prompt = long_prompt(pairs)
    for i, p in enumerate(shorts):   # they outlast the long prompt's prefill
        engine.add_request(f"short{i}", p, SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    got = {}

    def tick():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.finish_reason != "error", out.error
    tick(), tick()   # both prefilled, then stepped once
    before = len(forwards)
    engine.add_request("long", prompt, SamplingParams(max_tokens=20))
    while engine.has_unfinished():
        tick()
    target = pairs["llama", "target"]
    assert got["long"] == reference(target, prompt, 20), "the chunked prompt's output differs"
    return engine, forwards[before:], prompt, got


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_a_long_prompt_is_prefilled_in_chunks_between_steps_exactly(pairs, reference, method):
    engine, forwards, prompt, _ = run_long_beside_short(pairs, reference, method)
    # the long prompt's chunks: its own batch-1 forwards over prompt positions
    chunks = [(i, n) for i, (b, n, start) in enumerate(forwards) if b == 1 and start < len(prompt)]
    assert sum(n for _, n in chunks) == len(prompt), "each prompt token is fed exactly once"
    assert len(chunks) >= 8, f"{len(chunks)} chunks for a {len(prompt)}-token prompt"
    assert max(n for _, n in chunks) <= BATCHED - 2 * (K + 1), "a chunk overran the tick's budget"
    steps_between = [sum(1 for b, n, _ in forwards[i + 1:j] if b == 2 and n == K + 1)
                     for (i, _), (j, _) in zip(chunks, chunks[1:])]
    assert min(steps_between) >= 1, f"no decode step of the running rows between chunks: {steps_between}"
    stats = engine.stats()
    assert stats["prefill_tokens_target"] == len(prompt) + sum(
        len(p) for p in make_prompts(320, pairs["llama", "eos"], seed=43, count=4)[2:4])


def test_short_outputs_are_exact_beside_a_chunked_prefill(pairs, reference):
    _, _, _, got = run_long_beside_short(pairs, reference, "exspec")
    shorts = make_prompts(320, pairs["llama", "eos"], seed=43, count=4)[2:4]
    for i, p in enumerate(shorts):
        expected = reference(pairs["llama", "target"], p, SHORT_TOKENS)
        # ignore_eos: the reference stops at EOS; the served row carries on past it
        assert got[f"short{i}"][:len(expected)] == expected, f"short{i} differs"


def test_chunk_positions_matter_negative_control(pairs, reference, monkeypatch):
    """A chunk fed at positions 0.. instead of its real ones must break the output: the
    exactness check above would see a chunking bug."""
    original = ModelRunner._ragged_rows

    def from_zero(self, tails, starts):
        return original(self, tails, [0] * len(starts))
    monkeypatch.setattr(ModelRunner, "_ragged_rows", from_zero)
    with pytest.raises(AssertionError, match="chunked prompt's output differs"):
        run_long_beside_short(pairs, reference, "exspec")
    # the same break with whole prompts (fed from position 0 anyway) changes no output: the
    # control fails because of the chunks alone
    run_long_beside_short(pairs, reference, "exspec", max_num_batched_tokens=None)


def test_chunk_masks_grow_with_the_chunk_not_the_prompt(pairs, reference, monkeypatch):
    """The 4D mask of every prefill forward is at most chunk x context: never prompt^2 (a row
    read in place gets no mask from us: HF's own causal mask is then chunk x its entries)."""
    from exspec.kv import blocks as kv_blocks
    shapes = []
    original = kv_blocks.BlockKV.attention_mask

    def recorded(self, input_valid, counts, positions, always=True, in_place=False):
        mask = original(self, input_valid, counts, positions, always, in_place)
        span = self.store.forward.span
        shapes.append(tuple(mask.shape) if mask is not None else (1, 1, input_valid.shape[1], span[2]))
        return mask
    monkeypatch.setattr(kv_blocks.BlockKV, "attention_mask", recorded)
    _, _, prompt, _ = run_long_beside_short(pairs, reference, "exspec")
    assert max(s[2] for s in shapes) <= BATCHED, "a forward fed more than a tick's tokens"
    assert max(s[2] * s[3] for s in shapes) < len(prompt) ** 2 / 4


def long_fed(engine) -> int | None:
    """Prompt tokens the long request has fed so far (None once it has left)."""
    return next((s.num_cached_target for g in engine.pool.prefilling + engine.pool.groups
                 for s in g.seqs if s.request_id == "long"), None)


def short_prompts_beside_a_long_one(pairs, reference, bound: int | None = None):
    """A long prompt arrives, then a new short prompt every tick, each as long as what a tick
    with a two-row step leaves (BATCHED - 2 (K + 1) = 8 tokens). Returns, per short prompt, the
    ticks to its first token, the longest run of ticks the long prompt went without a chunk,
    and the bound; every output is checked exactly."""
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         num_speculative_tokens=K, max_num_batched_tokens=BATCHED, max_num_seqs=16)
    if bound is not None:   # the negative control: no bound on a chunk's wait
        engine.config.max_skipped_ticks = bound
    prompt = long_prompt(pairs)[:6 * BATCHED]
    tokens = [t for p in make_prompts(320, pairs["llama", "eos"], seed=44, count=16) for t in p]
    shorts = [tokens[i:i + 8] for i in range(0, 8 * 14, 8)]
    tick, fed_at, first_at, got, arrived = 0, [], {}, {}, {}
    engine.add_request("long", prompt, SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        if engine.pool.planned is None and engine.pool.chunks_due is None:   # a tick starts
            tick += 1
            if tick <= len(shorts):
                engine.add_request(f"s{tick}", shorts[tick - 1], SamplingParams(max_tokens=12))
                arrived[f"s{tick}"] = tick
        before = long_fed(engine)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            first_at.setdefault(out.request_id, tick)
        if long_fed(engine) != before:
            fed_at.append(tick)
    assert got["long"] == reference(pairs["llama", "target"], prompt, 8)
    for i, p in enumerate(shorts, 1):
        assert got[f"s{i}"] == reference(pairs["llama", "target"], p, 12), f"s{i}"
    waits = [first_at[r] - arrived[r] for r in arrived]
    ticks = sorted(set(fed_at))
    gaps = [b - a - 1 for a, b in zip(ticks, ticks[1:])]
    return waits, max(gaps, default=0), engine.config.max_skipped_ticks


def test_short_prompts_go_before_a_long_prompts_chunks_which_wait_at_most_the_bound(pairs, reference):
    """The prefill policy: a short prompt gets its first token in the tick after it arrives, not
    after the long prompt's chunks, and the long prompt still gets a chunk at least every
    max_skipped_ticks + 1 ticks although a short one takes the budget every tick."""
    waits, longest_gap, bound = short_prompts_beside_a_long_one(pairs, reference)
    assert max(waits) <= 1, f"short prompts waited {waits} ticks for their first token"
    assert 0 < longest_gap <= bound, f"the long prompt waited {longest_gap} ticks for a chunk (bound {bound})"


def test_a_chunk_without_a_bound_starves_negative_control(pairs, reference):
    """The same run with no bound: the long prompt waits for every short one, past the bound
    the test above holds."""
    _, longest_gap, _ = short_prompts_beside_a_long_one(pairs, reference, bound=10**6)
    bound = make_engine(pairs, method="exspec", max_batch_size=2, max_num_seqs=16,
                        num_speculative_tokens=K, max_num_batched_tokens=BATCHED).config.max_skipped_ticks
    assert longest_gap > bound, f"the long prompt waited at most {longest_gap} ticks (bound {bound})"


def test_a_chunk_never_holds_back_a_first_token_or_a_steps_tokens(pairs, reference):
    """The tick's parts: short prompts' prefill, the step, then the long prompt's chunk, each
    part's tokens returned before the next part runs. So no engine.step() call that returns a
    short row's tokens (a new prompt's first token, a decode step's tokens) also fed a chunk:
    the client does not wait for the chunk's forward. Before, a chunk ran between a new
    prompt's prefill and the return of its first token, and before the step."""
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=3,
                         num_speculative_tokens=K, max_num_batched_tokens=BATCHED, max_num_seqs=16)
    shorts = make_prompts(320, pairs["llama", "eos"], seed=43, count=4)[2:4]
    late = make_prompts(320, pairs["llama", "eos"], seed=45, count=4, max_len=8)[0][:8]
    prompt = long_prompt(pairs)
    for i, p in enumerate(shorts):
        engine.add_request(f"short{i}", p, SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    engine.add_request("long", prompt, SamplingParams(max_tokens=20))
    def prompt_fed():   # the long prompt's tokens fed so far (its decode steps not counted)
        under_way = [s for g in engine.pool.prefilling for s in g.seqs if s.request_id == "long"]
        if under_way:
            return under_way[0].num_cached_target
        return len(prompt) if got.get("long") else 0   # fed whole once its first token came

    got, calls = {}, []
    while engine.has_unfinished():
        fed = prompt_fed()
        if "late" not in got and fed >= 3 * BATCHED:   # mid-way through the chunks
            engine.add_request("late", late, SamplingParams(max_tokens=12))
            got["late"] = []
        outs = engine.step()
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        emitted = {o.request_id for o in outs if o.new_token_ids and o.request_id != "long"}
        calls.append((prompt_fed() != fed, emitted))
    target = pairs["llama", "target"]
    assert got["long"] == reference(target, prompt, 20)
    assert got["late"] == reference(target, late, 12)
    assert sum(chunk for chunk, _ in calls) >= 4, "the long prompt was not fed in chunks"
    held = [(i, emitted) for i, (chunk, emitted) in enumerate(calls) if chunk and emitted]
    assert not held, f"tokens of {held} were returned only after a chunk's forward"


def test_abort_while_a_chunk_is_due_feeds_it_no_more(pairs, reference):
    """abort(long) between the tick's parts, its next chunk already due (the step's tokens went
    out, feed_chunks has not run): the next call ends it with no tokens and feeds it nothing
    more (the target's prefill count stops at what it had fed), and the rows beside it stay exact."""
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=3,
                         num_speculative_tokens=K, max_num_batched_tokens=BATCHED, max_num_seqs=16)
    shorts = make_prompts(320, pairs["llama", "eos"], seed=43, count=4)[2:4]
    for i, p in enumerate(shorts):
        engine.add_request(f"short{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("long", long_prompt(pairs), SamplingParams(max_tokens=20))
    got = {}

    def long_under_way():
        return next((s for g in engine.pool.prefilling for s in g.seqs if s.request_id == "long"), None)

    for _ in range(200):   # until a step's tokens went out with the long prompt's chunk due
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        due = engine.pool.chunks_due
        seq = long_under_way()
        if due and seq is not None and seq.num_cached_target >= 2 * BATCHED and any(
                s is seq for g in due[0] for s in g.seqs):
            break
    else:
        pytest.fail("the long prompt's chunk was never due between the tick's parts")
    fed = seq.num_cached_target
    prefilled = engine.stats()["prefill_tokens_target"]
    engine.abort("long")
    final = {o.request_id: o for o in engine.step()}["long"]
    assert final.finished and final.finish_reason == "abort" and final.new_token_ids == []
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats()["prefill_tokens_target"] == prefilled, "a chunk was fed after the abort"
    assert fed < len(long_prompt(pairs)) and "long" not in got
    for i, p in enumerate(shorts):
        expected = reference(pairs["llama", "target"], p, 40)
        assert got[f"short{i}"][:len(expected)] == expected, f"short{i} differs"
