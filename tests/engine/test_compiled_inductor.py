"""The compiled decode path with the real compiler: inductor (C++ kernels on a CPU; g++ must be
installed), where tests/engine/test_compiled.py uses Dynamo's "eager" backend for speed. Dynamo
decides recompiles, but inductor adds guards of its own (on the sizes its kernels specialise
for), so only this run shows that nothing compiles after the warm-up with the backend that is
served."""
import logging

import pytest
import torch
import torch._dynamo.utils

from exspec.models import compiled, packed_linears

from enginekit import make_engine, run_schedule
from test_compiled import NEW_SHAPE, assert_no_ties, ragged_schedule


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()   # each engine's models are new: start from an empty code cache
    yield
    torch._dynamo.reset()


@pytest.mark.slow   # a cold inductor warm-up of the pair's 4 graphs: 130-170 s on a shared 2-core machine
def test_inductor_path_recompiles_nothing_after_warm_up_and_matches_target_greedy(
        pairs, reference, caplog):
    """A ragged schedule after an inductor warm-up (arrivals over 16 ticks, aborts, rows
    leaving, 1 to 4 rows per step, adaptive k moving down to plain steps and back, per-request k
    caps): Dynamo's counters do not move, nothing is logged as a new shape, and every token is
    the target-only greedy one."""
    assert compiled.COMPILE_BACKEND == "inductor"
    engine = make_engine(pairs, "llama", "independent", method="exspec", max_batch_size=4,
                         max_num_seqs=6, adaptive_k=True, draft_stop_confidence=0,
                         num_speculative_tokens=3, enforce_eager=False)
    # inductor built the warm-up's graphs: its FX graph cache was asked for each one
    inductor = torch._dynamo.utils.counters["inductor"]
    assert inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"] >= engine.warm_up.graphs > 0
    assert engine.warm_up.graph_breaks == 0, engine.warm_up.describe()
    prompts, params, outputs, finished = run_compiling_nothing(engine, pairs, caplog, seed=3, count=10,
                                                               last_tick=16, max_tokens=16)
    shapes = engine.stats()["steps_by_shape"]
    assert len({s["k"] for s in shapes}) >= 2 and len({s["rows"] for s in shapes}) >= 3, shapes
    assert_target_greedy(pairs, reference, prompts, params, outputs, finished)


def run_compiling_nothing(engine, pairs, caplog, **schedule):
    """A ragged schedule (ragged_schedule's, one request in four aborted) on a warm engine,
    asserting that nothing compiles and no new shape is logged; returns what it ran and got."""
    before = compiled.dynamo_counts()
    prompts, arrivals, aborts, params = ragged_schedule(pairs["llama", "eos"], aborted=1, **schedule)
    with caplog.at_level(logging.WARNING, logger="exspec"):
        outputs, finished, _ = run_schedule(engine, arrivals, aborts, params)
    assert compiled.dynamo_counts() == before, f"after warm-up: {before} -> {compiled.dynamo_counts()}"
    assert not [r.getMessage() for r in caplog.records if NEW_SHAPE in r.getMessage()]
    return prompts, params, outputs, finished


def assert_target_greedy(pairs, reference, prompts, params, outputs, finished) -> None:
    """Every request's tokens are the target-only greedy ones (an aborted one's, a prefix)."""
    refs = {f"r{i}": reference(pairs["llama", "target"], p, params[f"r{i}"].max_tokens)
            for i, p in enumerate(prompts)}
    assert_no_ties(pairs["llama", "target"], prompts, list(refs.values()))
    for rid, ref in refs.items():
        tokens = [t for out in outputs[rid] for t in out.new_token_ids]
        expected = ref if finished[rid].finish_reason != "abort" else ref[:len(tokens)]
        assert tokens == expected, f"{rid}: got {tokens}, expected {expected}"


def test_a_restart_reuses_the_compile_cache_and_the_warm_up_says_so(pairs, tmp_path, monkeypatch, caplog):
    """Two starts on one compile cache folder (a restart: Dynamo's in-memory state reset between
    them): the first builds every inductor graph, the second builds none and reuses them all,
    and each warm-up ends with a line saying so (and where the cache is). The layers' linears go
    through packed_linears' op (its bar lowered for the tiny pair): an ordinary node of the graph,
    which the cache keeps (inductor's freezing, which packs weights as constants, it does not)."""
    monkeypatch.setattr(packed_linears, "PACK_FROM_ELEMENTS", 0)
    monkeypatch.setattr(packed_linears, "MIN_SAMPLES", 10 ** 9)   # kept whatever the timing
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    summaries = []
    for start in ("cold", "warm"):
        torch._dynamo.reset()
        with caplog.at_level(logging.INFO, logger="exspec"):
            caplog.clear()
            engine = make_engine(pairs, "llama", "noisy", method="autoregressive", max_batch_size=2,
                                 enforce_eager=False)
        warm = engine.warm_up
        assert engine.runner.decode_forwards[engine.target].packed_linears.count > 0
        summaries.append(warm.inductor)
        lines = [r.getMessage() for r in caplog.records if "compiled decode path ready" in r.getMessage()]
        assert lines == [warm.summary()], lines
        assert f"compiled {warm.graphs} graphs" in lines[0] and str(tmp_path / "cache") in lines[0]
        assert any("warm-up: 2 row(s) done" in r.getMessage() for r in caplog.records)
    (cold, warm) = summaries
    assert cold["built"] > 0 and cold["reused"] == 0, summaries
    assert warm["built"] == 0 and warm["reused"] == cold["built"], summaries


def test_the_compile_cache_lives_in_exspecs_cache_folder_unless_one_is_given(tmp_path, monkeypatch):
    """Inductor's default cache folder is under /tmp (lost with a container); exspec's is
    $XDG_CACHE_HOME/exspec/torch_compile. Torch writes its default into TORCHINDUCTOR_CACHE_DIR
    the first time it looks the folder up, so that value counts as unset; any other is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = str(tmp_path / "exspec" / "torch_compile")
    for given in (None, default_cache_dir()):
        if given is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", given)
        assert compiled.compile_cache_dir() == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.compile_cache_dir() == str(tmp_path / "mine")
