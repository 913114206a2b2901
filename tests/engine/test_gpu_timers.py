"""On a GPU the phase timers use CUDA events: a tick never calls torch.cuda.synchronize
(each call would stall the device and cost a host round trip), and the phases still add up."""
from __future__ import annotations

import pytest
import torch

from exspec import SamplingParams

from enginekit import make_engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_tick_never_synchronises_the_device_and_phases_are_timed(pairs, monkeypatch):
    engine = make_engine(pairs, method="exspec", adaptive_k=True, device="cuda")
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))   # warm-up
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real(*a, **k)))
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=16))
    assert calls == [], f"{len(calls)} torch.cuda.synchronize calls during generate"
    stats = engine.stats()
    for phase in ("step", "draft", "verify", "prefill"):
        assert stats[f"time_{phase}_s"] > 0, f"{phase} was not timed: {stats}"
    assert stats["time_draft_s"] + stats["time_verify_s"] <= stats["time_step_s"] * 1.05
