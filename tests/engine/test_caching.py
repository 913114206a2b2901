"""Caching is proven by counting what each model is fed, and the position / attention
invariants (I1-I3) are checked on every forward; a deliberately broken engine must fail."""
import pytest
import torch

from exspec import SamplingParams
from exspec.engine.runner import ModelRunner

from enginekit import GPT2_MAX_POS, assert_equivalent, make_engine, make_prompts


class FeedLog:
    """Forward pre-hook: per call, the real (not padding) new tokens per row, and I1/I3 checks.
    Which query tokens are real comes from the runner (`watch`), not from the positions or the
    mask under test, so a real token with a wrong position cannot pass for padding."""

    def __init__(self, model):
        self.calls = []  # (batch, query width, real tokens fed)
        self.valid = None   # the current forward's [B, q] real-token mask, set by watch()
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids, mask, pos = kwargs["input_ids"], kwargs["attention_mask"], kwargs["position_ids"]
        q = ids.shape[1]
        real = self.valid.bool()
        if mask is None:      # EXSPEC, one row read in place: its columns are its positions
            _, cached, _ = kwargs["cache"].layers[0].forward.span
            seen_before = cached + torch.arange(q)[None]
        elif mask.dim() == 2:   # EQSPEC: a padding mask over [cache, new tokens]
            assert torch.equal(mask[:, -q:].bool(), real), "the mask's new columns are not the real tokens"
            seen_before = mask.cumsum(1)[:, -q:] - 1
        else:                 # EXSPEC: a 4D additive mask, one row of allowed columns per query
            seen_before = (mask[:, 0] == 0).sum(-1) - 1
        # I1 + I3: a real query token's position equals the number of entries it sees before it
        # in its row (cache and earlier queries), i.e. its index in a standalone run.
        bad = real & (pos != seen_before)
        assert not bad.any(), f"position ids {pos[bad].tolist()} != {seen_before[bad].tolist()}"
        self.calls.append((ids.shape[0], q, int(real.sum())))


def watch(engine) -> tuple[FeedLog, FeedLog]:
    """FeedLogs for both models, told each forward's real tokens by the runner itself."""
    logs = {id(engine.target): FeedLog(engine.target), id(engine.draft): FeedLog(engine.draft)}
    forward = engine.runner.forward

    def forward_with_valid(model, kv, ids, pos, valid, counts, keep, **kwargs):
        logs[id(model)].valid = valid
        return forward(model, kv, ids, pos, valid, counts, keep, **kwargs)

    engine.runner.forward = forward_with_valid
    return logs[id(engine.target)], logs[id(engine.draft)]


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_each_model_is_fed_each_token_once(pairs, method):
    k, n_prompts, max_tokens = 3, 5, 21
    engine = make_engine(pairs, "llama", "noisy", method=method, num_speculative_tokens=k,
                         max_batch_size=8)
    target_log, draft_log = watch(engine)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=5, count=n_prompts)
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)

    # one batched prefill per model, exactly the prompt tokens
    assert target_log.calls[0][2] == prompt_tokens == stats["prefill_tokens_target"]
    assert draft_log.calls[0][2] == prompt_tokens == stats["prefill_tokens_draft"]
    # after prefill: the target gets exactly k+1 query tokens per row per step, nothing more
    verify = target_log.calls[1:]
    assert len(verify) == stats["steps"]
    for batch, q, real in verify:
        assert real == batch * q and q <= k + 1
    # the draft gets at most k+1 real tokens per row per step (k forwards, the first may be 2 wide)
    draft_steps = draft_log.calls[1:]
    assert len(draft_steps) == sum(q - 1 for _, q, _ in verify)   # one forward per draft token
    assert all(q <= 2 for _, q, _ in draft_steps)
    assert sum(real for _, _, real in draft_steps) <= sum(b * q for b, q, _ in verify)
    # every committed token is accounted for: no row was re-encoded
    total_out = n_prompts * max_tokens
    assert stats["committed_tokens"] + n_prompts == total_out


def test_identical_draft_accepts_every_token(pairs):
    k, steps = 4, 5
    engine = make_engine(pairs, "gpt2", "twin", num_speculative_tokens=k, max_batch_size=4)
    prompts = make_prompts(320, pairs["gpt2", "eos"], seed=9, count=4)
    # prefill commits 1 token, then `steps` steps of k+1 each
    outs = engine.generate(prompts, SamplingParams(max_tokens=1 + steps * (k + 1), ignore_eos=True))
    stats = engine.stats()
    assert stats["acceptance_rate"] == 1.0
    assert stats["mean_accepted_length"] == k + 1
    assert stats["steps"] == steps
    assert all(len(o.token_ids) == 1 + steps * (k + 1) for o in outs)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_shifted_positions_break_equivalence(pairs, reference, monkeypatch, arch):
    """Negative control: positions off by one for padded rows must be caught by the oracle."""
    original = ModelRunner._ragged_rows

    def shifted(self, tails, starts):
        ids, pos, valid = original(self, tails, starts)
        # a padded row's real tokens one position late
        pos = [[p + v for p, v in zip(row, ok)] if 0 in ok else row for row, ok in zip(pos, valid)]
        return ids, pos, valid

    monkeypatch.setattr(ModelRunner, "_ragged_rows", shifted)
    max_len = GPT2_MAX_POS if arch == "gpt2" else 256
    prompts = make_prompts(320, pairs[arch, "eos"], seed=11, count=8)
    engine = make_engine(pairs, arch, "noisy", max_batch_size=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    with pytest.raises(AssertionError, match="differs at output position"):
        assert_equivalent(outs, prompts, [20] * len(prompts), reference, pairs[arch, "target"], max_len)


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_rejected_drafts_left_visible_break_equivalence(pairs, reference, monkeypatch, method):
    """Negative control: a target cache that lets attention see rejected drafts must be caught.
    EQSPEC: the tail is not cut. EXSPEC's store rolls back by length and hides every slot past
    the query's own position; here the mask shows the next block's slots too (where rejected
    drafts of earlier steps still sit)."""
    from exspec.kv import blocks as kv_blocks
    from exspec.kv.padded import LayerMasks, PaddedKV
    prompts = make_prompts(320, pairs["llama", "eos"], seed=12, count=8)
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=8)
    if method == "eqspec":   # the target's tail stays (the draft's cache rolls back as before)
        drop_tail = PaddedKV.drop_tail
        monkeypatch.setattr(PaddedKV, "drop_tail", lambda self, counts, counts_dev=None: (
            None if any(g.target_kv is self for g in engine.pool.groups)
            else drop_tail(self, counts, counts_dev)))
    else:
        build = LayerMasks.build
        monkeypatch.setattr(LayerMasks, "build", lambda self, key_pos, key_valid, query_pos: build(
            self, key_pos, key_valid, query_pos + kv_blocks.BLOCK_SIZE))
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    with pytest.raises(AssertionError, match="differs at output position"):
        assert_equivalent(outs, prompts, [20] * len(prompts), reference, pairs["llama", "target"], 256)

