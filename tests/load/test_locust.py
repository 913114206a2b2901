"""A short headless locust run (both users, several each, bounded in requests and seconds)
against the real server: every request completes, the server counts exactly those, and the pool
is empty afterwards."""
from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

# Never import locust here: it gevent-monkey-patches the whole pytest process (and with it
# every later test's grpc); the run happens in a subprocess.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
USERS, PER_USER, RUN_TIME_S = 3, 3, 120


def test_headless_locust_completes_every_request_and_the_server_counts_them(
        load_server, metrics, prompts_file, tmp_path):
    before = metrics.outcomes()
    prefix = tmp_path / "locust"
    done = subprocess.run(
        [sys.executable, str(REPO / "load_tests" / "run.py"), "--url", load_server.urls["http"],
         "--grpc-url", load_server.urls["grpc"], "--users", str(USERS),
         "--requests-per-user", str(PER_USER), "--run-time", str(RUN_TIME_S),
         "--max-tokens", "12", "--prompts-file", str(prompts_file), "--out", str(prefix), "--model", "exspec"],
        capture_output=True, text=True, timeout=RUN_TIME_S + 120)
    log = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"locust run failed:\n{log}"

    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    expected = USERS * PER_USER
    for protocol in ("grpc", "http"):
        row = rows.get((protocol, "generate_stream"))
        assert row is not None, f"no {protocol} requests in the CSV:\n{log}"
        assert int(row["Failure Count"]) == 0, f"{protocol} failures:\n{log}"
        assert int(row["Request Count"]) == expected, (
            f"{protocol}: {row['Request Count']} requests, expected {expected}")
        assert (protocol, "ttft") in rows and (protocol, "itl") in rows
    in_flight = json.loads(Path(f"{prefix}_exspec.json").read_text())["max_in_flight"]
    assert in_flight == {"grpc": USERS, "http": USERS}, (
        f"users did not overlap (gevent blocked?): most in flight {in_flight}")

    metrics.wait_pool_empty()
    after = metrics.outcomes()
    grown = {o: after[o] - before[o] for o in after}
    assert grown["stop"] + grown["length"] == 2 * expected, f"server counted {grown}"
    assert sum(grown.values()) == 2 * expected, f"unexpected outcomes: {grown}"


def test_an_unreachable_grpc_url_stops_the_run_at_start_with_a_clear_message(
        load_server, metrics, prompts_file, tmp_path):
    """The HTTP server answers but the gRPC address is wrong: the run must not start (no
    tight loop of failed requests), exit non-zero and say which address is unreachable."""
    from exspec.serving.ports import reserve_ports
    before = metrics.outcomes()
    with reserve_ports(1, host="127.0.0.1") as (closed,):   # reserved, so nothing listens
        done = subprocess.run(
            [sys.executable, str(REPO / "load_tests" / "run.py"), "--url", load_server.urls["http"],
             "--grpc-url", f"127.0.0.1:{closed}", "--users", "2", "--run-time", "30",
             "--max-tokens", "4", "--prompts-file", str(prompts_file), "--out", str(tmp_path / "l"),
             "--model", "exspec"],
            capture_output=True, text=True, timeout=90)
    log = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode != 0, f"the run started anyway:\n{log}"
    assert f"gRPC 127.0.0.1:{closed}" in log and "cannot reach the server" in log, log
    assert "HTTP" not in log.split("cannot reach the server")[1].split("(check")[0], log
    assert metrics.outcomes() == before, "requests reached the server"
