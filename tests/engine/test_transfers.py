"""A step crosses between host and device at most twice (design: "The fast decode path"): its
new inputs go up in one copy and its accepted counts and tokens come down in one; so does a
prefill. Counted on CPU with TransferAudit, which treats the engine's device as its own: host
data reaching the device however it goes (`Transfers`, `.to()`, a copy to a device as `.cuda()`
makes, `copy_`, `torch.tensor`) and values read back (`.item()`, `bool()`, `.tolist()`), so the
budget holds without a GPU.

What is audited, per call (`audited_run`):
- a step: the pool's second half (`finish_tick`): the runner's step (the draft's catch-up after
  plain steps, the sampling settings of a group that is new or lost rows, draft, verify,
  accept, commit) and retiring rows after it;
- forming the step's group (`_merge`, in the first half): nothing crosses;
- a prefill (`runner.prefill`, one batched forward of new prompts or chunks): its input and the
  first tokens' settings up in one copy, the first tokens down in one;
and the whole `engine.step()` call, which must cross nothing besides those (aborts, intake,
retiring rows of a group that is not stepping)."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from exspec import SamplingParams
from exspec.utils.transfer import TransferAudit

from enginekit import assert_seeded_equivalent, make_engine, make_prompts, run_schedule

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def audited_run(engine, arrivals, aborts, params):
    """Run a schedule (enginekit.run_schedule) with every engine.step() call audited, and its
    crossings split between the steps, merges and prefills it made. Returns (outputs, finished,
    records, ticks): records are (kind, h2d, d2h, where) per such call, ticks (h2d, d2h, what
    the calls in it account for, where) per engine.step()."""
    records, ticks, current = [], [], []

    def audited(kind, call):
        def run(*args, **kwargs):
            audit = current[0]
            h2d, d2h, seen = audit.h2d, audit.d2h, len(audit.where)
            out = call(*args, **kwargs)
            records.append((kind, audit.h2d - h2d, audit.d2h - d2h, audit.where[seen:]))
            return out
        return run

    engine.pool.finish_tick = audited("step", engine.pool.finish_tick)
    engine.pool._merge = audited("merge", engine.pool._merge)
    engine.runner.prefill = audited("prefill", engine.runner.prefill)
    step = engine.step

    def whole_call():
        audit, first = TransferAudit(), len(records)
        current[:] = [audit]
        with audit.counting():
            out = step()
        inner = records[first:]
        ticks.append((audit.h2d, audit.d2h, (sum(r[1] for r in inner), sum(r[2] for r in inner)),
                      audit.where))
        return out

    engine.step = whole_call
    outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)
    return outputs, finished, records, ticks


def assert_within_budget(records, ticks, label=""):
    for kind, h2d, d2h, where in records:
        allowed = 0 if kind == "merge" else 1
        assert h2d <= allowed and d2h <= allowed, f"{label} a {kind}: {h2d} up, {d2h} down: {where}"
    for h2d, d2h, inner, where in ticks:
        assert (h2d, d2h) == inner, f"{label} an engine.step() crossed outside its audited calls: {where}"


def churning_schedule(vocab: int, eos: int, seed: int):
    """14 requests arriving over 12 ticks, 3 aborted (one still prefilling in chunks), each
    greedy or sampled (temperature, top-p, top-k, its own seed), with its own max_tokens (rows
    leave groups at different ticks) and k cap."""
    rng = random.Random(seed)
    prompts = make_prompts(vocab, eos, seed=seed, count=14, max_len=30)
    kinds = [dict(), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=20),
             dict(temperature=0.7)]
    arrivals, aborts, params = {}, {}, {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        tick = rng.randint(0, 12)
        arrivals.setdefault(tick, []).append((rid, prompt))
        params[rid] = SamplingParams(max_tokens=rng.randint(6, 24), seed=1000 + i,
                                     num_speculative_tokens=rng.choice([None, None, 1, 2]),
                                     **kinds[i % len(kinds)])
        if i % 5 == 1:
            aborts.setdefault(tick + rng.randint(0, 4), []).append(rid)
    return prompts, arrivals, aborts, params


CHURN = [("eqspec", False), ("exspec", True), ("eqspec", True), ("exspec", False)]
IN_CI = {("eqspec", False), ("exspec", True)}   # each method, and fixed and adaptive k, once


@pytest.mark.parametrize("method, adaptive", [c if c in IN_CI else pytest.param(*c, marks=pytest.mark.slow)
                                              for c in CHURN])
def test_every_step_of_a_churning_schedule_copies_once_each_way(pairs, reference, seeded_reference,
                                                                method, adaptive):
    """Arrivals, aborts, chunked prefill, merges, rows leaving, mixed greedy and sampled rows,
    per-request k caps and (adaptive) plain steps with the draft's catch-up: every step and every
    prefill of every tick within one copy each way, and every output still the target-only one.
    (Adaptive k's draft stop is off, as on a GPU by default: it reads the rows' confidences per
    draft token, design: "One speculative step".)"""
    engine = make_engine(pairs, "llama", "independent", method=method, max_batch_size=4,
                         max_num_seqs=8, num_speculative_tokens=3, adaptive_k=adaptive,
                         draft_stop_confidence=0 if adaptive else None, max_num_batched_tokens=24)
    prompts, arrivals, aborts, params = churning_schedule(320, pairs["llama", "eos"], seed=12)
    seen = {"catch-ups": 0, "sampling uploads": 0, "merges": 0, "rows left a group": 0}
    count_calls(engine, seen)
    outputs, finished, records, ticks = audited_run(engine, arrivals, aborts, params)

    assert_within_budget(records, ticks, f"{method} adaptive={adaptive}:")
    exercised = dict(seen, steps=sum(r[0] == "step" for r in records),
                     prefills=sum(r[0] == "prefill" for r in records))
    needed = ["sampling uploads", "merges", "rows left a group"] + (["catch-ups"] if adaptive else [])
    assert all(exercised[name] > 0 for name in needed), exercised
    rows = []
    for i, prompt in enumerate(prompts):
        rid, p = f"r{i}", params[f"r{i}"]
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        complete = finished[rid].finish_reason != "abort"
        if p.greedy:
            expected = reference(pairs["llama", "target"], prompt, p.max_tokens)
            assert tokens == (expected if complete else expected[:len(tokens)]), f"{rid} (greedy)"
        else:
            rows.append((rid, prompt, p, tokens, complete))
    assert_seeded_equivalent(rows, seeded_reference, pairs["llama", "target"], label=method)


def count_calls(engine, seen):
    """Count what the schedule exercised: the draft's catch-up forwards, steps that upload a
    group's sampling settings, merges and rows dropped from a group."""
    runner, pool = engine.runner, engine.pool
    catch_up, upload, merge = runner.proposer.catch_up, runner._upload_step_inputs, pool._merge

    def catching_up(*args):
        seen["catch-ups"] += 1
        return catch_up(*args)

    def uploading(group, plan):
        seen["sampling uploads"] += group.sampling is None and not all(s.params.greedy for s in group.seqs)
        return upload(group, plan)

    def merging(groups):
        seen["merges"] += 1
        return merge(groups)

    runner.proposer.catch_up, runner._upload_step_inputs, pool._merge = catching_up, uploading, merging
    retire = pool._without_finished

    def without_finished(groups):
        seen["rows left a group"] += sum(0 < sum(s.finished for s in g.seqs) < len(g) for g in groups)
        return retire(groups)
    pool._without_finished = without_finished


def test_rejection_sampling_uniforms_ride_the_one_copy(pairs):
    """Rejection sampling's per-request uniforms go up with the step's other inputs."""
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3, sampling_coupling="rejection")
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=4, count=4, max_len=20)
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}
    _, _, records, ticks = audited_run(engine, arrivals, {}, SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7))
    assert_within_budget(records, ticks)

# every logits processing parameter at once (logits_processing.py): its state lives on the device
PROCESSED = dict(ignore_eos=True, temperature=0.8, min_p=0.05, repetition_penalty=1.2,
                 frequency_penalty=0.5, presence_penalty=0.5, min_tokens=10, logit_bias={5: 2.0},
                 bad_words=["the cat"])


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_logits_processing_rides_the_one_copy(pairs, method):
    """Rows with every processing parameter arriving, leaving (different max_tokens) and merging
    beside plain rows: the state is built from the step's (or prefill's) one upload each time
    the group changes and advanced on the device otherwise."""
    engine = make_engine(pairs, method=method, num_speculative_tokens=3, max_batch_size=8)
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=3, count=6, max_len=20)
    arrivals = {}
    for i, prompt in enumerate(prompts):
        arrivals.setdefault(3 * (i // 2), []).append((f"r{i}", prompt))
    params = {f"r{i}": SamplingParams(max_tokens=12 + 6 * i, seed=7 + i, **(PROCESSED if i % 3 else {}))
              for i in range(len(prompts))}
    rebuilt = []
    build = engine.runner._stage_processing

    def staging(upload, seqs):
        staged = build(upload, seqs)
        rebuilt.append(staged is not None)
        return staged
    engine.runner._stage_processing = staging
    _, _, records, ticks = audited_run(engine, arrivals, {}, params)
    assert_within_budget(records, ticks, f"{method}:")
    assert sum(rebuilt) >= 3, "the processing state was not rebuilt as rows came and went"


def test_the_audit_sees_a_stray_host_read(pairs):
    """Negative control: a `bool(tensor)` slipped into the step is caught."""
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3)
    runner = engine.runner
    real = runner.forward

    def forward_with_a_sync(*args, **kwargs):
        logits = real(*args, **kwargs)
        bool(logits.isfinite().all())
        return logits

    runner.forward = forward_with_a_sync
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=5, count=2, max_len=20)
    _, _, records, ticks = audited_run(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, {},
                                       SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(AssertionError, match="is_nonzero"):
        assert_within_budget(records, ticks)


def planted(kind: str, device):
    """Host data of each kind a step could slip to the device, as a [1] zero added to logits."""
    if kind == ".to()":
        return torch.zeros(1).to(device)
    if kind == ".cuda()":   # what .cuda() dispatches: a copy to a device (a real one on a CPU engine too)
        return torch.zeros(1).to(device, copy=True)
    if kind == "copy_":
        into = torch.empty(1, device=device)
        return into.copy_(torch.zeros(1))
    return torch.tensor([0.0], device=device)   # "torch.tensor"


@pytest.mark.parametrize("kind", [".to()", ".cuda()", "copy_", "torch.tensor"])
def test_the_audit_sees_host_data_moved_to_the_device(pairs, kind):
    """Negative control per kind: host data moved to the device inside a step's forwards is
    counted there, and fails the budget (`torch.zeros(3).to(device)` on a CPU engine moves
    nothing, yet the audit sees it reach the device's computation)."""
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=3)
    runner = engine.runner
    real = runner.forward

    def forward_with_an_upload(*args, **kwargs):
        return real(*args, **kwargs) + planted(kind, runner.device)

    runner.forward = forward_with_an_upload
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=5, count=2, max_len=20)
    _, _, records, ticks = audited_run(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, {},
                                       SamplingParams(max_tokens=8, ignore_eos=True))
    steps = [r for r in records if r[0] == "step" and r[3]]
    assert steps and all(h2d > 1 for _, h2d, _, _ in steps), steps
    # counted where it was planted, and the step's budget fails
    with pytest.raises(AssertionError, match=r"a step: \d+ up.*h2d .* at test_transfers.py"):
        assert_within_budget(steps, [])


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
            engine.pool.begin_tick()
            engine.pool.finish_tick()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, syncs


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_structured_outputs_copies_are_bounded(pairs, proposer):
    """Grammar masks (structured_output.py) are host work, filled while the forwards run, so
    they go up in their own copy once the step's upload has left (never a wait for the device):
    with the n-gram proposer one such copy (every verified position's masks), so a step is two
    copies up and one down; with a draft model each draft's mask depends on that draft, so a
    constrained step adds one copy down (the draft) and one up (the next mask) per draft: k + 2
    up, k + 1 down. A prefill with a constrained row: two up (its first token's mask), one
    down. Constrained and free rows share groups."""
    k = 3
    extra = (dict(proposer="ngram", draft_model=None, prompt_lookup_min=1, prompt_lookup_max=2)
             if proposer == "ngram" else {})
    engine = make_engine(pairs, method="exspec", num_speculative_tokens=k, max_batch_size=8, **extra)
    prompts = make_prompts(engine.target.config.vocab_size, None, seed=5, count=4, max_len=20)
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts[:2])],
                2: [(f"r{i}", p) for i, p in enumerate(prompts[2:], 2)]}
    constrained = {"regex": "(ab|cd)+[0-9]{2,30}"}
    params = {f"r{i}": SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True, seed=3 + i,
                                      temperature=0.7 * (i % 2),
                                      structured_outputs=constrained if i != 1 else None)
              for i in range(4)}
    _, finished, records, ticks = audited_run(engine, arrivals, {}, params)
    up = {"merge": 0, "prefill": 2, "step": 2 if proposer == "ngram" else k + 2}
    down = {"merge": 0, "prefill": 1, "step": 1 if proposer == "ngram" else k + 1}
    steps = [r for r in records if r[0] == "step"]
    for kind, h2d, d2h, where in records:
        assert h2d <= up[kind] and d2h <= down[kind], f"{proposer}: a {kind}: {h2d} up, {d2h} down: {where}"
    assert max(r[1] for r in steps) == up["step"], f"{proposer}: no step took the constrained path"
    for h2d, d2h, inner, where in ticks:
        assert (h2d, d2h) == inner, f"an engine.step() crossed outside its audited calls: {where}"
    assert len(finished) == 4
