"""Prefix caching on vs off through a real tritonserver, on the real pair's chat workloads.

    python load_tests/prefix_cache.py [--repeats 2] [--users 4] [--requests 24]
        [--conversations 6] [--turns 4] [--max-tokens 32] [--torch-threads 1]
        [--out runs/prefix_cache/run]

The real pair (SmolLM2-135M-Instruct and its trained draft, exspec.models.real_pair) is served by a
fresh tritonserver per arm (enable_prefix_caching true / false), workload and repeat, the arms
interleaved (on off, then off on). This process is the outside client: --users threads, each
with its own gRPC stream, send greedy streamed requests, --max-tokens each. Two workloads, each
prompt rendered by the model's own chat template (which adds its default system prompt):

- system: --requests distinct one-turn questions, so only the system prompt is shared;
- chat: --conversations conversations of --turns turns, each turn resending the whole history
  (the system prompt, every question and every answer the server gave so far).

Per arm: TTFT p50/p95 (first streamed response), output tokens/s over the workload's wall time,
prompt tokens and prefill tokens computed per request (prompt tokens less the tokens the server
found cached, from its exspec: metrics), and the hit rate; the medians over repeats are printed
as a table and written to <out>.json.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))
sys.path.insert(0, str(REPO / "tests"))                  # modelrepo.py
sys.path.insert(0, str(REPO / "tests" / "integration"))  # clients.py

MODEL = "smollm2"
FOLLOW_UPS = ["Can you explain that in more detail?", "Give me an example.",
              "What is a common mistake here?", "Summarize that in one sentence.",
              "How would you explain it to a child?"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="load_tests/prefix_cache.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--requests", type=int, default=24, help="questions of the system workload")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--torch-threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--out", default="runs/prefix_cache/run")
    return p.parse_args(argv)


def ask(client, prompt: str, max_tokens: int, events: queue.Queue) -> dict:
    """One streamed greedy request on this user's stream: its TTFT, time, tokens and text."""
    from clients import grpc_inputs
    start = time.perf_counter()
    client.async_stream_infer(MODEL, grpc_inputs(prompt=prompt, stream=True, sampling={
        "max_tokens": max_tokens, "temperature": 0}), enable_empty_final_response=True)
    first, tokens, text = None, 0, []
    while True:
        result, error = events.get(timeout=300)
        if error is not None:
            raise RuntimeError(error.message())
        response = result.get_response()
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            first = first or time.perf_counter() - start
            tokens += ids.size
            text.append(result.as_numpy("text_output").reshape(-1)[0].decode())
        if response.parameters["triton_final_response"].bool_param:
            return {"ttft": first, "seconds": time.perf_counter() - start, "tokens": tokens,
                    "text": "".join(text)}


def run_users(url: str, users: int, jobs: list, work) -> list[dict]:
    """`work(client, events, job)` for every job, by `users` threads each with its own stream."""
    import tritonclient.grpc as grpcclient
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    records, lock, failures = [], threading.Lock(), []

    def user():
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                got = work(client, events, job)
                with lock:
                    records.extend(got)
        except Exception as exc:   # noqa: BLE001 - reported after the run
            failures.append(repr(exc))
        finally:
            client.stop_stream()
            client.close()
    threads = [threading.Thread(target=user) for _ in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} users failed: {failures[0]}")
    return records


def system_workload(args, tokenizer):
    from exspec.models.real_pair import QUESTIONS
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)][1]} (question {i})"}],
        add_generation_prompt=True, tokenize=False) for i in range(args.requests)]
    return prompts, lambda client, events, prompt: [ask(client, prompt, args.max_tokens, events)]


def chat_workload(args, tokenizer):
    from exspec.models.real_pair import QUESTIONS

    def conversation(client, events, index):
        messages, out = [], []
        for turn in range(args.turns):
            question = (QUESTIONS[index % len(QUESTIONS)][1] if turn == 0
                        else FOLLOW_UPS[(index + turn) % len(FOLLOW_UPS)])
            messages.append({"role": "user", "content": question})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            record = ask(client, prompt, args.max_tokens, events)
            messages.append({"role": "assistant", "content": record["text"]})
            out.append(record)
        return out
    return list(range(args.conversations)), conversation


def scrape(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name + "{") and f'model="{MODEL}"' in line)


def one_run(args, pair: Path, workload: str, caching: bool, repeat: int) -> dict:
    from transformers import AutoTokenizer

    from exspec.serving.launcher import TritonServer
    from modelrepo import write_model
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    jobs, work = (system_workload if workload == "system" else chat_workload)(args, tokenizer)
    engine = {"method": "exspec", "num_speculative_tokens": 4, "max_batch_size": 4,
              "max_num_seqs": 16, "default_max_tokens": args.max_tokens,
              "torch_threads": args.torch_threads, "tokenizer": str(pair / "target"),
              "enable_prefix_caching": caching}
    with tempfile.TemporaryDirectory(prefix="exspec-prefix-") as tmp:
        repo = Path(tmp) / "models"
        write_model(repo, MODEL, pair, engine)
        log = f"{args.out}_{workload}_{'on' if caching else 'off'}_{repeat}_tritonserver.log"
        with TritonServer(repo, free_ports=True, startup_timeout_s=600, log_path=log) as server:
            start = time.perf_counter()
            records = run_users(server.urls["grpc"], args.users, jobs, work)
            wall = time.perf_counter() - start
            time.sleep(1.0)   # the last tick's metrics
            prompt_tokens = scrape(server.urls["metrics"], "exspec:prompt_tokens_total")
            hits = scrape(server.urls["metrics"], "exspec:prefix_cache_hits_total")
            queries = scrape(server.urls["metrics"], "exspec:prefix_cache_queries_total")
    ttfts = sorted(r["ttft"] for r in records)
    n = len(records)
    return {"workload": workload, "caching": caching, "repeat": repeat, "requests": n,
            "ttft_p50_ms": 1000 * float(np.percentile(ttfts, 50)),
            "ttft_p95_ms": 1000 * float(np.percentile(ttfts, 95)),
            "tokens_per_s": sum(r["tokens"] for r in records) / wall,
            "prompt_tokens_per_request": prompt_tokens / n,
            "prefill_tokens_per_request": (prompt_tokens - hits) / n,
            "hit_rate": hits / queries if queries else 0.0}


def table(rows: list[dict]) -> str:
    keys = ["ttft_p50_ms", "ttft_p95_ms", "tokens_per_s", "prompt_tokens_per_request",
            "prefill_tokens_per_request", "hit_rate"]
    out = ["| workload | caching | runs | " + " | ".join(keys) + " |", "|---" * (len(keys) + 3) + "|"]
    for workload in ("system", "chat"):
        for caching in (True, False):
            runs = [r for r in rows if r["workload"] == workload and r["caching"] == caching]
            if not runs:
                continue
            cells = []
            for key in keys:
                values = [r[key] for r in runs]
                cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{v:.1f}' for v in values)})"
                             if key == "hit_rate" else
                             f"{statistics.median(values):.0f} ({', '.join(f'{v:.0f}' for v in values)})")
            out.append(f"| {workload} | {'on' if caching else 'off'} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    from exspec.models.real_pair import ensure_pair
    pair = ensure_pair()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        for workload in ("system", "chat"):
            arms = (True, False) if repeat % 2 == 0 else (False, True)
            for caching in arms:
                row = one_run(args, pair, workload, caching, repeat)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(table(rows))
    Path(f"{args.out}.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
