"""torch's CPU thread count is chosen by one rule for the server and the benchmark
(exspec.utils.threads): model.json torch_threads, else OMP_NUM_THREADS, else one thread."""
from __future__ import annotations

import pytest
import torch

from exspec import EngineConfig
from exspec.utils.threads import DEFAULT_THREADS, apply_threads, choose_threads

from enginekit import make_engine


def test_an_explicit_setting_wins_over_the_environment():
    choice = choose_threads(3, environ={"OMP_NUM_THREADS": "2"})
    assert (choice.intra_op, choice.source) == (3, "torch_threads")


def test_omp_num_threads_is_honoured_when_nothing_is_set():
    choice = choose_threads(None, environ={"OMP_NUM_THREADS": "2"})
    assert (choice.intra_op, choice.source) == (2, "OMP_NUM_THREADS")


@pytest.mark.parametrize("omp", ["", "0", "two", " "])
def test_the_default_is_one_thread_without_a_usable_setting(omp):
    choice = choose_threads(None, environ={"OMP_NUM_THREADS": omp})
    assert (choice.intra_op, choice.source) == (DEFAULT_THREADS, "default") == (1, "default")


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_engine_config_refuses_a_thread_count_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match="torch_threads"):
        EngineConfig(target_model="t", draft_model="d", torch_threads=bad)


def test_the_engine_applies_its_choice_to_torch(pairs, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        engine = make_engine(pairs, torch_threads=2)
        assert torch.get_num_threads() == 2
        assert engine.threads.describe() == "2 torch threads (torch_threads)"
        engine = make_engine(pairs)     # nothing set: back to the default
        assert torch.get_num_threads() == 1
        assert engine.threads.describe() == "1 torch thread (default)"
    finally:
        apply_threads(choose_threads(1))   # the suite runs on one thread (tests/conftest.py)
