"""Soak run through exspec-openai (Triton's OpenAI frontend in front of exspec): concurrent
streamed chat and completions for a set time, a share of clients walking away mid-stream, bad
requests mixed in; then the leak checks.

    python load_tests/soak_openai.py --frontend DIR --python PATH [--duration 1200]
        [--clients 6] [--disconnect-share 0.3] [--bad-share 0.1] [--max-tokens 64]
        [--out runs/soak/openai] [--model-repository model_repository]

Each client thread loops until the time is up, each request drawn at random: a disconnect
(--disconnect-share: a long streamed request, ignore_eos, closed right after its first token
arrives), a bad request (--bad-share: refused by exspec or by the frontend; it must come back
as a 4xx, or as an SSE error event once a stream has started, never served, never cut), else a
whole request (streamed chat or completions with usage, or a plain completion).

Checks (exit 1 when one fails): whole requests all served; bad requests all refused cleanly;
requests running and waiting back to 0 and every exspec:kv_cache_tokens role back to 0 when the
load stops; resident memory of the frontend (with its in-process tritonserver) and of the model's
stub flat under load (median of the window after warm-up vs the last window, growth < 10%, as
load_tests/soak.py judges it); and tokens generated after a disconnect under one engine step
(k + 1 tokens) per disconnected request. That last figure is exact from the metrics: a
disconnecting client has received exactly one token (the first token leaves alone), whole
requests report theirs in usage, bad ones generate none, so what exspec:generation_tokens_total
counted beyond those is what the disconnected requests generated after their first token.
Writes <out>_soak.json and <out>_running_rss.png (requests running and RSS over time).
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "backend"))
from soak import (ReadinessPoller, rss_checks, rss_kib, save_report, scrape,  # noqa: E402
                  under_load_windows, wait_idle)

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):",
           "# sort a list of numbers\n", "def add(a, b):"]
# (kind, path, body fields, stream): each must be refused, by exspec (INVALID_ARG: 400) or by the
# frontend (its schema: 422, unknown model: 400), or, once streaming, by an SSE error event.
BAD = [("non-neutral vLLM key", "/v1/completions", {"presence_penalty": 0.5}, False),
       ("negative temperature", "/v1/completions", {"temperature": -1.0}, False),
       ("max_tokens beyond the model", "/v1/completions", {"max_tokens": 10 ** 7}, False),
       ("unknown model", "/v1/completions", {"model": "nonexistent"}, False),
       ("unknown field", "/v1/chat/completions", {"frobnicate": True}, False),
       ("streamed echo", "/v1/completions", {"echo": True}, True),
       ("streamed non-neutral key", "/v1/chat/completions", {"presence_penalty": 0.5}, True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="load_tests/soak_openai.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--frontend", required=True, help="the frontend's openai_frontend/ folder")
    p.add_argument("--python", required=True,
                   help="Python with the frontend's requirements and Triton's bindings")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the memory baseline (default: a fifth, at most 60)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--disconnect-share", type=float, default=0.3)
    p.add_argument("--bad-share", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=64, help="of whole requests")
    p.add_argument("--disconnect-max-tokens", type=int, default=400)
    p.add_argument("--model-repository", default=str(REPO / "model_repository"))
    p.add_argument("--model", default="exspec")
    p.add_argument("--out", default="runs/soak/openai")
    return p.parse_args(argv)


class Frontend:
    """exspec-openai as a child process on a free loopback port."""

    def __init__(self, args, log: Path):
        from exspec.serving.ports import reserve_ports
        with reserve_ports(1, host="127.0.0.1") as (port,):
            self.port = port
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exspec.serving.openai_frontend", "--model-repository",
             args.model_repository, "--frontend", args.frontend, "--python", args.python,
             "--openai-port", str(port), "--", "--model-control-mode", "explicit",
             "--load-model", args.model],
            cwd=REPO / "backend", stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"exspec-openai did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        # the folder the backend was laid out in: the stubs' command lines name it
        command = next(l for l in log.read_text().splitlines() if l.startswith("exspec-openai: "))
        self.backends = command.split()[4]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def memory(self) -> dict:
        from exspec.serving.launcher import stub_pids
        return {"server_mib": (rss_kib(self.proc.pid) or 0) / 1024,
                "stub_mib": sum(rss_kib(p) or 0 for p in stub_pids(self.backends)) / 1024}

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def post(frontend: Frontend, path: str, body: dict | bytes, timeout_s: float = 300):
    conn = http.client.HTTPConnection("127.0.0.1", frontend.port, timeout=timeout_s)
    data = body if isinstance(body, bytes) else json.dumps(body)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def is_error_event(payload: str) -> bool:
    """An SSE error event (OpenAI's {"error": {...}}): judged on the parsed event, since the
    generated text may contain the word itself."""
    try:
        return "error" in json.loads(payload)
    except ValueError:
        return False


def sse(response):
    """The data payloads of a server-sent event stream, as they arrive."""
    for line in response:
        line = line.strip()
        if line.startswith(b"data: "):
            yield line[6:].decode()


class Client(threading.Thread):
    """One client: requests drawn at random until the deadline; tallies what came back."""

    def __init__(self, frontend: Frontend, args, deadline: float, seed: int):
        super().__init__(daemon=True)
        self.frontend, self.args, self.deadline = frontend, args, deadline
        self.rng = random.Random(seed)
        self.tally: Counter = Counter()
        self.completion_tokens = 0          # usage of whole requests
        self.problems: list[str] = []

    def run(self):
        while time.monotonic() < self.deadline:
            roll = self.rng.random()
            try:
                if roll < self.args.disconnect_share:
                    self.disconnect()
                elif roll < self.args.disconnect_share + self.args.bad_share:
                    self.bad()
                else:
                    self.whole()
            except Exception as exc:     # a cut connection, a body that is not what it should be
                self.problem("transport", f"{type(exc).__name__}: {exc}")

    def problem(self, kind: str, detail: str):
        self.tally[f"{kind}:problem"] += 1
        if len(self.problems) < 5:
            self.problems.append(f"{kind}: {detail[:300]}")

    def request(self, chat: bool, **fields) -> tuple[str, dict]:
        prompt = self.rng.choice(PROMPTS)
        if chat:
            return "/v1/chat/completions", {"model": self.args.model, "messages": [
                {"role": "user", "content": prompt}], **fields}
        return "/v1/completions", {"model": self.args.model, "prompt": prompt, **fields}

    def whole(self):
        chat, stream = self.rng.random() < 0.5, self.rng.random() < 0.8
        fields = {"max_tokens": self.args.max_tokens, "temperature": self.rng.choice([0, 0.8])}
        if stream:
            fields |= {"stream": True, "stream_options": {"include_usage": True}}
        path, body = self.request(chat, **fields)
        conn, response = post(self.frontend, path, body)
        try:
            if response.status != 200:
                return self.problem("whole", f"{response.status} {response.read()[:200]!r}")
            if not stream:
                self.completion_tokens += json.loads(response.read())["usage"]["completion_tokens"]
                self.tally["whole:served"] += 1
                return
            payloads = list(sse(response))
        finally:
            conn.close()
        if not payloads or payloads[-1] != "[DONE]" or any(map(is_error_event, payloads)):
            return self.problem("whole", f"stream ended {payloads[-2:]}")
        self.completion_tokens += json.loads(payloads[-2])["usage"]["completion_tokens"]
        self.tally["whole:served"] += 1

    def disconnect(self):
        """A long stream closed as soon as its first token is in: chat's first event is the
        role alone, so its first token is the second event."""
        chat = self.rng.random() < 0.5
        path, body = self.request(chat, stream=True, ignore_eos=True, temperature=0.8,
                                  max_tokens=self.args.disconnect_max_tokens)
        conn, response = post(self.frontend, path, body)
        try:
            if response.status != 200:
                return self.problem("disconnect", f"{response.status} {response.read()[:200]!r}")
            events = sse(response)
            for _ in range(2 if chat else 1):
                payload = next(events)
                if payload == "[DONE]" or is_error_event(payload):
                    return self.problem("disconnect", f"ended early: {payload[:200]}")
            conn.sock.shutdown(2)       # the client goes away mid-stream
        finally:
            conn.close()
        self.tally["disconnect:closed"] += 1

    def bad(self):
        kind, path, fields, stream = self.rng.choice(BAD + [("broken JSON", "", {}, False)])
        if kind == "broken JSON":
            conn, response = post(self.frontend, "/v1/completions", b'{"model": "exspec", ')
        else:
            _, body = self.request(path.endswith("chat/completions"), max_tokens=8)
            conn, response = post(self.frontend, path, {**body, **fields, "stream": stream})
        try:
            if 400 <= response.status < 500:
                response.read()
                self.tally["bad:refused"] += 1
                return
            if response.status != 200 or not stream:
                return self.problem("bad", f"{kind}: {response.status} {response.read()[:200]!r}")
            payloads = list(sse(response))
        finally:
            conn.close()
        # the error event, then [DONE]; before them at most chat's role chunk, no text
        if 2 <= len(payloads) <= 3 and payloads[-1] == "[DONE]" and is_error_event(payloads[-2]):
            self.tally["bad:refused"] += 1
        else:
            self.problem("bad", f"{kind}: stream {payloads[-2:]}")


def sample(frontend: Frontend) -> dict:
    """The poller's sample: memory, and what the metrics say is running."""
    m = scrape(frontend.url + "/metrics")
    return {**frontend.memory(), "running": m.get("exspec:num_requests_running", 0),
            "waiting": m.get("exspec:num_requests_waiting", 0)}


def run(args) -> dict:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 5)
    frontend = Frontend(args, Path(f"{args.out}_frontend.log"))
    k = json.loads((Path(args.model_repository) / args.model / "1" / "model.json").read_text()
                   ).get("num_speculative_tokens", 5)
    report = {"command": " ".join([sys.executable] + sys.argv), "duration_s": args.duration,
              "warmup_s": warmup, "clients": args.clients,
              "disconnect_share": args.disconnect_share, "bad_share": args.bad_share,
              "max_tokens": args.max_tokens, "num_speculative_tokens": k}
    try:
        before = scrape(frontend.url + "/metrics")
        poller = ReadinessPoller([frontend.url + "/health/ready"], lambda: sample(frontend),
                                 memory_every_s=2)
        poller.start()
        deadline = time.monotonic() + args.duration
        clients = [Client(frontend, args, deadline, seed) for seed in range(args.clients)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        after, idle_s = wait_idle(frontend.url + "/metrics")
        time.sleep(3)                    # a few idle samples for the plot
        poller.stopping.set()
        poller.join()
    finally:
        report["frontend_exit"] = frontend.stop()
    tally = sum((c.tally for c in clients), Counter())
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    disconnected = tally["disconnect:closed"]
    after_close = (delta["exspec:generation_tokens_total"]
                   - sum(c.completion_tokens for c in clients) - disconnected)
    report.update({
        "tally": dict(tally), "problems": [p for c in clients for p in c.problems][:10],
        "server_outcomes": {k_: v for k_, v in delta.items() if "requests_total{" in k_},
        "generation_tokens": delta["exspec:generation_tokens_total"],
        "whole_completion_tokens": sum(c.completion_tokens for c in clients),
        "tokens_after_disconnect": after_close,
        "tokens_after_disconnect_per_request": after_close / disconnected if disconnected else None,
        "idle_after_s": None if idle_s is None else round(idle_s, 1),
        "running_end": after.get("exspec:num_requests_running"),
        "waiting_end": after.get("exspec:num_requests_waiting"),
        "kv_cache_tokens_end": after.get("exspec:kv_cache_tokens"),
        "ready_polls": poller.polls, "ready_failures": poller.failures,
        "samples": poller.memory,
        "memory_under_load": under_load_windows(poller.memory, warmup, args.duration),
    })
    return report


def checks(r: dict) -> list[tuple[str, bool, str]]:
    t = r["tally"]
    per_request = r["tokens_after_disconnect_per_request"]
    step = r["num_speculative_tokens"] + 1
    problems = {k: v for k, v in t.items() if k.endswith(":problem")}
    return [
        ("every request answered as expected (no problem)", not problems, f"{problems}"),
        ("whole requests served", t.get("whole:served", 0) > 0, f"{t.get('whole:served', 0)}"),
        ("bad requests refused", t.get("bad:refused", 0) > 0, f"{t.get('bad:refused', 0)}"),
        ("clients disconnected", t.get("disconnect:closed", 0) > 0,
         f"{t.get('disconnect:closed', 0)}"),
        ("disconnected requests counted cancelled",
         r["server_outcomes"].get("exspec:requests_total{outcome=cancelled}", 0)
         == t.get("disconnect:closed", 0),
         f"{r['server_outcomes'].get('exspec:requests_total{outcome=cancelled}', 0):.0f} "
         f"of {t.get('disconnect:closed', 0)}"),
        ("running and waiting back to 0", r["running_end"] == 0 and r["waiting_end"] == 0,
         f"running {r['running_end']}, waiting {r['waiting_end']}"),
        ("KV cache tokens (all, allocated, reserved) back to 0", r["kv_cache_tokens_end"] == 0,
         f"{r['kv_cache_tokens_end']}"),
        ("ready at every poll", r["ready_failures"] == 0,
         f"{r['ready_failures']} of {r['ready_polls']} polls failed"),
        *rss_checks(r["memory_under_load"], {"server_mib": "frontend (with tritonserver)",
                                             "stub_mib": "stub"}),
        (f"tokens after a disconnect < one step ({step}) per request",
         per_request is not None and per_request < step,
         "n/a" if per_request is None else f"{per_request:.2f}"),
    ]


def plot(r: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [s for s, _ in r["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    top.plot(t, [m["running"] for _, m in r["samples"]], lw=0.8, label="running")
    top.plot(t, [m["waiting"] for _, m in r["samples"]], lw=0.8, label="waiting")
    top.set_ylabel("requests")
    top.legend(loc="upper right", fontsize=8)
    for key, label in (("stub_mib", "model stub (engine)"),
                       ("server_mib", "frontend + in-process tritonserver")):
        bottom.plot(t, [m[key] for _, m in r["samples"]], label=label)
    bottom.set_ylabel("RSS (MiB)")
    bottom.set_xlabel("seconds since the load started")
    bottom.legend(loc="center right", fontsize=8)
    fig.suptitle(f"exspec-openai soak: {r['clients']} clients, {r['duration_s']:.0f} s, "
                 f"{r['disconnect_share']:.0%} disconnecting", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    results = checks(report)
    save_report(report, results, args.out)
    png = plot(report, f"{args.out}_running_rss.png")
    print(json.dumps({k: report[k] for k in (
        "tally", "server_outcomes", "generation_tokens", "whole_completion_tokens",
        "tokens_after_disconnect", "tokens_after_disconnect_per_request", "idle_after_s",
        "memory_under_load")}, indent=1))
    for check, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {detail}")
    for problem in report["problems"]:
        print("  problem: " + problem)
    print(f"report: {args.out}_soak.json" + (f", plot: {png}" if png else ""))
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
