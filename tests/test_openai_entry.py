"""exspec-openai (exspec.serving.openai_frontend), offline: the command it builds for Triton's
OpenAI frontend. The frontend itself needs Triton's in-process bindings and is run by hand (docs/serving.md,
"Triton's OpenAI frontend"); tests/integration/test_openai_frontend.py holds our side of its
requests."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
from exspec.serving import openai_frontend  # noqa: E402


def test_chat_tokenizer_is_the_one_model_json_names_resolved_like_the_engine(tmp_path):
    shipped = openai_frontend.model_tokenizer(REPO / "model_repository", "exspec")
    assert shipped == str((REPO / "model_repository/exspec/1/demo/tokenizer").resolve())
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.json").write_text(json.dumps(
        {"target_model": "Qwen/Qwen2.5-7B-Instruct", "draft_model": "Qwen/Qwen2.5-0.5B-Instruct"}))
    assert openai_frontend.model_tokenizer(tmp_path, "m") == "Qwen/Qwen2.5-7B-Instruct"
    assert openai_frontend.model_tokenizer(tmp_path, "absent") is None


def test_frontend_command_serves_exspec_as_a_vllm_model(tmp_path):
    (tmp_path / "openai_frontend").mkdir()
    (tmp_path / "openai_frontend" / "main.py").write_text("")
    args, extra = openai_frontend.parse_args([
        "--model-repository", str(REPO / "model_repository"), "--frontend",
        str(tmp_path / "openai_frontend"), "--openai-port", "9100", "--",
        "--enable-kserve-frontends"])
    cmd = openai_frontend.frontend_command(args, extra, tmp_path / "backends")
    assert cmd[1:3] == ["-c", openai_frontend.BOOTSTRAP]
    assert cmd[3:5] == [str(tmp_path / "openai_frontend"), str(tmp_path / "backends")]
    flags = cmd[5:]
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--backend"] == "vllm", "exspec speaks the vLLM backend's tensors"
    assert pairs["--openai-port"] == "9100"
    assert pairs["--tokenizer"].endswith("model_repository/exspec/1/demo/tokenizer")
    assert flags[-1] == "--enable-kserve-frontends", "arguments after -- go to the frontend"


def test_a_missing_frontend_is_named_with_the_flag_that_fixes_it(tmp_path):
    args, extra = openai_frontend.parse_args([
        "--model-repository", str(REPO / "model_repository"), "--frontend", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--frontend"):
        openai_frontend.frontend_command(args, extra, tmp_path / "backends")
