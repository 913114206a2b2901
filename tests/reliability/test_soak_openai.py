"""The OpenAI soak in CI size: load_tests/soak_openai.py for EXSPEC_SOAK_S seconds (default 45)
through exspec-openai, in a subprocess. Its own checks decide; RSS growth needs the full run and
is reported, not asserted, here. Needs Triton's OpenAI frontend (TRITON_OPENAI_FRONTEND,
EXSPEC_OPENAI_PYTHON: see tests/integration/test_openai_live.py), so CI skips it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DURATION_S = float(os.environ.get("EXSPEC_SOAK_S", "45"))
FRONTEND = os.environ.get("TRITON_OPENAI_FRONTEND")
FRONTEND_PYTHON = os.environ.get("EXSPEC_OPENAI_PYTHON")

pytestmark = pytest.mark.skipif(
    not (FRONTEND and FRONTEND_PYTHON),
    reason="set TRITON_OPENAI_FRONTEND and EXSPEC_OPENAI_PYTHON to run Triton's OpenAI frontend")


def test_short_openai_soak_cancels_disconnects_and_returns_to_idle(tmp_path):
    prefix = tmp_path / "openai"
    done = subprocess.run([sys.executable, str(REPO / "load_tests" / "soak_openai.py"),
                           "--frontend", FRONTEND, "--python", FRONTEND_PYTHON, "--duration",
                           str(DURATION_S), "--clients", "4", "--out", str(prefix)],
                          capture_output=True, text=True, timeout=DURATION_S + 600)
    log = f"{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    report_path = Path(f"{prefix}_soak.json")
    assert report_path.exists(), f"the soak ended (exit {done.returncode}) without a report:\n{log}"
    report = json.loads(report_path.read_text())
    failed = [c for c in report["checks"] if not c["ok"] and "RSS growth" not in c["check"]]
    assert not failed, f"soak checks failed: {failed}\n{log}"
