"""Short streams beside long prompts: ITL and TTFT of short streaming requests while requests
with long prompts (>= 1,000 tokens) arrive, for several server arms, interleaved A B A B.

    python load_tests/chunking.py --arm chunked=256 --arm whole=null [--arm NAME=VALUE@BACKEND]
        [--repeats 3] [--run-time 60] [--short-users 4] [--long-users 1] [--long-tokens 1200]
        [--long-every 2] [--max-tokens 32] [--torch-threads 1] [--pair demo|smollm2]
        [--out runs/chunking/run]

Each arm is NAME=VALUE[@BACKEND]: VALUE is model.json's max_num_batched_tokens (an integer, or
null: whole prompts in one forward, or absent: the key left out, for a checkout that predates
it); BACKEND serves the backend/ folder of another checkout (e.g. an older checkout, for TTFT
before the first token went out ahead of the step). Per arm and repeat: a fresh tritonserver on
a copy of --model-repository with that model.json (prefix caching off: the long prompt
repeats), then locust, headless: --short-users gRPC
users of load_tests/locustfile.py (demo prompts, --max-tokens, greedy) and --long-users users
that send a --long-tokens prompt every --long-every seconds (8 output tokens). --pair smollm2
serves the real pair (SmolLM2-135M-Instruct and its draft; set up once by exspec.models.real_pair)
instead of --model-repository, where a 1,000-token prompt takes seconds to prefill. Prints one row per
run and per arm the medians over repeats of: short ITL p50/p95/p99, short TTFT p50/p95, long TTFT
p50, requests and failures; writes them to <out>_chunking.json. Locust's percentiles are its
own (rounded above 100 ms). This file is both the driver and the locustfile (like soak.py).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LONG_OUTPUT_TOKENS = 8


# ---------------------------------------------------------------------------------------------
# The driver (python load_tests/chunking.py)
# ---------------------------------------------------------------------------------------------
def parse_arm(text: str) -> dict:
    name, sep, rest = text.partition("=")
    value, _, backend = rest.partition("@")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"--arm wants NAME=VALUE[@BACKEND], got {text!r}")
    if value not in ("null", "absent") and not value.isdigit():
        raise argparse.ArgumentTypeError(f"--arm {name}: VALUE is an integer, null or absent")
    return {"name": name, "value": value, "backend": backend or None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="load_tests/chunking.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", type=parse_arm, action="append", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--run-time", type=int, default=60, help="seconds of load per run")
    p.add_argument("--short-users", type=int, default=4)
    p.add_argument("--long-users", type=int, default=1)
    p.add_argument("--long-tokens", type=int, default=1200, help="tokens of each long prompt (>= 1000)")
    p.add_argument("--long-every", type=float, default=2.0, help="seconds between a long user's requests")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens of a short request")
    p.add_argument("--torch-threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--model-repository", default=str(REPO / "model_repository"))
    p.add_argument("--pair", choices=("demo", "smollm2"), default="demo",
                   help="smollm2: a repository serving the real pair instead of --model-repository")
    p.add_argument("--out", default="runs/chunking/run")
    args = p.parse_args(argv)
    if args.long_tokens < 1000:
        p.error("--long-tokens must be >= 1000")
    return args


def long_prompt(repository: Path, tokens: int) -> str:
    """Demo prompts joined until the served tokenizer counts at least `tokens` tokens."""
    from transformers import AutoTokenizer
    sys.path.insert(0, str(REPO / "client"))
    from exspec_client.prompts import load_prompts
    model = repository / "exspec" / "1"
    config = json.loads((model / "model.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model / config.get("tokenizer", config["target_model"]))
    demo = REPO / "model_repository" / "exspec" / "1" / "demo"
    prompts, text = itertools.cycle(load_prompts(str(demo / "prompts.jsonl"))), ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += next(prompts) + "\n"
    return text


def arm_repository(args, arm: dict, folder: Path) -> Path:
    repo = folder / "model_repository"
    shutil.copytree(args.model_repository, repo, symlinks=True)
    path = repo / "exspec" / "1" / "model.json"
    config = json.loads(path.read_text())
    config.pop("max_num_batched_tokens", None)
    if arm["value"] != "absent":
        config["max_num_batched_tokens"] = None if arm["value"] == "null" else int(arm["value"])
        # the long prompt repeats: a prefix cache would skip its prefill and hide the policy
        config["enable_prefix_caching"] = False
    config["torch_threads"] = args.torch_threads
    path.write_text(json.dumps(config, indent=2))
    return repo


def percentiles(prefix: str) -> dict:
    """From locust's <prefix>_stats.csv: p50/p95 (ms) and counts per (type, name)."""
    out = {}
    with open(f"{prefix}_stats.csv") as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated":
                continue
            out[f"{row['Type']}:{row['Name']}"] = {
                "p50": float(row["50%"]), "p95": float(row["95%"]), "p99": float(row["99%"]),
                "count": int(row["Request Count"]), "failures": int(row["Failure Count"])}
    return out


def one_run(args, arm: dict, repeat: int, prompt_file: Path) -> dict:
    sys.path.insert(0, str(REPO / "backend"))
    from exspec.serving.launcher import TritonServer
    prefix = f"{args.out}_{arm['name']}_{repeat}"
    with tempfile.TemporaryDirectory(prefix="exspec-chunking-") as tmp:
        repo = arm_repository(args, arm, Path(tmp))
        server = TritonServer(repo, free_ports=True, startup_timeout_s=600,
                              log_path=f"{prefix}_tritonserver.log", backend_source=arm["backend"])
        with server:
            users = args.short_users + args.long_users
            env = dict(os.environ, EXSPEC_CHUNKING_SHORT_USERS=str(args.short_users),
                       EXSPEC_CHUNKING_LONG_USERS=str(args.long_users),
                       EXSPEC_CHUNKING_LONG_PROMPT=str(prompt_file),
                       EXSPEC_CHUNKING_LONG_EVERY=str(args.long_every))
            cmd = [sys.executable, "-m", "locust", "-f", str(Path(__file__).resolve()),
                   "--headless", "-u", str(users), "-r", str(users), "-t", f"{args.run_time}s",
                   "-s", "120", "--host", server.urls["http"], "--grpc-url", server.urls["grpc"],
                   "--max-tokens", str(args.max_tokens), "--csv", prefix, "--only-summary",
                   "--loglevel", "WARNING", "ShortUser", "LongPromptUser"]
            subprocess.run(cmd, env=env, check=False)
    stats = percentiles(prefix)
    get = lambda key, field: stats.get(key, {}).get(field)   # noqa: E731
    return {"arm": arm["name"], "repeat": repeat,
            "short_itl_p50_ms": get("grpc:itl", "p50"), "short_itl_p95_ms": get("grpc:itl", "p95"),
            "short_itl_p99_ms": get("grpc:itl", "p99"),
            "short_ttft_p50_ms": get("grpc:ttft", "p50"), "short_ttft_p95_ms": get("grpc:ttft", "p95"),
            "long_ttft_p50_ms": get("long:ttft", "p50"),
            "short_requests": get("grpc:generate_stream", "count"),
            "long_requests": get("long:generate_stream", "count"),
            "failures": sum(v["failures"] for v in stats.values())}


COLUMNS = ("short_itl_p50_ms", "short_itl_p95_ms", "short_itl_p99_ms", "short_ttft_p50_ms", "short_ttft_p95_ms",
           "long_ttft_p50_ms", "short_requests", "long_requests", "failures")


def table(rows: list[dict], key: str) -> str:
    lines = [" | ".join([key] + [c.replace("_ms", " ms") for c in COLUMNS]),
             " | ".join(["---"] * (len(COLUMNS) + 1))]
    for row in rows:
        lines.append(" | ".join([str(row[key])] + [
            "-" if row[c] is None else f"{row[c]:.0f}" for c in COLUMNS]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompt_file = out.parent / f"{out.name}_long_prompt.txt"
    if args.pair == "smollm2":   # model.json names the cached pair by absolute paths
        sys.path.insert(0, str(REPO / "backend"))
        from exspec.demo.server import _repository
        from exspec.models.real_pair import ensure_pair
        work = Path(tempfile.mkdtemp(prefix="exspec-chunking-pair-"))   # copied per run; small
        args.model_repository = str(_repository(work, ensure_pair(), k=4))
        import atexit
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    prompt_file.write_text(long_prompt(Path(args.model_repository), args.long_tokens))
    print(f"torch threads in the server: {args.torch_threads}; long prompt: {prompt_file}", flush=True)
    runs = []
    for repeat in range(args.repeats):   # interleaved: A B A B ...
        for arm in args.arm:
            runs.append(one_run(args, arm, repeat, prompt_file))
            print(table(runs[-1:], "arm"), flush=True)
    medians = []
    for arm in args.arm:
        mine = [r for r in runs if r["arm"] == arm["name"]]
        medians.append({"arm": arm["name"], **{
            c: (statistics.median(v) if (v := [r[c] for r in mine if r[c] is not None]) else None)
            for c in COLUMNS}})
    print("\nruns:\n" + table(runs, "arm") + "\n\nmedians over repeats:\n" + table(medians, "arm"))
    Path(f"{args.out}_chunking.json").write_text(json.dumps(
        {"command": " ".join([sys.executable] + sys.argv), "torch_threads": args.torch_threads,
         "arms": args.arm, "runs": runs, "medians": medians}, indent=2))
    return 1 if any(r["failures"] for r in runs) else 0


# ---------------------------------------------------------------------------------------------
# The locust users (locust imports this file; the short users are load_tests/locustfile.py's)
# ---------------------------------------------------------------------------------------------
def _define_users():
    sys.path.insert(0, str(HERE))
    from locust import constant, task

    from locustfile import GrpcStreamUser   # its options and listeners come along

    class ShortUser(GrpcStreamUser):
        fixed_count = int(os.environ.get("EXSPEC_CHUNKING_SHORT_USERS", 4))

    class LongPromptUser(GrpcStreamUser):
        """A long prompt every EXSPEC_CHUNKING_LONG_EVERY seconds; its entries are type "long"."""
        fixed_count = int(os.environ.get("EXSPEC_CHUNKING_LONG_USERS", 1))
        wait_time = constant(float(os.environ.get("EXSPEC_CHUNKING_LONG_EVERY", 2.0)))

        @task
        def generate(self):
            prompt = Path(os.environ["EXSPEC_CHUNKING_LONG_PROMPT"]).read_text()
            fire = self.environment.events.request.fire
            start = time.time()
            try:
                with self.exspec_client.stream(prompt, max_tokens=LONG_OUTPUT_TOKENS,
                                               ignore_eos=True) as generation:
                    for _ in generation:
                        pass
                    result = generation.result
            except Exception as exc:
                fire(request_type="long", name="generate_stream", exception=exc, context={},
                     response_time=(time.time() - start) * 1000, response_length=0)
                return
            fire(request_type="long", name="generate_stream", exception=None, context={},
                 response_time=result.latency_s * 1000, response_length=result.num_output_tokens)
            if result.ttft_s is not None:
                fire(request_type="long", name="ttft", response_time=result.ttft_s * 1000,
                     response_length=0, exception=None, context={})

    ShortUser.__module__ = LongPromptUser.__module__ = __name__
    return ShortUser, LongPromptUser


if __name__ == "__main__":
    sys.exit(main())
else:
    ShortUser, LongPromptUser = _define_users()
