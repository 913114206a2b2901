"""Finished requests free their caches at once: nothing the engine builds per group may sit in
a reference cycle (the cyclic GC would free it late, and the engine does not run a full
collection: one costs ~0.2 s on a serving process)."""
from __future__ import annotations

import gc
from collections import Counter

import pytest

from exspec import SamplingParams

from enginekit import make_engine, make_prompts


@pytest.mark.parametrize("method", ["exspec", "eqspec", "autoregressive"])
def test_a_run_leaves_no_cyclic_garbage(pairs, method):
    engine = make_engine(pairs, method=method, num_speculative_tokens=4, max_batch_size=3,
                         max_num_seqs=6, adaptive_k=True)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=3, count=9)
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=5, temperature=0.9, seed=2),
              SamplingParams(max_tokens=9, stop=["a"])] * 3
    engine.generate(prompts, params)   # warm: lazily built module state is not garbage
    gc.collect()
    # Objects alive before the run are not its garbage: an earlier test's compiled model, freed
    # mid-run by its last reference going away elsewhere, leaves torch.compile's graph cycles
    # (seen in CI: fx Nodes, FakeTensors, CompileId). Live objects keep their ids, so the ids
    # tracked now exclude exactly them.
    before = {id(o) for o in gc.get_objects()}
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        engine.generate(prompts, params)
        gc.collect()
        garbage = Counter(type(o).__name__ for o in gc.garbage if id(o) not in before)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not garbage, f"{method}: objects freed only by the cyclic GC: {garbage.most_common(8)}"
    assert engine.pool.num_running == 0
