"""exspec-serve (exspec.serving.launcher) with a real tritonserver on an empty model
repository (it starts in seconds): port clashes, the bounded retry, metrics turned off."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from exspec.serving import launcher  # noqa: E402
from exspec.serving.ports import PortReservation, ports_in_use, reserve_ports  # noqa: E402

pytest.importorskip("pytriton")


def test_launcher_chooses_again_when_a_chosen_port_is_taken(tmp_path, monkeypatch):
    """A real tritonserver: the first ports it is given include one that something else
    listens on (as if taken between the check and the bind); it starts on fresh ones."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    calls = []

    def reserve_with_a_taken_port(count, host="0.0.0.0"):
        calls.append(count)
        real = reserve_ports(count, host)
        if len(calls) == 1:
            return PortReservation([taken] + real.ports[1:], real._locks)
        return real

    monkeypatch.setattr(launcher, "reserve_ports", reserve_with_a_taken_port)
    repo = tmp_path / "models"
    repo.mkdir()
    server = launcher.TritonServer(repo, free_ports=True, startup_timeout_s=120,
                                   work_dir=tmp_path / "work")
    try:
        server.start()
        assert len(calls) == 2
        assert taken not in server.ports.values()
        assert "already in use" in Path(server.log_path).read_text()
    finally:
        server.stop()
        squatter.close()


def test_launcher_refuses_a_given_port_that_is_busy(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        repo = tmp_path / "models"
        repo.mkdir()
        server = launcher.TritonServer(repo, http_port=taken, grpc_port=taken + 1,
                                       metrics_port=taken + 2, work_dir=tmp_path / "work")
        with pytest.raises(launcher.PortInUse, match=str(taken)):
            server.start()
        assert server.process is None      # refused before anything started

