"""The client as a user installs it: a fresh venv of its own, no torch, one request each way."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(cmd, timeout=300, check=True):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd[0]} exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-2000:]}")
    return done


def test_client_installs_without_torch_and_talks_to_the_server(load_server, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    bin_ = venv / "bin"
    run([bin_ / "pip", "install", "-q", REPO / "client"], timeout=600)
    torch = run([bin_ / "pip", "show", "torch"], check=False)
    assert torch.returncode != 0, f"installing exspec-client pulled torch:\n{torch.stdout}"

    answers = {}
    for protocol in ("grpc", "http"):
        out = run([bin_ / "exspec-client", "def add(a, b):\n", "--url",
                   load_server.urls[protocol], "--protocol", protocol, "--model", "exspec",
                   "--max-tokens", "8",
                   "--json"], timeout=120)
        answers[protocol] = json.loads(out.stdout)
        assert answers[protocol]["num_output_tokens"] == 8, out.stdout
        assert answers[protocol]["finish_reason"] == "length"
    assert answers["grpc"]["token_ids"] == answers["http"]["token_ids"]
