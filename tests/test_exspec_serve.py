"""exspec-serve as a user runs it (a subprocess on an empty model repository, ready at once).

It listens on loopback unless told otherwise: a server started with the defaults cannot be
reached through this machine's other IPv4 addresses, while one started with `--host 0.0.0.0`
can (the control that shows those addresses reach this machine at all). With tritonserver's
`--allow-metrics=false` passed through it starts without a metrics port."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
from exspec.serving import launcher  # noqa: E402

SIOCGIFADDR = 0x8915   # Linux ioctl: an interface's IPv4 address


def non_loopback_ipv4() -> str | None:
    """One IPv4 address of this machine outside 127.0.0.0/8, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:      # the interface has no IPv4 address
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("127."):
                return address
    return None


@pytest.fixture(scope="module")
def address() -> str:
    pytest.importorskip("pytriton")
    found = non_loopback_ipv4()
    if found is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    return found


@contextlib.contextmanager
def exspec_serve(tmp_path: Path, *flags: str):
    """exspec-serve on an empty model repository (Triton is ready at once), as a user runs it;
    yields the ready file's contents ({http, grpc, metrics, pid, log}). The process's output
    is in the `output` list once the block ends."""
    repo, ready = tmp_path / "models", tmp_path / "ready.json"
    repo.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "backend"),
                                                        os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "exspec.serving.launcher", "--model-repository", str(repo),
         "--free-ports", "--ready-file", str(ready), "--work-dir", str(tmp_path / "work"),
         "--quiet", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert process.poll() is None, f"exspec-serve exited:\n{process.stdout.read().decode()}"
            assert time.monotonic() < deadline, "exspec-serve not ready after 180 s"
            time.sleep(0.25)
        yield json.loads(ready.read_text())
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        OUTPUT[:] = [process.returncode, out.decode(errors="replace")]


OUTPUT: list = []    # [exit code, output] of the last exspec_serve process


def ports_of(urls: dict) -> dict:
    return {name: int(re.search(r":(\d+)", urls[name].split("//")[-1]).group(1))
            for name in ("http", "grpc", "metrics")}


def answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def test_exspec_serve_listens_on_loopback_only_by_default(tmp_path, address):
    with exspec_serve(tmp_path) as urls:
        for name, port in ports_of(urls).items():
            assert answers("127.0.0.1", port), f"{name} port {port} does not answer on loopback"
            assert not answers(address, port), f"{name} port {port} answers on {address}"


def test_host_flag_listens_on_every_interface(tmp_path, address):
    with exspec_serve(tmp_path, "--host", "0.0.0.0") as urls:
        for name, port in ports_of(urls).items():
            assert answers(address, port), f"--host 0.0.0.0: {name} port {port} refused on {address}"


def test_exspec_serve_starts_with_metrics_turned_off_and_waits_for_no_metrics_port(tmp_path):
    pytest.importorskip("pytriton")
    with exspec_serve(tmp_path, "--", "--allow-metrics=false") as urls:
        assert urls["metrics"] is None
        log = Path(urls["log"]).read_text()
        assert "Started Metrics Service" not in log, log[-2000:]
    code, out = OUTPUT
    assert code == 0, out
    assert "metrics off" in out, out


def test_host_flag_refuses_what_is_not_an_ipv4_address(capsys):
    with pytest.raises(SystemExit):
        launcher.parse_args(["--model-repository", "models", "--host", "localhost"])
    assert "'localhost' is not an IPv4 address" in capsys.readouterr().err


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a machine with an NVIDIA GPU")
def test_on_a_machine_without_a_gpu_triton_logs_no_pinned_nvml_or_dcgm_errors(tmp_path):
    """Triton's pinned memory pool and GPU metrics are turned off where there is no GPU, so its
    log carries none of their alarming errors, and exspec-serve says the one left is harmless."""
    with exspec_serve(tmp_path) as urls:
        log = Path(urls["log"]).read_text()
    for noise in ("Unable to allocate pinned system memory", "Failed to initialize NVML",
                  "DCGM unable to start"):
        assert noise not in log, f"{noise!r} in the log:\n{log[-3000:]}"
    code, out = OUTPUT
    assert "exspec-serve: ready" in out and "CudaDriverHelper" in out and "harmless" in out, out
