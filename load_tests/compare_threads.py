"""The threads default, measured: the demo pair served twice in one tritonserver (torch_threads
1 and 2, as two models), a locust client on the same machine (load_tests/run.py, gRPC streams,
64 tokens), cells interleaved, medians of output tokens/s and the client's CPU share.

    python load_tests/compare_threads.py [USERS=1,4] [SECONDS=20] [REPEATS=2]
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
from exspec.serving.launcher import TritonServer  # noqa: E402

THREADS = (1, 2)


def build_repository(root: Path) -> Path:
    """exspec_t1 and exspec_t2: the shipped demo model, torch_threads 1 and 2."""
    models = root / "models"
    for threads in THREADS:
        model = models / f"exspec_t{threads}"
        (model / "1").mkdir(parents=True)
        shutil.copy(REPO / "model_repository/exspec/config.pbtxt", model / "config.pbtxt")
        os.symlink(REPO / "model_repository/exspec/1/demo", model / "1/demo")
        config = json.loads((REPO / "model_repository/exspec/1/model.json").read_text())
        (model / "1/model.json").write_text(json.dumps({**config, "torch_threads": threads}))
    return models


def run_cell(server: TritonServer, model: str, users: int, seconds: int, out: Path):
    """(output tokens/s, the client's CPU cores) of one locust run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, str(REPO / "load_tests/run.py"), "--url", server.urls["http"],
                    "--grpc-url", server.urls["grpc"], "--protocols", "grpc", "--users", str(users),
                    "--run-time", str(seconds), "--model", model, "--max-tokens", "64",
                    "--out", str(out)], capture_output=True, text=True, check=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = json.loads(Path(f"{out}_summary.json").read_text())[0]
    return row["output_tokens_per_s"], cpu / wall


def main(argv: list[str]) -> int:
    users_list = [int(u) for u in (argv[0] if argv else "1,4").split(",")]
    seconds = int(argv[1]) if len(argv) > 1 else 20
    repeats = int(argv[2]) if len(argv) > 2 else 2
    root = Path(tempfile.mkdtemp(prefix="exspec-threads-"))
    results: dict[tuple[int, int], list] = {}
    with TritonServer(build_repository(root), free_ports=True, startup_timeout_s=600,
                      log_path=root / "log") as server:
        for users in users_list:
            for rep in range(repeats):
                for threads in (THREADS if rep % 2 == 0 else THREADS[::-1]):   # A B B A
                    cell = run_cell(server, f"exspec_t{threads}", users, seconds,
                                    root / f"u{users}_t{threads}_r{rep}")
                    results.setdefault((users, threads), []).append(cell)
                    print(f"users {users}, torch_threads {threads}, run {rep}: "
                          f"{cell[0]:.0f} tokens/s, client {cell[1]:.2f} cores", flush=True)
    print("\n| users | torch_threads | output tokens/s (median, runs) | client CPU (cores) |")
    print("|---|---|---|---|")
    for (users, threads), runs in sorted(results.items()):
        rates = [r[0] for r in runs]
        print(f"| {users} | {threads} | {statistics.median(rates):.0f} "
              f"({', '.join(f'{x:.0f}' for x in rates)}) | {statistics.median(r[1] for r in runs):.2f} |")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
