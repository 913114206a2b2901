"""Chunked prefill (max_num_batched_tokens): a long prompt is fed in chunks between the steps of
the running rows, each prompt token once per model, and the chunk boundaries are invisible in
the output."""
import pytest

from exspec import SamplingParams
from exspec.runner import ModelRunner

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
    from exspec import kv_blocks
    shapes = []
    original = kv_blocks.BlockKV.attention_mask

    def recorded(self, input_valid, counts, positions, always=True):
        mask = original(self, input_valid, counts, positions, always)
        span = self.store.forward.span
        shapes.append(tuple(mask.shape) if mask is not None else (1, 1, input_valid.shape[1], span[2]))
        return mask
    monkeypatch.setattr(kv_blocks.BlockKV, "attention_mask", recorded)
    _, _, prompt, _ = run_long_beside_short(pairs, reference, "exspec")
    assert max(s[2] for s in shapes) <= BATCHED, "a forward fed more than a tick's tokens"
    assert max(s[2] * s[3] for s in shapes) < len(prompt) ** 2 / 4
