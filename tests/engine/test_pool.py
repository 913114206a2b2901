"""The SequencePool and the EXSPEC tick: arrivals, aborts, limits, fairness, adaptive k,
fault isolation, and the copies it avoids."""
import gc
import random
import threading
import weakref

import pytest
import torch

from exspec import EngineBusyError, SamplingParams
from exspec.kv import padded as kv_module
from exspec.kv import blocks as kv_blocks
from exspec.spec.draft_model import DraftModelProposer
from exspec.spec.draft_stop import DraftStop
from exspec.engine.runner import ModelRunner
from exspec.engine.adaptive_k import AdaptiveK
from exspec.engine.step_cost import Bucket, StepCost
from exspec.engine.scheduler import Scheduler

from enginekit import make_engine, make_prompts, run_schedule


@pytest.mark.parametrize("plain_probes", [False, True])
@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_random_arrivals_and_aborts(pairs, reference, monkeypatch, method, plain_probes):
    """`plain_probes`: speculation is taken to pay (the noisy draft costs what the target does,
    so adaptive k would mostly decode plainly here) yet to be near a tie, and neighbour probes
    come every other step, so plain probes (a plain step, then one at k, the draft catching
    up) interleave with arrivals, aborts and changing groups: the outputs stay exact."""
    live = weakref.WeakSet()
    probed = []
    if plain_probes:
        monkeypatch.setattr(AdaptiveK, "PLAIN_PROBE_WITHIN", float("inf"))
        monkeypatch.setattr(AdaptiveK, "WIDTH_PROBE_EVERY", 2)
        monkeypatch.setattr(AdaptiveK, "tokens_by_k", lambda self, a: [1.0 + 10 * k for k in range(self.max_k + 1)])
        choose = AdaptiveK.choose

        def counted(self, group, cap, per_step=False):
            k = choose(self, group, cap, per_step)
            probed.append(k == 0 and group.k_before_probe is not None)
            return k
        monkeypatch.setattr(AdaptiveK, "choose", counted)
    for layout in (kv_blocks.BlockKV, kv_module.PaddedKV):
        original = layout.__init__

        def tracked(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            live.add(self)
        monkeypatch.setattr(layout, "__init__", tracked)

    rng = random.Random(7)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=21, count=24)
    arrivals, arrived_at = {}, {}
    for i, p in enumerate(prompts):
        arrived_at[f"r{i}"] = tick = rng.randint(0, 30)
        arrivals.setdefault(tick, []).append((f"r{i}", p))
    victims = [f"r{i}" for i in rng.sample(range(24), 6)]
    aborts = {}   # 0-3 ticks after arrival: waiting, just prefilled or mid-generation
    for rid in victims:
        aborts.setdefault(arrived_at[rid] + rng.randint(0, 3), []).append(rid)
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=4, max_num_seqs=8,
                         adaptive_k=True, max_skipped_ticks=4)
    outputs, finished, aborted_at = run_schedule(engine, arrivals, aborts,
                                                 SamplingParams(max_tokens=24))
    assert set(finished) == {f"r{i}" for i in range(24)}, "every request ends exactly once"
    aborted = [rid for rid in victims if finished[rid].finish_reason == "abort"]
    assert len(aborted) >= 5, f"only {aborted} of {victims} were aborted"
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        if rid in aborted_at and finished[rid].finish_reason == "abort":
            after = outputs[rid][aborted_at[rid]:]
            assert all(not o.new_token_ids for o in after), f"{rid} emitted tokens after abort"
            assert tokens == reference(pairs["llama", "target"], prompt, 24)[:len(tokens)]
        else:
            assert tokens == reference(pairs["llama", "target"], prompt, 24), rid
    stats = engine.stats()
    assert (stats["pool_seqs"], stats["pool_kv_tokens"], stats["queue_len"]) == (0, 0, 0)
    gc.collect()
    assert len(live) == 0, f"{len(live)} cache objects still alive after the pool emptied"
    if plain_probes:
        assert sum(probed) >= 5, f"{sum(probed)} plain probe steps of {len(probed)}"


def test_the_first_token_goes_out_alone_before_the_ticks_step(pairs, reference):
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=28, count=3)[1:]
    engine.add_request("running", prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [len(o.new_token_ids) for o in engine.step()] == [1]   # nothing to step yet
    engine.add_request("short", prompts[1], SamplingParams(max_tokens=3))
    steps = engine.stats()["steps"]
    outs = engine.step()   # the tick's prefill: its first token, and nothing else yet
    assert [(o.request_id, len(o.new_token_ids), o.finished) for o in outs] == [("short", 1, False)]
    assert engine.stats()["steps"] == steps, "the tick's step ran before its first token was out"
    assert outs[0].num_output_tokens == 1
    rest = engine.step()   # the same tick's step, of the running row only
    assert [o.request_id for o in rest] == ["running"] and engine.stats()["steps"] == steps + 1
    tokens = outs[0].new_token_ids
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == "short" for t in o.new_token_ids]
    assert tokens == reference(pairs["llama", "target"], prompts[1], 3)


def test_joins_never_reprefill_running_sequences(pairs):
    rng = random.Random(3)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=22, count=16)
    arrivals = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(rng.randint(0, 20), []).append((f"r{i}", p))
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4, max_num_seqs=16)
    run_schedule(engine, arrivals, {}, SamplingParams(max_tokens=16))
    stats = engine.stats()
    total = sum(len(p) for p in prompts)
    assert stats["prefill_tokens_target"] == total
    assert stats["prefill_tokens_draft"] == total


@pytest.mark.parametrize("method,copies", [("exspec", False), ("eqspec", True)])
def test_equal_length_group_copies_nothing_while_ragged(pairs, method, copies):
    """8 equal-length prompts, no arrivals: rows accept different counts every step. EXSPEC's
    group never copies a cache byte (until rows start finishing); EQSPEC realigns."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(12)] for i in range(8)]
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    ragged_steps = 0
    for _ in range(12):
        outs = engine.step()
        if len({len(o.new_token_ids) for o in outs}) > 1:
            ragged_steps += 1
    stats = engine.stats()
    assert ragged_steps >= 5, "the draft must make rows accept different counts"
    assert (stats["realign_bytes"] > 0) == copies, stats["realign_bytes"]


def test_speculation_off_and_back_on_catches_the_draft_up(pairs, reference, monkeypatch):
    schedule = iter([5, 0, 0, 0, 0, 5, 0, 3, 5] + [5] * 100)
    original = Scheduler.k_for
    monkeypatch.setattr(Scheduler, "k_for", lambda self, g: min(next(schedule), original(self, g)))
    prompts = make_prompts(320, pairs["llama", "eos"], seed=23, count=6)
    engine = make_engine(pairs, "llama", "twin", method="exspec", max_batch_size=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    stats = engine.stats()
    assert stats["plain_steps"] >= 5
    assert stats["acceptance_rate"] == 1.0, "the draft lost track while speculation was off"
    assert stats["prefill_tokens_draft"] > sum(len(p) for p in prompts), "no catch-up happened"
    for o, p in zip(outs, prompts):
        assert o.token_ids == reference(pairs["llama", "target"], p, 40)


def test_pool_and_queue_limits(pairs):
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         max_num_seqs=3, max_queue_len=5, max_num_kv_tokens=200)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=24, count=8)
    for i in range(5):
        engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=8))
    with pytest.raises(EngineBusyError, match="busy.*retry"):
        engine.add_request("r5", prompts[5], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        assert stats["pool_seqs"] <= 3
        assert stats["pool_kv_tokens"] <= stats["pool_kv_tokens_reserved"] <= 200


def test_no_sequence_waits_longer_than_the_fairness_bound(pairs):
    bound = 3   # the least a pool of 8 with batches of 2 can promise: 4 ticks per round
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         max_num_seqs=8, max_skipped_ticks=bound)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=25, count=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
    last_seen, tick, worst = {}, 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in last_seen:
                worst = max(worst, tick - last_seen[out.request_id] - 1)
            last_seen[out.request_id] = tick
        tick += 1
    assert worst <= bound, f"a sequence waited {worst} ticks (bound {bound})"


def test_a_failing_group_fails_alone(pairs, reference, monkeypatch):
    original = ModelRunner.step

    def flaky(self, group, k, *args):
        if any(s.request_id == "poison" for s in group.seqs):
            raise RuntimeError("injected forward failure")
        return original(self, group, k, *args)

    monkeypatch.setattr(ModelRunner, "step", flaky)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2, max_num_seqs=8)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=26, count=5)
    engine.add_request("poison", prompts[0], SamplingParams(max_tokens=10))
    final = {o.request_id: o for o in engine.step() if o.finished}   # it forms a group alone
    for i, p in enumerate(prompts[1:]):
        engine.add_request(f"ok{i}", p, SamplingParams(max_tokens=10))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["poison"].finish_reason == "error"
    assert "injected forward failure" in final["poison"].error
    for i, p in enumerate(prompts[1:]):
        out = final[f"ok{i}"]
        assert out.finish_reason in ("stop", "length")
        assert out.num_output_tokens == len(reference(pairs["llama", "target"], p, 10))
    assert engine.stats()["pool_seqs"] == 0


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_rows_whose_caches_cannot_be_made_fail_and_are_not_lost(pairs, reference, monkeypatch, method):
    """Admitted rows leave the queue before their group's caches are made: when making them
    fails (out of memory, say), those rows end with the error, the tick goes on, and later
    requests are served (before, they were neither waiting nor running: generate hung)."""
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=2, max_num_seqs=8)
    new_group = engine.runner.new_group

    def failing_once(seqs):
        if any(s.request_id == "unlucky" for s in seqs):
            raise torch.OutOfMemoryError("injected: no memory for the new group's caches")
        return new_group(seqs)
    monkeypatch.setattr(engine.runner, "new_group", failing_once)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=31, count=3)
    engine.add_request("unlucky", prompts[0], SamplingParams(max_tokens=6))
    final = {o.request_id: o for o in engine.step() if o.finished}
    assert final["unlucky"].finish_reason == "error" and "no memory" in final["unlucky"].error
    outs = engine.generate(prompts[1:], SamplingParams(max_tokens=6))
    for out, prompt in zip(outs, prompts[1:]):
        assert out.token_ids == reference(pairs["llama", "target"], prompt, 6)
    assert not engine.has_unfinished() and engine.stats()["pool_seqs"] == 0


def test_intake_from_another_thread_while_stepping(pairs):
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4, max_num_seqs=8)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=27, count=12)
    done = threading.Event()

    def producer():
        for i, p in enumerate(prompts):
            engine.add_request(f"t{i}", p, SamplingParams(max_tokens=12))
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    finished = set()
    while not done.is_set() or engine.has_unfinished():
        engine.wait_for_work(timeout=0.5)
        finished |= {o.request_id for o in engine.step() if o.finished}
    thread.join()
    assert finished == {f"t{i}" for i in range(12)}


class G:
    """The slice of Group that AdaptiveK reads: size, last k (and the k a probe left),
    acceptance, plain steps in a row."""
    def __init__(self, n, k, acceptance, plain=0):
        self.n, self.k, self._a, self.plain_steps_in_a_row = n, k, acceptance, plain
        self.k_before_probe, self.plain_probe_left = None, 0

    def __len__(self):
        return self.n

    def acceptance(self, prior):
        return self._a


def costs(ak, bucket, rest, draft, plain=None):
    """Set a bucket's measured costs: a step at k >= 1 takes rest + k x draft (every width
    alike), a plain one `plain` x rest (when None: as before, or unmeasured)."""
    c, old = ak.costs, ak.costs.buckets.get(bucket)
    if plain is None and old is not None and 0 in old.ratio:
        plain = old.ratio[0] * old.level / rest
    unit = 1.0 if plain is None else plain   # plain steps are the unit once measured
    ratio = {1: 1 / unit, ak.max_k: 1 / unit} | ({} if plain is None else {0: 1.0})
    c.buckets[bucket] = Bucket(seen=old.seen if old else set(), draft=draft, level=unit * rest,
                               yardstick=1, last_k=1, ratio=ratio, priced=plain is not None,
                               samples={k: [r] * c.PLAIN_SAMPLES for k, r in ratio.items()})


def test_adaptive_k_hysteresis_and_fallback_to_plain():
    ak = AdaptiveK(max_k=5)
    costs(ak, 8, rest=1.0, draft=0.5, plain=1.0)   # step cost 1 + 0.5 k
    # high acceptance: speculation pays; low acceptance: plain decoding wins
    assert ak.choose(G(8, 0, 0.95), 5) > 0
    assert ak.choose(G(8, 5, 0.05), 5) == 0
    # hysteresis: at acceptance 0.6 (no counts: the geometric model) and this draft cost, k = 3
    # is the best, 2% ahead of k = 2 and k = 4: those stay; k = 1, 14% behind, moves
    tokens = ak.tokens_by_k(0.6)
    costs(ak, 8, rest=1.0, draft=(tokens[3] - 1.02 * tokens[2]) / (3.06 * tokens[2] - 2 * tokens[3]))
    rates = [tokens[k] / ak.cost(8, k) for k in range(6)]
    assert max(range(1, 6), key=rates.__getitem__) == 3
    assert rates[3] / rates[2] == pytest.approx(1.02) and rates[3] / rates[4] < AdaptiveK.GAIN_TO_SWITCH
    assert ak.choose(G(8, 2, 0.6), 5) == 2 and ak.choose(G(8, 4, 0.6), 5) == 4
    assert ak.choose(G(8, 1, 0.6), 5) == 3
    # after a long plain stretch it probes speculation again, at the k most likely to pay
    # (the cheapest, k = 1, at this acceptance), then more rarely
    costs(ak, 8, rest=1.0, draft=0.5)
    assert ak.choose(G(8, 0, 0.05, plain=AdaptiveK.PROBE_EVERY), 5) == 1
    assert ak.choose(G(8, 0, 0.05, plain=AdaptiveK.PROBE_EVERY), 5) == 0
    assert ak.probe_every == 2 * AdaptiveK.PROBE_EVERY
    # a batch size never measured borrows the nearest measured one's costs instead of
    # exploring every k again (sizes change every time a row finishes)
    for k in range(6):
        assert ak.cost(7, k) == ak.cost(8, k) == ak.cost(13, k)
    assert ak.choose(G(13, 5, 0.05), 5) == 0


def test_adaptive_k_measures_plain_decoding_once_per_batch_size():
    """Plain decoding's cost cannot be told from speculative steps (a one-token step costs a
    fraction of a k + 1 wide one on a compute-bound CPU, about as much on a memory-bound GPU),
    so plain steps measure it right after a bucket's first speculative steps, however well
    speculation seems to pay; from then on the measurement decides. A width's first step at
    a batch size runs cold (new shapes) and is not counted."""
    ak = AdaptiveK(max_k=5)
    assert ak.choose(G(8, 4, 0.5), 5) == 4              # nothing measured: the first step tells
    ak.observe(8, 4, 3.0, 0.4, [1] * 8)                 # cold: not counted
    assert ak.cost(8, 4) is None and ak.choose(G(8, 4, 0.5), 5) == 4
    ak.observe(8, 4, 2.0, 0.4, [1] * 8)                 # rest 1.6 s, a draft 0.1 s; 2 tokens a row
    assert ak.cost(8, 0) == pytest.approx(1.6)          # plain, unmeasured: taken as rest
    tokens = ak.tokens_by_k(0.5)
    assert tokens[4] / ak.cost(8, 4) > 1.2 / ak.cost(8, 0)   # speculation looks 20% better ...
    assert ak.choose(G(8, 4, 0.5), 5) == 0              # ... yet plain decoding is measured
    ak.observe(8, 0, 0.9, 0.0, [0] * 8)                 # cold
    for seconds in (0.55, 0.6, 0.65)[:StepCost.PLAIN_SAMPLES]:   # well below rest
        assert ak.choose(G(8, 4, 0.5), 5) == 0, "plain decoding measured a few times"
        ak.observe(8, 0, seconds, 0.0, [0] * 8)
    assert ak.costs.buckets[8].level == pytest.approx(0.6) and ak.costs.relative(8, 4) == pytest.approx(1.6 / 0.6)
    # 1 token per 0.6 s beats k = 4's 2 per 2.0 s; priced by width (a 5-wide verification
    # cost 1.6 s, a 1-wide one 0.6 s), k = 1's 1.9 tokens per 0.95 s beat both
    assert ak.cost(8, 1) == pytest.approx(0.6 * (1 + (1.6 / 0.6 - 1) / 4) + 0.1)
    assert ak.choose(G(8, 0, 0.5), 5) == 1
    # another bucket measures its own (a group shrinks as rows finish); where speculation
    # pays (every draft accepted), the measurement sends it straight back
    for _ in range(2):
        ak.observe(1, 4, 1.0, 0.2, [4])
    assert ak.choose(G(1, 4, 0.95), 5) == 0
    for _ in range(1 + StepCost.PLAIN_SAMPLES):
        ak.observe(1, 0, 0.6, 0.0, [0])
    assert ak.choose(G(1, 0, 0.95), 5) > 0


def test_a_bucket_met_later_measures_plain_decoding_only_where_it_could_win():
    """Once one bucket is priced, a batch size met later (the last rows of a run, a new
    arrival) borrows its widths' prices, scaled to the running width's measured cost here, and
    measures plain decoding only where at those prices speculation is within
    MEASURE_PLAIN_WITHIN of it: plain steps where speculation is far ahead only cost time."""
    ak = AdaptiveK(max_k=5)
    costs(ak, 8, rest=1.0, draft=0.1, plain=0.5)   # B = 8: a speculative step 2 plain steps
    for _ in range(3):   # B = 2, every draft kept: rest 0.6 s at k = 5 (the first runs cold)
        ak.observe(2, 5, 0.85, 0.25, [5, 5])
    assert ak.costs.has(2) and not ak.costs.priced(2) and ak.costs.donor(2) == 8
    assert ak.cost(2, 0) == pytest.approx(0.3) and ak.cost(2, 5) == pytest.approx(0.85)
    tokens = ak.tokens_by_k(ak.acceptance)
    assert tokens[5] / 0.85 > 1.5 / 0.3   # speculation 1.5x ahead of plain, at B = 8's prices
    assert ak.choose(G(2, 5, ak.acceptance), 5) == 5
    # acceptance falls: speculation's lead shrinks below the margin, and plain is measured
    for _ in range(20):
        ak.observe(2, 5, 0.85, 0.25, [0, 1])
    tokens = ak.tokens_by_k(ak.acceptance)
    assert max(tokens[k] / ak.cost(2, k) for k in range(1, 6)) < AdaptiveK.MEASURE_PLAIN_WITHIN / 0.3
    assert ak.choose(G(2, 5, ak.acceptance), 5) == 0
    for _ in range(1 + StepCost.PLAIN_SAMPLES):
        ak.observe(2, 0, 0.2, 0.0, [0, 0])
    assert ak.costs.priced(2) and ak.cost(2, 0) == pytest.approx(0.2, rel=0.05)
    # a batch size between two measured ones takes the larger's costs, whichever came first
    for _ in range(2):
        ak.observe(32, 5, 3.0, 0.5, [5] * 32)
    assert ak.costs.nearest(16) == 32 and ak.costs.nearest(4) == 8
    assert ak.costs.donor(4) == 8 and ak.costs.donor(16) == 8   # 32 is not priced
    # the first bucket has no one to borrow from: it measures plain decoding whatever the rates
    first = AdaptiveK(max_k=5)
    for _ in range(2):
        first.observe(2, 5, 0.85, 0.25, [5, 5])
    assert first.costs.donor(2) is None and first.choose(G(2, 5, first.acceptance), 5) == 0


def test_adaptive_k_measures_what_each_k_commits():
    """Acceptance comes in runs: half the row-steps accept all 5 drafts, half none. Every step
    at k = 5 also says what k' < 5 would have committed (min(a, k') + 1), so the yields are
    measured for every k, where the geometric model at the same per-token acceptance (about
    5/6) predicts 1.8 and 3.8."""
    ak = AdaptiveK(max_k=5)
    costs(ak, 1, rest=1.0, draft=0.25, plain=1.0)
    for _ in range(30):
        ak.observe(1, 5, 2.25, 1.25, [5])
        ak.observe(1, 5, 2.25, 1.25, [0])
    assert ak.cost(1, 5) == pytest.approx(2.25) and ak.cost(1, 1) == pytest.approx(1.25)
    a = ak.acceptance
    assert a == pytest.approx(5 / 6, abs=0.03)
    assert ak.tokens_by_k(a)[5] == pytest.approx(3.5, rel=0.05)
    assert ak.tokens_by_k(a)[1] == pytest.approx(1.5, rel=0.05)
    geometric = [(1 - a ** (k + 1)) / (1 - a) for k in range(6)]   # the model's view
    assert geometric[1] > 1.75 and geometric[5] > 3.75
    # measured: k = 5 commits 3.5 per 2.25 s; k = 1: 1.5 per 1.25 s; plain: 1 per 1 s
    assert ak.choose(G(1, 1, a), 5) == 5
    assert ak.choose(G(1, 5, a), 5) == 5


def test_adaptive_k_forgets_depths_it_no_longer_verifies():
    """An early stretch of low acceptance at k = 5 (the bench's warm-up, a hard prompt) must not
    keep k low once rows accept everything: drafts beyond the current k are no longer verified,
    so their stale counts fade and their hazards follow the deepest measured one."""
    ak = AdaptiveK(max_k=5)
    costs(ak, 1, rest=1.0, draft=0.1, plain=1.0)   # a cheap draft: every k pays at high acceptance
    for _ in range(20):
        ak.observe(1, 5, 1.5, 0.5, [1])   # accept one draft, reject the second
    assert ak.choose(G(1, 5, ak.acceptance), 5) == 1
    for _ in range(100):
        ak.observe(1, 1, 1.1, 0.1, [1])   # every draft accepted at k = 1
    assert ak.tokens_by_k(ak.acceptance)[5] > 4.5
    assert ak.choose(G(1, 1, ak.acceptance), 5) == 5


def _drive(ak, rest, draft, speed, steps, row, accepted=lambda k: k):
    """`steps` steps of one row (a G) chosen by `ak`, each timed at (rest + k x draft) x speed;
    the k's it ran besides neighbour probes, and the probes' k's."""
    ran, probes = [], []
    for _ in range(steps):
        row._a = ak.acceptance
        k = row.k = ak.choose(row, 5)
        ak.observe(1, k, (rest + k * draft) * speed, k * draft * speed, [accepted(k)])
        (probes if row.k_before_probe is not None else ran).append(k)
    return ran, probes


def test_adaptive_k_compares_costs_at_one_machine_speed():
    """The machine slows by a quarter (every op alike: a busy neighbour, a lower clock) and
    swings step by step: k stays at its best, since the costs that tell k's apart are measured
    at the same moments. When drafting alone gets costlier, k moves down. Every
    WIDTH_PROBE_EVERY-th step a neighbour k is measured, and k goes back."""
    ak, row = AdaptiveK(max_k=5), G(1, 5, 0.7)
    # plain steps measure plain decoding after the first speculative ones (a width's first
    # step at a batch size runs cold and is not counted)
    plain = 1 + StepCost.PLAIN_SAMPLES
    ran, probes = _drive(ak, 1.0, 1 / 3, 1.0, 18 + plain, row)
    assert ran == [5, 5] + [0] * plain + [5] * (16 - len(probes)) and probes == [4], ran
    ran, probes = _drive(ak, 1.0, 1 / 3, 1.25, 50, row)
    # the first probe ran cold (k = 4's first step): k = 4 again, measured; k stays, and the
    # probes grow rarer
    assert ran == [5] * (50 - len(probes)) and probes == [4, 4]
    swings = iter([0.8, 1.2, 1.0, 1.25, 0.9] * 20)
    runs = [_drive(ak, 1.0, 1 / 3, next(swings), 1, row) for _ in range(100)]
    assert {k for ran, _ in runs for k in ran} == {5} and {k for _, p in runs for k in p} == {4}
    # the draft alone gets six times as costly (each draft token now costs twice a plain
    # step), and rows accept only 2 of 5 drafts: fewer drafts pay
    ran, _ = _drive(ak, 1.0, 2.0, 1.25, 60, row, accepted=lambda k: min(k, 2))
    assert max(ran[-10:]) < 5, ran


def test_scheduler_picks_starving_group_and_merges_equal_lengths():
    """Bookkeeping on a hand-built pool (no model): which groups one tick steps together."""
    from exspec.config import EngineConfig
    from exspec.engine.group import Group

    class Seq:
        def __init__(self, length, skipped):
            self.num_tokens, self.skipped_ticks, self.isolated = length, skipped, False

    def group(lengths, skipped=0):
        return Group([Seq(n, skipped) for n in lengths], None, None)

    config = EngineConfig(target_model="t", draft_model="d", method="exspec", max_batch_size=4,
                          max_num_seqs=16, max_skipped_ticks=3)
    sched = Scheduler(config, DraftModelProposer(model=None))
    big, small_same, small_other, starving = (group([10, 10, 10]), group([10]), group([30]),
                                              group([50, 51], skipped=3))
    plan = sched.choose([big, small_same, small_other])
    assert plan.groups == [big, small_same], "top up with the equal-length group"
    plan = sched.choose([big, small_same, small_other, starving])
    assert plan.groups[0] is starving and sum(len(g) for g in plan.groups) <= 4


@pytest.mark.parametrize("fault", ["forward_error_every", "forward_oom_every"])
@pytest.mark.parametrize("chunk", [None, 32])
def test_injected_forward_faults_fail_only_a_row_stepping_alone(pairs, reference, fault, chunk, caplog):
    """Every 23rd forward raises. A failure in a forward several rows share sends each back to
    be prefilled again (prompt and output; in chunks of `chunk` tokens when the tick's budget is
    that small) and stepped alone; only a row whose own forward raises while alone ends with the
    error. Every other row equals target-only. Each isolation is a warning in the log, with the
    error, so a failure every shared step meets is not hidden behind exact outputs."""
    from exspec.utils.faults import EngineCrash  # noqa: F401  (the module documents the keys)
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=4,
                         max_num_seqs=8, max_num_batched_tokens=chunk, fault_injection={fault: 23})
    prompts = make_prompts(320, pairs["llama", "eos"], seed=29, count=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=20))
    failed = [o for o in outs if o.finish_reason == "error"]
    assert len(failed) < len(outs), [o.finish_reason for o in outs]
    assert all("injected fault" in o.error for o in failed)
    for o, p in zip(outs, prompts):
        if o.finish_reason != "error":
            assert o.token_ids == reference(pairs["llama", "target"], p, 20)
    stats = engine.stats()
    assert stats["isolated_rows"] > 0, "no fault hit a shared forward: lower the fault period"
    shared = [r.getMessage() for r in caplog.records if "run on their own" in r.getMessage()]
    assert shared and all("injected fault" in m for m in shared), caplog.text[-2000:]
    assert len(shared) <= stats["isolated_rows"]
    alone = [r.getMessage() for r in caplog.records if "failed on its own" in r.getMessage()]
    assert len(alone) == len(failed) and all("injected fault" in m for m in alone)
    assert stats["pool_seqs"] == 0 and not engine.pool.waiting


def test_injected_crash_escapes_the_tick_and_bad_fault_keys_are_refused(pairs):
    from exspec.utils.faults import EngineCrash
    engine = make_engine(pairs, "llama", "noisy", fault_injection={"crash_after_ticks": 2})
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    engine.step()
    with pytest.raises(EngineCrash):
        engine.step()
    with pytest.raises(ValueError, match="unknown fault_injection keys: explode"):
        make_engine(pairs, "llama", "noisy", fault_injection={"explode": 1})


def test_draft_stop_ends_a_round_only_where_drafting_on_does_not_pay():
    """Calibrated: drafts the draft is 10-20% sure of are always rejected, 80-90% sure ones
    always accepted. With costly drafts the round ends after an unsure draft, never after a sure
    one, nor where one row's sure drafts still pay for the round; with drafts almost free a
    coin-flip draft does not end it; a depth whose round cost is unknown never ends it; a fixed confidence
    ends it where every row is below it (Hugging Face's rule)."""
    stop = DraftStop()
    for _ in range(50):
        stop.observe([[8, 8, 8, 1], [8, 8, 8, 8]], [3, 4], [4, 4])
    calibrated = stop.acceptance_by_bin()
    assert calibrated[1] < 0.1 and calibrated[8] > 0.9
    assert calibrated == sorted(calibrated)   # non-decreasing in confidence
    hazards, costly = [0.2] * 5, (lambda j: 1.0 + 0.2 * j)   # k = 5 still pays most

    def ends(confidences_by_depth, cost=costly, rule=stop):
        """After which draft (1-based) the round ends; None: drafted whole."""
        round_ = rule.round(5, hazards, cost)
        return next((j for j, c in enumerate(confidences_by_depth, 1) if round_.ends_after(j, c)), None)

    assert ends([[0.85]] * 4) is None                     # sure all the way
    assert ends([[0.85], [0.85], [0.15], [0.85]]) == 3    # ends after the unsure draft
    assert ends([[0.15], [0.85], [0.85], [0.85]]) == 1
    assert ends([[0.85, 0.15]] * 4) is None               # one row's sure drafts pay for the round
    assert ends([[0.15, 0.15], [0.85, 0.85]]) == 1        # neither row expects a kept draft
    assert ends([[0.55]] * 4) == 2                        # two coin flips: drafting on does not pay
    assert ends([[0.55]] * 4, cost=lambda j: 1.0 + 0.001 * j) is None   # ... a nearly free one
    assert ends([[0.15]] * 4, cost=lambda j: None if j == 1 else costly(j)) == 2
    fixed = DraftStop(0.4)
    assert ends([[0.85, 0.3], [0.3, 0.3]], rule=fixed) == 2
    assert ends([[0.85, 0.3], [0.85, 0.3]], cost=lambda j: None, rule=fixed) is None


def test_draft_stop_calibrates_each_depth_toward_every_depth():
    """A draft deep in a kept run is kept more often than its confidence says: acceptance is
    calibrated per depth, shrunk toward every depth's. 30% sure first drafts are rejected, 30%
    sure fourth drafts (after three kept) accepted: the round ends after the first, drafts on
    past the fourth; a depth never seen takes every depth's calibration."""
    stop = DraftStop()
    for _ in range(100):
        stop.observe([[3], [9, 9, 9, 3, 9]], [0, 5], [5, 5])
    assert stop.acceptance_by_bin(1)[3] < 0.3 and stop.acceptance_by_bin(4)[3] > 0.8
    assert 0.4 < stop.acceptance_by_bin()[3] < 0.6
    assert stop.acceptance_by_bin(7) == stop.acceptance_by_bin()
    cost = lambda j: 1.0 + 0.3 * j
    assert stop.round(5, [0.05] * 5, cost).ends_after(1, [0.35])
    round_ = stop.round(5, [0.05] * 5, cost)
    assert not any(round_.ends_after(j, [c]) for j, c in ((1, 0.95), (2, 0.95), (3, 0.95), (4, 0.35)))
    # every depth's calibration (0.5 at 30%) would have ended that round after the fourth draft
    stop.acceptance_by_bin = lambda depth=None: DraftStop.acceptance_by_bin(stop)
    round_ = stop.round(5, [0.05] * 5, cost)
    assert [round_.ends_after(j, [c]) for j, c in ((1, 0.95), (2, 0.95), (3, 0.95), (4, 0.35))][-1]


def test_draft_stop_counts_only_drafts_the_target_verified():
    """A row that accepted a of its drafts verified drafts 1 .. a+1 (within its own cap); the
    drafts after a rejection were never checked and say nothing about confidence."""
    stop = DraftStop()
    stop.DECAY = 1.0
    stop.observe([[9, 5, 3, 3]], [1], [4])     # draft 1 accepted, 2 rejected, 3 and 4 unverified
    stop.observe([[9, 9, 9, 9]], [2], [2])     # a cap of 2: only drafts 1 and 2 count
    assert stop.verified[9] == 3 and stop.accepted[9] == 3
    assert stop.verified[5] == 1 and stop.accepted[5] == 0
    assert stop.verified[3] == 0


def test_adaptive_k_prices_the_verifications_width():
    """A compute-bound verifier (a plain step P, each more verified column 0.14 P, as the real
    pair on this CPU at B = 1) and a nearly free draft, rows keeping exactly one draft: k = 1
    commits as much as k = 5 for 0.63 P instead of 0.93 P. Priced by width, k comes down to 1;
    taken as width-free, k = 5 looked only 0.4% dearer and stayed. (Now and then k = 2 runs a
    few steps: the second draft's stale counts fade and k = 2 is checked again.)"""
    P, gamma, draft = 0.55, 0.14, 0.001
    ak, row = AdaptiveK(max_k=5), G(1, 5, 0.7)
    ran = []
    for _ in range(60):
        k = row.k = ak.choose(row, 5)
        ak.observe(1, k, P * (1 + gamma * k) + k * draft, k * draft, [min(k, 1)])
        if row.k_before_probe is None:
            ran.append(k)
    assert ak.costs.relative(1, 1) == pytest.approx(1 + gamma, rel=0.02)
    assert ak.costs.relative(1, 5) == pytest.approx(1 + 5 * gamma, rel=0.02)
    assert ak.cost(1, 1) == pytest.approx(P * (1 + gamma) + draft, rel=0.02)
    assert max(ran[-30:]) == 2 and ran[-30:].count(1) > ran[-30:].count(2), ran


def test_adaptive_k_measures_each_width_by_probing_its_neighbours():
    """A verifier whose cost is not one share per column (the real pair at B = 8 on this CPU: a
    k = 1 step 1.57 plain steps, a k = 2 step 1.63: a speculative step's own cost, then 0.06 a
    column), rows keeping 0-5 drafts: k = 5 commits the most per second (1.70 tokens a row per
    plain step's time, k = 1 1.10). Starting at k = 1, a share per column taken from k = 1's
    step prices k = 2 at 2.14 plain steps and k stays at 1; probing the neighbours measures
    k = 2, the fit finds the step's own cost and the column's, and k moves to 5. Probes are
    every WIDTH_PROBE_EVERY-th step (rarer while k stays) and the group returns to its k."""
    shape = {0: 1.0, 1: 1.57, 2: 1.63, 3: 1.69, 4: 1.75, 5: 1.81}
    keeps = [0, 0, 1, 2, 2, 3, 5, 5]

    def run(ak, steps=120):
        row, ran, probes = G(8, 1, 0.7), [], []
        for _ in range(steps):
            row._a = ak.acceptance
            k = row.k = ak.choose(row, 5)
            ak.observe(8, k, shape[k] + 0.02 * k, 0.02 * k, [min(k, a) for a in keeps])
            (probes if row.k_before_probe is not None else ran).append(k)
        return ran, probes

    ak = AdaptiveK(max_k=5)
    ran, probes = run(ak)
    assert ran[:4] == [1, 1, 0, 0] and ran[-40:] == [5] * 40, ran
    assert ak.costs.fit(8) == pytest.approx((0.51, 0.06))
    assert ak.costs.relative(8, 3) == pytest.approx(1.69)
    assert 2 in probes and 4 in probes and len(probes) <= 120 // AdaptiveK.WIDTH_PROBE_EVERY
    unprobed = AdaptiveK(max_k=5)
    unprobed.WIDTH_PROBE_EVERY = 10 ** 9
    ran, probes = run(unprobed)
    assert not probes and ran[-40:] == [1] * 40, ran
    assert unprobed.costs.relative(8, 2) == pytest.approx(2.14)


def test_adaptive_k_measures_plain_decoding_again_near_a_tie():
    """Plain decoding measured dear in a bucket's first steps (1.3 where it costs 1.0 after:
    cold shapes, a slow moment) priced speculation at k = 2 about 15% ahead of it, where it runs
    at 0.88 of its rate (the real pair's draft at B = 8: a speculative step's own cost large, a
    column small, 1.5 tokens a row at k = 2). From k = 2 the neighbour probes measure k = 1 and
    3, never plain, so k stayed at 2 for good. Near a tie the probe below k is plain decoding,
    PLAIN_SAMPLES plain steps each after a step at k; priced afresh, k goes to plain. Where
    plain decoding is as dear as first measured, the probes leave k where it was."""
    keeps = [0, 0, 0, 0, 0, 1, 1, 2]

    def run(ak, dear_for_good, steps=200):
        row, ran, probes, plain = G(8, 2, 0.7), [], [], 0
        for _ in range(steps):
            row._a = ak.acceptance
            k = row.k = ak.choose(row, 5)
            plain += k == 0
            rest = 1.3 if k == 0 and (plain <= 4 or dear_for_good) else 1.0 if k == 0 else 1.5 + 0.05 * k
            ak.observe(8, k, rest + 0.05 * k, 0.05 * k, [min(k, a) for a in keeps])
            (probes if row.k_before_probe is not None else ran).append(k)
        return ran, probes

    ak = AdaptiveK(max_k=5)
    ran, probes = run(ak, dear_for_good=False)
    assert ran[-100:].count(0) >= 95, ran   # plain, but for speculation's rare re-probes
    assert probes[probes.index(0):][:5] == [0, 2, 0, 2, 0], probes
    assert ak.costs.relative(8, 2) == pytest.approx(1.6, rel=0.02)
    never = AdaptiveK(max_k=5)
    never.PLAIN_PROBE_WITHIN = 0.0   # the probes of before: k - 1 and k + 1 only
    ran, probes = run(never, dear_for_good=False)
    assert 0 not in probes and ran[-100:] == [2] * 100, ran
    dear = AdaptiveK(max_k=5)
    ran, probes = run(dear, dear_for_good=True)
    assert ran[-100:] == [2] * 100 and 0 < probes.count(0) <= 2 * dear.costs.PLAIN_SAMPLES, probes


def test_adaptive_k_probes_speculation_steadily_near_a_tie():
    """A stretch of poor drafts sends a group to plain decoding where k = 1, in truth, leads it
    by 8% (the EAGLE-3 head on the real pair at B = 8 on an AMD EPYC: a k = 1 step 1.33 plain
    steps, 1.44 tokens a row). Each probe measures acceptance a little; where each doubled the
    wait (8, 16, 32, 64 plain steps), the group decoded plainly for 110 steps. Near a tie the
    probes come every PROBE_EVERY plain steps and k = 1 returns after a few; far from one (a
    draft at 0.83 of plain decoding's rate: within 1.25 of it, probes cost it 2%) they still
    grow rarer."""
    def run(keeps, poor=range(0)):
        """300 steps of a 9-row group, k <= 1: a k = 1 step costs 1.33 plain steps, row r keeps
        draft 1 where keeps[r] (none in the `poor` steps); the k of each step."""
        ak, group, ran = AdaptiveK(max_k=4), G(9, None, 0.0), []
        for step in range(300):
            group._a = ak.acceptance
            k = group.k = ak.choose(group, 1)
            group.plain_steps_in_a_row = group.plain_steps_in_a_row + 1 if k == 0 else 0
            kept = [0] * 9 if step in poor else [min(k, a) for a in keeps]
            ak.observe(9, k, 1.0 + 0.33 * k, 0.03 * k, kept)
            ran.append(k)
        return ran

    ran = run([1, 1, 1, 1, 0, 0, 0, 0, 0], poor=range(60, 75))   # 4 of 9 rows keep draft 1
    after = "".join(map(str, ran[75:]))
    assert after.startswith("0"), after   # the stretch sent it to plain decoding
    plain = after[:after.index("1" * 20)]   # until k = 1 runs for good
    assert plain.count("0") <= 5 * AdaptiveK.PROBE_EVERY, after
    assert all(len(zeros) <= AdaptiveK.PROBE_EVERY for zeros in plain.split("1")), after
    assert ran[-100:].count(0) <= 10, ran   # but for the near-tie plain probes
    # a draft that, priced fairly, runs at 0.83 of plain decoding's rate (1 row of 9 keeps
    # draft 1): its probes still grow rarer
    ran = run([1] + [0] * 8)
    assert ran[-200:].count(1) <= 4, ran


def test_step_cost_measures_widths_as_ratios_at_the_moments_speed():
    """StepCost: a width's price is its step time over the level the yardstick's steps set. The
    host slowing by a quarter while one width runs moves the level, not the prices; plain
    steps keep plain steps the unit; a width's first step at a bucket runs cold and is not
    counted; widths on a line are priced by it, a speculative step's own cost plus one per
    column."""
    from exspec.engine.step_cost import StepCost
    cost = StepCost()
    cost.observe(8, 2, 3.0, 0.1)                  # a width's first step at a bucket runs cold
    assert cost.seconds(8, 2) is None
    cost.observe(8, 2, 1.7, 0.1)                  # the bucket's first warm step: 1.6 s besides drafts
    assert not cost.priced(8) and cost.seconds(8, 0) == pytest.approx(1.6)   # plain taken as it
    cost.observe(8, 0, 2.0, 0.0)                  # cold
    for _ in range(StepCost.PLAIN_SAMPLES):
        assert not cost.priced(8)
        cost.observe(8, 0, 1.0, 0.0)
    assert cost.priced(8) and cost.relative(8, 0) == 1.0 and cost.relative(8, 2) == pytest.approx(1.6)
    assert cost.relative(8, 1) == pytest.approx(1.3)   # one width measured: a share per column
    for seconds in (2.0, 1.4):
        cost.observe(8, 1, seconds, 0.05)
    assert cost.fit(8) == pytest.approx((0.1, 0.25)) and cost.relative(8, 1) == pytest.approx(1.35)
    for _ in range(60):                           # the host slows by a quarter, back at k = 2
        cost.observe(8, 2, 1.25 * 1.7, 1.25 * 0.1)
    assert cost.buckets[8].yardstick == 2 and cost.fit(8) == pytest.approx((0.1, 0.25))
    assert cost.seconds(8, 0) == pytest.approx(1.25, rel=0.01)   # the level followed
    assert cost.seconds(8, 2) == pytest.approx(1.25 * 1.7, rel=0.01)
    cost.observe(8, 1, 1.25 * 1.4, 1.25 * 0.05)   # another width, at the new speed: the same price
    assert cost.relative(8, 1) == pytest.approx(1.35, rel=0.01)
    cost.observe(8, 4, 9.0, 0.0)                  # cold
    cost.observe(8, 4, 1.25 * 2.1, 0.0)           # 2.1 plain steps at k = 4
    assert cost.relative(8, 3) == pytest.approx(1.85, rel=0.01)
    assert cost.relative(8, 5) == pytest.approx(2.35, rel=0.01)
    assert cost.seconds(16, 4) == cost.seconds(8, 4) and cost.seconds(2, 4) == cost.seconds(8, 4)
    # two steps in a row at k = 1: k moved, and k = 1 is the yardstick the others are measured
    # against; its steps move the level, not its price, however the host's speed swings
    for speed in (1.25, 1.25, 1.5, 1.0):
        cost.observe(8, 1, speed * 1.4, speed * 0.05)
    assert cost.buckets[8].yardstick == 1 and cost.relative(8, 1) == pytest.approx(1.35, rel=0.01)
    # a width measured cheaper than a narrower one: never priced below it (no negative column)
    other = StepCost()
    for k, seconds in ((3, 2.0), (3, 2.0), (0, 1.0), (0, 1.0), (1, 2.2), (1, 2.2)):
        other.observe(4, k, seconds, 0.0)
    assert other.fit(4) == pytest.approx((1.1, 0.0)) and other.relative(4, 5) == pytest.approx(2.1)
    # a draft forward's price comes from the steps that drafted; a step at k that drafted
    # nothing (a hybrid's step on suffix decoding alone) leaves it, and is priced without it
    drafted = StepCost()
    for seconds, drafting in ((2.0, 0.4), (2.0, 0.4), (1.6, 0.0)):
        drafted.observe(2, 4, seconds, drafting)
    assert drafted.buckets[2].draft == pytest.approx(0.1), "a step without drafts is no draft's price"
    assert drafted.seconds(2, 4) - drafted.seconds(2, 4, drafts=0) == pytest.approx(0.4)


def test_step_cost_keeps_a_widths_own_price_where_it_stands_out_from_the_line():
    """A verifier whose cost is a staircase in width (the real pair at B = 1 on this CPU: k = 1
    1.07 plain steps, k = 2 1.15, k = 3 1.65, k = 4 1.71), each width measured five times with
    +-2% scatter: a line misprices k = 1 by 0.1 (above the 9% that k = 1 gains on plain
    decoding there), the prices keep each width's own median (within its noise of it). Widths on a line measured twice,
    5% off it one way: within their noise of the line, they are priced by it. A width not
    measured is priced no dearer than the line between its measured neighbours; the running
    width (the yardstick) is priced as measured."""
    from exspec.engine.step_cost import StepCost
    stairs, scatter = {1: 1.07, 2: 1.15, 3: 1.65, 4: 1.71}, [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    cost = StepCost()
    for _ in range(2):   # plain steps first (cold, then warm): plain is the yardstick
        cost.observe(1, 0, 1.0, 0.0)
    for swing in scatter:   # each width between plain steps (the first of each runs cold)
        for k, price in stairs.items():
            cost.observe(1, k, price * swing, 0.0)
            cost.observe(1, 0, 1.0, 0.0)
    jump, column = cost.fit(1)
    assert abs(1 + jump + column - stairs[1]) > 0.08, "the line misprices k = 1"
    for k, price in stairs.items():   # the line is up to 0.19 off; a price, 0.025 at most
        assert cost.relative(1, k) == pytest.approx(price, abs=0.025), k
    assert cost.relative(1, 1) == pytest.approx(stairs[1], abs=0.01)   # the one that decides
    # only k = 3 and 4 measured: the fit through them prices k = 1 at 1.58, which would never
    # be run to be measured; a width not measured takes the line from plain decoding instead
    upper = StepCost()
    for _ in range(2):
        upper.observe(1, 0, 1.0, 0.0)
    for _ in range(3):
        for k in (3, 4):
            upper.observe(1, k, stairs[k], 0.0)
            upper.observe(1, 0, 1.0, 0.0)
    jump, column = upper.fit(1)
    assert 1 + jump + column > 1.5
    assert upper.relative(1, 1) == pytest.approx(1 + (stairs[3] - 1) / 3)
    assert upper.relative(1, 2) == pytest.approx(1 + 2 * (stairs[3] - 1) / 3)
    line = StepCost()
    for _ in range(2):
        line.observe(4, 0, 1.0, 0.0)
    for swing in (1.0, 1.0, 1.05):   # cold, then k = 4 measured 5% dear, twice
        for k in (3, 4, 5):
            line.observe(4, k, (1.2 + 0.1 * k) * (swing if k == 4 else 1.0), 0.0)
            line.observe(4, 0, 1.0, 0.0)
    assert line.buckets[4].ratio[4] == pytest.approx(1.6 * 1.025)   # its own median: 2.5% dear
    assert abs(line.relative(4, 4) - 1.6) < 0.4 * abs(line.buckets[4].ratio[4] - 1.6)
    for _ in range(2):   # k = 4 runs now: the yardstick every step is measured against
        line.observe(4, 4, 1.6 * 1.025, 0.0)
    assert line.buckets[4].yardstick == 4 and line.buckets[4].ratio[4] > 1.61
    assert line.relative(4, 4) == line.buckets[4].ratio[4], "the yardstick is priced as measured"
