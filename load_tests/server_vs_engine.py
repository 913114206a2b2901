"""The cost of serving through Triton, measured: the shipped model served by a real
tritonserver and driven by an outside locust client on the same machine (load_tests/run.py,
gRPC streams, 64 tokens), against the same engine alone in this process under the same closed
loop (engine_baseline.py), at each concurrency; cells interleaved (server, engine, engine,
server, ...), medians, with the client's own CPU share beside the server's rate.

GRANULARITIES (default: the shipped model.json's) serves the model once per
`stream_granularity` from one server: "token" sends a response per token, "step" one per
engine step (a step commits up to k + 1 tokens per row), which shows what per-token responses
cost the stub, tritonserver and the client.

    python load_tests/server_vs_engine.py [CONCURRENCY=1,4,8] [SECONDS=30] [REPEATS=3] [GRANULARITIES]
"""
from __future__ import annotations

import json
import shutil
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


def shipped_granularity(model_json: dict) -> str:
    from exspec import EngineConfig
    return model_json.get("stream_granularity",
                          EngineConfig.__dataclass_fields__["stream_granularity"].default)


def repository_with(granularities: list[str], root: Path) -> tuple[Path, dict[str, str]]:
    """The shipped repository, plus a copy of the exspec model per extra granularity (its
    paths made absolute); {granularity: model name}."""
    repository = root / "repository"
    shutil.copytree(REPO / "model_repository", repository, symlinks=True)
    folder = repository / "exspec/1"
    shipped = json.loads((folder / "model.json").read_text())
    names = {}
    for granularity in granularities:
        if granularity == shipped_granularity(shipped):
            names[granularity] = "exspec"
            continue
        name = names[granularity] = f"exspec_{granularity}"
        shutil.copytree(repository / "exspec", repository / name, symlinks=True)
        values = dict(shipped, stream_granularity=granularity)
        for key in ("target_model", "draft_model", "tokenizer"):
            if isinstance(values.get(key), str) and (folder / values[key]).exists():
                values[key] = str((folder / values[key]).resolve())
        (repository / name / "1/model.json").write_text(json.dumps(values, indent=2))
    return repository, names


def main(argv: list[str]) -> int:
    from exspec import SamplingParams
    concurrencies = [int(c) for c in (argv[0] if argv else "1,4,8").split(",")]
    seconds = int(argv[1]) if len(argv) > 1 else 30
    repeats = int(argv[2]) if len(argv) > 2 else 3
    root = Path(tempfile.mkdtemp(prefix="exspec-server-vs-engine-"))
    shipped = json.loads((REPO / "model_repository/exspec/1/model.json").read_text())
    granularities = argv[3].split(",") if len(argv) > 3 else [shipped_granularity(shipped)]
    repository, names = repository_with(granularities, root)
    engine, _ = engine_from_repository(repository, "exspec")
    prompts = load_prompts(repository / "exspec/1/demo/prompts.jsonl")
    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))   # warm up
    server_runs: dict[tuple[int, str], list] = {}
    engine_runs: dict[int, list] = {}
    sides = ["engine", *granularities]
    with TritonServer(repository, free_ports=True, startup_timeout_s=600, log_path=root / "log") as server:
        for c in concurrencies:
            for rep in range(repeats):
                for side in (sides if rep % 2 else sides[::-1]):
                    if side == "engine":
                        rate = closed_loop(engine, prompts, params, c, seconds)["output_tokens_per_s"]
                        engine_runs.setdefault(c, []).append(rate)
                        print(f"c={c} run {rep}: engine alone {rate:.0f} tokens/s", flush=True)
                    else:
                        rate, client_cpu = run_cell(server, names[side], c, seconds, root / f"c{c}_{side}_r{rep}")
                        server_runs.setdefault((c, side), []).append((rate, client_cpu))
                        print(f"c={c} run {rep}: server ({side}) {rate:.0f} tokens/s, client "
                              f"{client_cpu:.2f} cores", flush=True)
    print("\n| concurrency | responses | through tritonserver, outside client (tokens/s, runs) "
          "| engine alone (tokens/s, runs) | server ÷ engine | client CPU (cores) |")
    print("|---|---|---|---|---|---|")
    for c in concurrencies:
        alone = engine_runs[c]
        for side in granularities:
            served = [r for r, _ in server_runs[c, side]]
            print(f"| {c} | per {side} | {statistics.median(served):.0f} ({', '.join(f'{x:.0f}' for x in served)}) "
                  f"| {statistics.median(alone):.0f} ({', '.join(f'{x:.0f}' for x in alone)}) "
                  f"| {statistics.median(served) / statistics.median(alone):.2f} "
                  f"| {statistics.median(cpu for _, cpu in server_runs[c, side]):.2f} |")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
