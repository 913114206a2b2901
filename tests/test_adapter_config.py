"""The adapter's load-time reading of model.json (backend/exspec_config.py), without Triton."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
import exspec_config  # noqa: E402


def args_for(tmp_path, values: dict) -> dict:
    (tmp_path / "1").mkdir(exist_ok=True)
    (tmp_path / "1" / "model.json").write_text(json.dumps(values))
    return {"model_repository": str(tmp_path), "model_version": "1"}


def test_vllms_disable_log_stats_turns_the_vllm_metric_families_off(tmp_path):
    assert exspec_config.vllm_stats_disabled(args_for(tmp_path, {"model": "m", "disable_log_stats": True}))
    assert not exspec_config.vllm_stats_disabled(args_for(tmp_path, {"model": "m", "disable_log_stats": False}))
    assert not exspec_config.vllm_stats_disabled(args_for(tmp_path, {"target_model": "m"}))
