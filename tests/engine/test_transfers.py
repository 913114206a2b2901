"""A speculative step crosses between host and device at most twice (design: "The fast decode
path"): its new inputs go up in one copy and its accepted counts and tokens come down in one.
Counted on CPU with TransferAudit, which sees every crossing a GPU run would make (tensors built
from host data, `.item()` / `bool()` / `int()` reads, `.tolist()`), so the budget holds without a GPU."""
from __future__ import annotations

import warnings

import pytest
import torch

from exspec import SamplingParams
from exspec.transfer import TransferAudit

from enginekit import make_engine, make_prompts

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)


def tick(engine):
    """One whole tick of the pool (its two halves: plan and prefill, then the step)."""
    engine.pool.begin_tick()
    engine.pool.finish_tick()


def steady_steps(engine, prompts, params, steps=6):
    """Admit every prompt, let the first ticks settle, then audit `steps` ticks that only step
    (no admission, no row leaving): per tick (h2d, d2h, where)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(3):
        engine.step()
    counts = []
    for _ in range(steps):
        audit = TransferAudit()
        with audit.counting():
            tick(engine)
        counts.append((audit.h2d, audit.d2h, audit.where))
    assert engine.pool.num_running == len(prompts), "a row left during the audited ticks"
    return counts


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_step_makes_at_most_one_copy_each_way(pairs, method, batch, params):
    engine = make_engine(pairs, method=method, num_speculative_tokens=3, max_batch_size=8)
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=3, count=batch, max_len=20)
    for h2d, d2h, where in steady_steps(engine, prompts, params):
        assert h2d <= 1 and d2h <= 1, f"{method} B={batch}: {h2d} up, {d2h} down: {where}"


def test_rejection_sampling_adds_only_its_uniforms(pairs):
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3, sampling_coupling="rejection")
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=4, count=4, max_len=20)
    for h2d, d2h, where in steady_steps(engine, prompts, SAMPLED):
        assert h2d <= 2 and d2h <= 1, f"{h2d} up, {d2h} down: {where}"

# every logits processing parameter at once (logits_processing.py): its state lives on the device
PROCESSED = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=7, min_p=0.05,
                           repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                           min_tokens=30, logit_bias={5: 2.0}, bad_words=["the cat"])


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_logits_processing_adds_no_copy(pairs, method):
    engine = make_engine(pairs, method=method, num_speculative_tokens=3, max_batch_size=8)
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=3, count=4, max_len=20)
    for h2d, d2h, where in steady_steps(engine, prompts, PROCESSED):
        assert h2d <= 1 and d2h <= 1, f"{method}: {h2d} up, {d2h} down: {where}"


def test_the_audit_sees_a_stray_host_read(pairs):
    """Negative control: a `bool(tensor)` slipped into the step is caught."""
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3)
    runner = engine.runner
    real = runner._forward

    def forward_with_a_sync(*args, **kwargs):
        logits = real(*args, **kwargs)
        bool(logits.isfinite().all())
        return logits

    runner._forward = forward_with_a_sync
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=5, count=2, max_len=20)
    counts = steady_steps(engine, prompts, GREEDY, steps=2)
    assert all(d2h > 1 for _, d2h, _ in counts), counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_on_cuda_a_tick_waits_for_the_device_once(pairs, method):
    """torch's own sync detector: a steady tick synchronises only at its one device-to-host copy
    (inputs go up from pinned memory without blocking)."""
    engine = make_engine(pairs, method=method, num_speculative_tokens=3, device="cuda")
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=6, count=4, max_len=20)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(3):
        engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tick(engine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, syncs
