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


def _frontend(tmp_path) -> str:
    (tmp_path / "openai_frontend").mkdir(exist_ok=True)
    (tmp_path / "openai_frontend" / "main.py").write_text("")
    return str(tmp_path / "openai_frontend")


def _command(tmp_path, *argv: str) -> list[str]:
    args, extra = openai_frontend.parse_args([
        "--model-repository", str(REPO / "model_repository"), "--frontend", _frontend(tmp_path),
        *argv])
    backends = openai_frontend.Backends(tmp_path / "backends", tmp_path)
    return openai_frontend.frontend_command(args, extra, backends)


def _flags(cmd: list[str]) -> dict[str, str]:
    flags = cmd[5:]
    return dict(zip(flags[::2], flags[1::2]))


def test_frontend_command_serves_exspec_as_a_vllm_model(tmp_path):
    cmd = _command(tmp_path, "--openai-port", "9100", "--", "--default-max-tokens", "32")
    assert cmd[1] == str(openai_frontend.BOOTSTRAP) and Path(cmd[1]).is_file()
    assert cmd[2:5] == [str(tmp_path / "openai_frontend"), str(tmp_path / "backends"),
                        str(tmp_path)], "frontend, backend folder, folder removed at exit"
    pairs = _flags(cmd)
    assert pairs["--backend"] == "vllm", "exspec speaks the vLLM backend's tensors"
    assert pairs["--openai-port"] == "9100"
    assert pairs["--tokenizer"].endswith("model_repository/exspec/1/demo/tokenizer")
    assert cmd[-2:] == ["--default-max-tokens", "32"], "arguments after -- go to the frontend"


def test_the_frontend_listens_on_loopback_unless_told(tmp_path):
    assert _flags(_command(tmp_path))["--host"] == "127.0.0.1"
    assert _flags(_command(tmp_path, "--host", "0.0.0.0"))["--host"] == "0.0.0.0"
    with pytest.raises(SystemExit):
        openai_frontend.parse_args(["--model-repository", "m", "--host", "localhost:9"])


def test_open_kserve_ports_beyond_loopback_need_an_explicit_flag(tmp_path):
    """The frontend's KServe ports cannot be restricted (tritonfrontend takes no restriction
    flags), so opening them on a network is refused unless the operator says so."""
    assert _command(tmp_path, "--", "--enable-kserve-frontends")[-1] == "--enable-kserve-frontends"
    with pytest.raises(ValueError, match="--unrestricted-kserve"):
        _command(tmp_path, "--host", "0.0.0.0", "--", "--enable-kserve-frontends")
    cmd = _command(tmp_path, "--host", "0.0.0.0", "--unrestricted-kserve", "--",
                   "--enable-kserve-frontends")
    assert cmd[-1] == "--enable-kserve-frontends"


def test_a_refused_start_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(openai_frontend.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rc = openai_frontend.main(["--model-repository", str(REPO / "model_repository"),
                               "--frontend", _frontend(tmp_path), "--host", "0.0.0.0", "--",
                               "--enable-kserve-frontends"])
    assert rc == 1 and "--unrestricted-kserve" in capsys.readouterr().err
    assert not list((tmp_path / "tmp").iterdir())


def test_a_missing_frontend_is_named_with_the_flag_that_fixes_it(tmp_path):
    args, extra = openai_frontend.parse_args([
        "--model-repository", str(REPO / "model_repository"), "--frontend", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--frontend"):
        openai_frontend.frontend_command(args, extra, openai_frontend.Backends(tmp_path, None))


def test_the_printed_command_hides_the_restricted_api_key_and_a_failed_start_cleans_up(
        tmp_path, monkeypatch, capsys):
    """The command goes to stdout (container logs): the restricted API's key stays out of it;
    an exec that fails removes the temporary backend folder and says why."""
    temporary = tmp_path / "exspec-openai-tmp"
    (temporary / "backends").mkdir(parents=True)
    monkeypatch.setattr(openai_frontend, "backend_folder",
                        lambda work_dir, source: openai_frontend.Backends(temporary / "backends", temporary))
    monkeypatch.setattr(openai_frontend, "find_tritonserver", lambda: None)
    monkeypatch.setattr(openai_frontend, "stub_environment", lambda dist=None: {})

    def failing_exec(path, argv, env):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(openai_frontend.os, "execve", failing_exec)
    rc = openai_frontend.main(["--model-repository", str(REPO / "model_repository"),
                               "--frontend", _frontend(tmp_path), "--",
                               "--openai-restricted-api", "model-repository", "admin-key", "s3cret-key",
                               "--http-restricted-api=admin:key=s3cret-too"])
    out = capsys.readouterr()
    assert rc == 127 and "could not start the frontend" in out.err
    assert "s3cret" not in out.out + out.err
    assert "--openai-restricted-api model-repository admin-key '<redacted>'" in out.out
    assert not temporary.exists()


def test_the_stub_path_gets_no_empty_entry_when_path_is_unset():
    from exspec.serving.launcher import stub_environment
    path = stub_environment(base={})["PATH"]
    assert "" not in path.split(":") and path == str(Path(sys.executable).parent)
