"""Admission by reservation (max_num_kv_tokens): a request is admitted only when what it can
grow to fits, so a burst whose max_tokens far exceed the budget completes exactly, nothing
fails and the KV held never passes the budget; one that can never fit is refused at once.
Admission counts what the layout allocates, not what rows use: the KV tensors' own bytes stay
within the budget through a churning schedule on both layouts."""
import pytest

from exspec import EngineBusyError, InvalidRequestError, SamplingParams
from exspec.kv import blocks as kv_blocks
from exspec.engine.llm_engine import kv_bytes_per_entry
from exspec.kv.padded import PaddedKV
from exspec.engine.scheduler import Scheduler

from enginekit import make_engine, make_prompts

K = 5
MAX_TOKENS = 60
LONGEST = 40                                  # make_prompts' longest prompt
ENTRIES = kv_blocks.BlockStores.entries_for    # whole blocks (EQSPEC's layout: per token)
PEAK = 2 * ENTRIES(LONGEST + MAX_TOKENS - 1 + K)   # both models, the last step's drafts included
BUDGET = 3 * PEAK                             # a few long sequences at a time
SCRATCH = 2 * kv_blocks.BLOCK_SIZE            # each block store's scratch block


def burst(pairs, method, count=16):
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=4, max_num_seqs=16,
                         num_speculative_tokens=K, max_num_kv_tokens=BUDGET)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=51, count=count)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS))
    return engine, prompts


def drive(engine):
    """Run to the end; per request its tokens and final output, and the pool's peaks."""
    got, final, peak = {}, {}, {"used": 0, "reserved": 0, "allocated": 0, "seqs": 0, "queue": 0}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        stats = engine.stats()
        for key, stat in (("used", "pool_kv_tokens"), ("reserved", "pool_kv_tokens_reserved"),
                          ("allocated", "pool_kv_tokens_allocated"), ("seqs", "pool_seqs"),
                          ("queue", "queue_len")):
            peak[key] = max(peak[key], stats[stat])
    return got, final, peak


@pytest.mark.parametrize("method", ["exspec", "eqspec"])
def test_a_burst_beyond_the_kv_budget_completes_exactly_within_it(pairs, reference, method):
    engine, prompts = burst(pairs, method)
    assert sum(2 * (len(p) + MAX_TOKENS + K) for p in prompts) > 2 * BUDGET
    got, final, peak = drive(engine)
    for i, p in enumerate(prompts):
        out = final[f"r{i}"]
        assert out.finish_reason in ("stop", "length"), f"r{i}: {out.finish_reason} {out.error}"
        assert got[f"r{i}"] == reference(pairs["llama", "target"], p, MAX_TOKENS), f"r{i} differs"
    assert peak["used"] <= peak["reserved"] <= BUDGET, peak
    assert peak["queue"] > 0 and peak["seqs"] < len(prompts), f"the budget never bound: {peak}"


def test_admitting_by_prompt_alone_overruns_the_budget_negative_control(pairs, monkeypatch):
    """The old rule (prompt tokens only) runs the pool out of KV mid-generation: the block
    stores fill up and requests fail, which the test above would catch."""
    monkeypatch.setattr(Scheduler, "reservation", lambda self, seq: self.models * seq.num_tokens)
    engine, _ = burst(pairs, "exspec")
    _, final, peak = drive(engine)
    failed = [o.error for o in final.values() if o.finish_reason == "error"]
    assert failed and all("KV store full" in e for e in failed), (failed, peak)


def test_allocated_kv_never_exceeds_the_budget(pairs):
    """EXSPEC's block stores: the blocks rows hold stay within their reservations, and the
    stores, made at their share (scratch blocks included) and never grown, within the budget."""
    engine, _ = burst(pairs, "exspec")
    _, final, peak = drive(engine)
    assert all(o.finish_reason != "error" for o in final.values())
    assert peak["allocated"] <= peak["reserved"] <= BUDGET, peak
    stores = engine.runner.kv_layout.stores.values()
    assert not any(s.grows for s in stores)
    capacity = sum(s.num_blocks * kv_blocks.BLOCK_SIZE for s in stores)
    assert BUDGET - len(stores) * kv_blocks.BLOCK_SIZE < capacity <= BUDGET, capacity


def kv_bytes(engine) -> dict[str, int]:
    """Per model, the bytes of the KV tensors alive in the pool, measured on the tensors: each
    storage once, whole (a view keeps its storage alive), the block stores' included."""
    layout, pool = engine.runner.kv_layout, engine.pool
    groups = pool.groups + pool.prefilling + ([pool.planned[0]] if pool.planned else [])
    out = {}
    for role, model in (("target", engine.target), ("draft", engine.draft)):
        # Group.caches(): the target's, then the proposer's (the draft model's)
        caches = [g.caches()[role == "draft"].cache for g in groups]
        if isinstance(layout, kv_blocks.BlockStores) and id(model) in layout.stores:
            caches.append(layout.stores[id(model)].cache)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for cache in caches for layer in cache.layers if layer.is_initialized
                    for t in (layer.keys, layer.values)}
        out[role] = sum(storages.values())
    return out


def churn(pairs, reference, method):
    """Requests of mixed lengths arriving while others run, two aborted mid-way, to the end;
    checks every output against target-only greedy and returns each model's peak KV bytes
    (sampled after every step) and its share of the budget in bytes."""
    engine = make_engine(pairs, "llama", "noisy", method=method, max_batch_size=8,
                         max_num_seqs=16, num_speculative_tokens=K, max_num_kv_tokens=BUDGET)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=53, count=14)
    # long rows (prompts of 21-40 tokens, 60 new) between short ones (1-14, 16-20 new): a
    # padded group's longest row sets every row's width
    prompts = [prompts[i] for i in (6, 0, 7, 1, 8, 2, 10, 3, 11, 4, 12, 5, 13, 9)]
    max_tokens = [MAX_TOKENS if i % 2 == 0 else 16 + i % 5 for i in range(len(prompts))]
    aborts = {10: "r4", 14: "r8"}   # two long rows, a few steps after they arrived
    got, final, peak, step = {}, {}, {"target": 0, "draft": 0}, 0
    while step < len(prompts) or engine.has_unfinished():
        if step < len(prompts):   # one arrival per step
            engine.add_request(f"r{step}", prompts[step], SamplingParams(max_tokens=max_tokens[step]))
        if step in aborts:
            engine.abort(aborts[step])
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        peak = {role: max(peak[role], n) for role, n in kv_bytes(engine).items()}
        step += 1
    share = {role: BUDGET // 2 * kv_bytes_per_entry(model)
             for role, model in (("target", engine.target), ("draft", engine.draft))}
    for i, p in enumerate(prompts):
        rid, want = f"r{i}", reference(pairs["llama", "target"], p, max_tokens[i])
        assert final[rid].finish_reason != "error", f"{rid}: {final[rid].error}"
        if final[rid].finish_reason == "abort":
            assert got.get(rid, []) == want[:len(got.get(rid, []))], f"{rid} (aborted) differs"
        else:
            assert got[rid] == want, f"{rid} differs from target-only greedy"
    assert {o.finish_reason for o in final.values()} >= {"abort", "length"}
    return peak, share


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_kv_bytes_stay_within_the_budget_through_churn(pairs, reference, method):
    """The bytes each model's KV tensors take never pass its share of max_num_kv_tokens, and
    the budget binds (the pool comes within half of it)."""
    peak, share = churn(pairs, reference, method)
    for role in peak:
        assert share[role] / 2 < peak[role] <= share[role], f"{role}: {peak[role]} of {share[role]} bytes"


def test_admitting_padded_rows_by_use_overruns_the_budget_negative_control(pairs, reference,
                                                                           monkeypatch):
    """EQSPEC admitting by the entries rows use (the old rule) lets rows x the longest row pass
    the budget, which the test above would catch."""
    monkeypatch.setattr(PaddedKV, "allocation_for", staticmethod(lambda reservations, models: sum(reservations)))
    peak, share = churn(pairs, reference, "eqspec")
    assert any(peak[role] > share[role] for role in peak), (peak, share)


def test_a_request_that_can_never_fit_is_refused_at_once(pairs, reference):
    engine = make_engine(pairs, "llama", "noisy", method="exspec", max_batch_size=2,
                         max_num_seqs=4, max_queue_len=2, num_speculative_tokens=K,
                         max_num_kv_tokens=PEAK + SCRATCH)
    prompt = make_prompts(320, pairs["llama", "eos"], seed=52, count=8)[7]   # LONGEST tokens
    too_many = MAX_TOKENS + kv_blocks.BLOCK_SIZE   # one block more than fits
    with pytest.raises(InvalidRequestError, match=rf"prompt \({LONGEST} tokens\) \+ max_tokens "
                                                  rf"\({too_many}\) can grow to {PEAK + 32 + SCRATCH} KV "
                                                  rf"cache entries, more than the whole pool holds"):
        engine.add_request("huge", prompt, SamplingParams(max_tokens=too_many))
    assert not engine.has_unfinished()
    # each of these fits alone but not beside another: they wait, in turn, and complete
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("r0", prompt, params)
    engine.add_request("r1", prompt, params)
    engine.step()   # r0 admitted; r1 waits for its room
    engine.add_request("r2", prompt, params)
    with pytest.raises(EngineBusyError, match="busy"):   # beyond the queue: the busy error
        engine.add_request("r3", prompt, params)
    got, final, peak = drive(engine)
    assert [final[f"r{i}"].finish_reason for i in range(3)] == ["length"] * 3, final
    assert peak["seqs"] == 1 and peak["reserved"] <= PEAK + SCRATCH, peak


def test_a_gpu_budget_splits_memory_by_each_models_bytes_per_entry():
    """The budget a GPU's free memory gives (kv_token_budget): every row holds an entry per token
    in each model's store, so a store gets free / (the bytes per entry of all models) entries.
    A draft as costly as the target halves the memory, as before; a one-layer EAGLE head's store
    takes its own bytes, and the target's store nearly all the memory."""
    from exspec.demo.tiny import llama
    from exspec.engine.llm_engine import kv_entries_in
    from exspec.models.eagle3 import head_for
    target = llama(320, seed=1, layers=12, hidden=64)
    head = head_for(target, (2, 6, 9))
    t, h = kv_bytes_per_entry(target), kv_bytes_per_entry(head)
    assert t == 12 * h
    free = 1_000_000 * t
    assert kv_entries_in(free, [target]) == 1_000_000
    assert kv_entries_in(free, [target, target]) == 1_000_000            # 500k entries a store
    per_store = kv_entries_in(free, [target, head]) // 2
    assert per_store == free // (t + h) and per_store * (t + h) <= free
    assert per_store > 0.92 * 1_000_000                                  # not half
