"""The cost of serving through Triton, measured (issue 13): the shipped model served by a real
tritonserver and driven by an outside locust client on the same machine (load_tests/run.py,
gRPC streams, 64 tokens), against the same engine alone in this process under the same closed
loop (engine_baseline.py), at each concurrency; cells interleaved (server, engine, engine,
server, ...), medians, with the client's own CPU share beside the server's rate.

    python load_tests/server_vs_engine.py [CONCURRENCY=1,4,8] [SECONDS=30] [REPEATS=3]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_threads import REPO, run_cell  # noqa: E402
from engine_baseline import closed_loop, engine_from_repository, load_prompts  # noqa: E402
from exspec.serving.launcher import TritonServer  # noqa: E402

MAX_TOKENS = 64


def main(argv: list[str]) -> int:
    from exspec import SamplingParams
    concurrencies = [int(c) for c in (argv[0] if argv else "1,4,8").split(",")]
    seconds = int(argv[1]) if len(argv) > 1 else 30
    repeats = int(argv[2]) if len(argv) > 2 else 3
    repository = REPO / "model_repository"
    root = Path(tempfile.mkdtemp(prefix="exspec-server-vs-engine-"))
    engine, _ = engine_from_repository(repository, "exspec")
    prompts = load_prompts(repository / "exspec/1/demo/prompts.jsonl")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))   # warm up
    server_runs: dict[int, list] = {}
    engine_runs: dict[int, list] = {}
    with TritonServer(repository, free_ports=True, startup_timeout_s=600, log_path=root / "log") as server:
        for c in concurrencies:
            for rep in range(repeats):
                for side in (("server", "engine") if rep % 2 == 0 else ("engine", "server")):
                    if side == "server":
                        rate, client_cpu = run_cell(server, "exspec", c, seconds, root / f"c{c}_r{rep}")
                        server_runs.setdefault(c, []).append((rate, client_cpu))
                        print(f"c={c} run {rep}: server {rate:.0f} tokens/s, client {client_cpu:.2f} cores",
                              flush=True)
                    else:
                        rate = closed_loop(engine, prompts, params, c, seconds)["output_tokens_per_s"]
                        engine_runs.setdefault(c, []).append(rate)
                        print(f"c={c} run {rep}: engine alone {rate:.0f} tokens/s", flush=True)
    print("\n| concurrency | through tritonserver, outside client (tokens/s, runs) "
          "| engine alone (tokens/s, runs) | server ÷ engine | client CPU (cores) |")
    print("|---|---|---|---|---|")
    for c in concurrencies:
        served = [r for r, _ in server_runs[c]]
        alone = engine_runs[c]
        print(f"| {c} | {statistics.median(served):.0f} ({', '.join(f'{x:.0f}' for x in served)}) "
              f"| {statistics.median(alone):.0f} ({', '.join(f'{x:.0f}' for x in alone)}) "
              f"| {statistics.median(served) / statistics.median(alone):.2f} "
              f"| {statistics.median(cpu for _, cpu in server_runs[c]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
