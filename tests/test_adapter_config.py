"""The adapter's load-time reading of model.json (backend/exspec_config.py), without Triton."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

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


def test_record_traffic_is_off_unless_given_and_is_not_an_engine_argument(tmp_path):
    """model.json's record_traffic is the adapter's key: parsed here (a relative path from the
    version folder, max_bytes defaulting), and left out of the engine's config, which would
    refuse it as unknown."""
    assert exspec_config.traffic_recording(args_for(tmp_path, {"model": "m"})) is None
    settings = exspec_config.traffic_recording(args_for(tmp_path, {
        "model": "m", "record_traffic": {"path": "logs/served.jsonl"}}))
    assert settings.path == str(tmp_path / "1" / "logs" / "served.jsonl")
    assert settings.max_bytes == exspec_config.DEFAULT_MAX_BYTES
    settings = exspec_config.traffic_recording(args_for(tmp_path, {
        "model": "m", "record_traffic": {"path": "/tmp/x.jsonl", "max_bytes": 1000}}))
    assert (settings.path, settings.max_bytes) == ("/tmp/x.jsonl", 1000)
    args = args_for(tmp_path, {"target_model": "m", "method": "autoregressive",
                               "record_traffic": {"path": "x.jsonl"}})
    assert exspec_config.engine_config(args).target_model == "m"


@pytest.mark.parametrize("value,words", [
    ("served.jsonl", "record_traffic must be an object"),
    ({"max_bytes": 10}, "record_traffic.path must name the JSONL file"),
    ({"path": "x", "max_bytes": 0}, "record_traffic.max_bytes must be a whole number of bytes >= 1"),
    ({"path": "x", "max_bytes": "1MB"}, "record_traffic.max_bytes must be"),
    ({"path": "x", "rotate": True}, "record_traffic takes path and max_bytes, not rotate"),
])
def test_a_bad_record_traffic_fails_the_load_naming_it(tmp_path, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        exspec_config.traffic_recording(args_for(tmp_path, {"model": "m", "record_traffic": value}))
