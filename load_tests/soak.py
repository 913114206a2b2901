"""Soak run: a real tritonserver with the demo pair under a locust mix for a set time, then the
checks people ask of a server they put behind real traffic.

    python load_tests/soak.py [--duration 600] [--users 4] [--cancel-users 1]
        [--malformed-users 1] [--max-tokens 64] [--out runs/soak/soak]
        [--model-repository model_repository]        (also: make soak SOAK_TIME=600)

The mix (locust, headless, in a subprocess): --users gRPC-stream and --users HTTP-SSE users of
load_tests/locustfile.py (whole generations), --cancel-users of each protocol that close their
stream after a few deltas (the server must abort and free the sequence), and
--malformed-users that send requests the server must refuse (bad sampling values, unknown
parameters, broken JSON). This file is both the driver (run as a script) and the locustfile
(locust imports it, and it imports the shipped users from load_tests/locustfile.py); the driver
never imports locust.

Afterwards it prints one table and writes <out>_soak.json: requests sent / completed /
cancelled / rejected, requests that got no final response (a timeout or a stream that ended
without one: must be 0), readiness polled every second throughout (must never fail), resident
memory of tritonserver and of the model's stub (sampled every 5 s; the check compares like
with like: the median under load in the minute after warm-up against the median in the last
minute of load, growth under 10%; the table also gives start / after warm-up / idle at the end,
and <out>_memory.png plots it), and exspec:num_requests_running / waiting back to 0. Exits 1
when a check fails.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LOST_MARKERS = ("without a final response", "no final response within", "ExspecTimeout")
OUTCOMES = ("stop", "length", "abort", "cancelled", "error", "rejected")
MAX_RSS_GROWTH = 0.10


# ---------------------------------------------------------------------------------------------
# The driver (python load_tests/soak.py)
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="load_tests/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds after which the warm memory sample is taken "
                        "(default: a fifth of the duration, at most 60)")
    p.add_argument("--users", type=int, default=4, help="whole-generation users per protocol")
    p.add_argument("--cancel-users", type=int, default=1, help="cancelling users per protocol")
    p.add_argument("--malformed-users", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request without its final response by then counts as lost")
    p.add_argument("--model-repository", default=str(REPO / "model_repository"))
    p.add_argument("--model", default="exspec")
    p.add_argument("--out", default="runs/soak/soak", help="prefix of the CSVs and the JSON")
    p.add_argument("--exit-timeout-s", type=int, default=30)
    return p.parse_args(argv)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def memory(server, model: str) -> dict:
    """RSS in MiB of tritonserver and of the stubs serving `model` (its engine lives there)."""
    from exspec.serving.launcher import stub_pids   # importable once run() has put backend/ on the path
    stubs = [p for p in stub_pids(str(server.work_dir)) if f" {model}_0_" in _cmdline(p)]
    return {"server_mib": (rss_kib(server.process.pid) or 0) / 1024,
            "stub_mib": sum(rss_kib(p) or 0 for p in stubs) / 1024}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def scrape(metrics_url: str) -> dict:
    """exspec:* samples summed over label sets, keyed 'name' and 'name{outcome=...}'."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("exspec:"):
            continue
        head, value = line.rsplit(" ", 1)
        name = head.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
        if 'outcome="' in head:
            outcome = head.split('outcome="')[1].split('"')[0]
            key = f"{name}{{outcome={outcome}}}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def triton_ready_urls(http_url: str, model: str) -> list[str]:
    return [f"{http_url}/v2/health/ready", f"{http_url}/v2/models/{model}/ready"]


class ReadinessPoller(threading.Thread):
    """GETs `urls` (readiness) once a second; counts failures. Also calls sample_memory every
    memory_every_s: (seconds since start, {server_mib, stub_mib, ...})."""

    def __init__(self, urls: list[str], sample_memory, memory_every_s: int = 5):
        super().__init__(daemon=True)
        self.urls = urls
        self.memory_every_s = memory_every_s
        self.polls = self.failures = 0
        self.first_failure: str | None = None
        self.stopping = threading.Event()
        self.sample_memory = sample_memory
        self.memory: list[tuple[float, dict]] = []
        self.started = time.monotonic()

    def run(self):
        while not self.stopping.wait(1.0):
            if self.polls % self.memory_every_s == 0:
                self.memory.append((round(time.monotonic() - self.started, 1), self.sample_memory()))
            self.polls += 1
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        ok = r.status == 200
                except (urllib.error.URLError, OSError) as exc:
                    ok, why = False, str(exc)
                else:
                    why = "status != 200"
                if not ok:
                    self.failures += 1
                    self.first_failure = self.first_failure or f"{time.strftime('%X')} {url}: {why}"
                    break


def locust_command(args, server) -> list[str]:
    users = 2 * args.users + 2 * args.cancel_users + args.malformed_users
    return [sys.executable, "-m", "locust", "-f", str(Path(__file__).resolve()),
            "--headless", "-u", str(users), "-r", str(users), "-t", f"{int(args.duration)}s",
            "-s", str(int(args.request_timeout) + 10), "--host", server.urls["http"],
            "--grpc-url", server.urls["grpc"], "--model", args.model,
            "--max-tokens", str(args.max_tokens), "--request-timeout", str(args.request_timeout),
            "--csv", args.out, "--only-summary", "--loglevel", "WARNING",
            "SoakGrpcUser", "SoakHttpUser", "CancellingGrpcUser", "CancellingHttpUser",
            "MalformedUser"]


def user_environment(args) -> dict:
    import os
    env = dict(os.environ)
    env.update(EXSPEC_SOAK_USERS=str(args.users), EXSPEC_SOAK_CANCEL_USERS=str(args.cancel_users),
               EXSPEC_SOAK_MALFORMED_USERS=str(args.malformed_users))
    return env


def tally(prefix: str) -> dict:
    """Requests by outcome from locust's CSVs (both the shipped users' and ours)."""
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]
    failures = []
    if Path(f"{prefix}_failures.csv").exists():
        with open(f"{prefix}_failures.csv", newline="") as f:
            failures = list(csv.DictReader(f))
    count = lambda name: sum(int(r["Request Count"]) for r in rows if r["Name"] == name)  # noqa: E731
    failed = lambda name: sum(int(r["Failure Count"]) for r in rows if r["Name"] == name)  # noqa: E731
    lost_whole = sum(int(f["Occurrences"]) for f in failures if f["Name"] == "generate_stream"
                     and any(m in f["Error"] for m in LOST_MARKERS))
    whole, whole_failed = count("generate_stream"), failed("generate_stream")
    t = {
        "whole": whole, "whole_completed": whole - whole_failed,
        "whole_errors": whole_failed - lost_whole, "whole_lost": lost_whole,
        "cancel_sent": sum(count(f"cancel:{o}") for o in ("cancelled", "completed", "error", "lost")),
        "cancelled": count("cancel:cancelled"), "cancel_completed": count("cancel:completed"),
        "cancel_errors": count("cancel:error"), "cancel_lost": count("cancel:lost"),
        "malformed_sent": sum(count(f"malformed:{o}") for o in ("rejected", "accepted", "lost")),
        "malformed_rejected": count("malformed:rejected"),
        "malformed_accepted": count("malformed:accepted"), "malformed_lost": count("malformed:lost"),
        "failure_messages": [f"{f['Name']}: {f['Error'][:200]} x{f['Occurrences']}" for f in failures][:10],
    }
    t["sent"] = t["whole"] + t["cancel_sent"] + t["malformed_sent"]
    t["completed"] = t["whole_completed"] + t["cancel_completed"]
    t["rejected"] = t["whole_errors"] + t["cancel_errors"] + t["malformed_rejected"]
    t["lost"] = t["whole_lost"] + t["cancel_lost"] + t["malformed_lost"]
    return t


def wait_idle(metrics_url: str, timeout_s: float = 60.0) -> tuple[dict, float | None]:
    start = time.monotonic()
    while True:
        m = scrape(metrics_url)
        if m.get("exspec:num_requests_running", 1) == 0 and m.get("exspec:num_requests_waiting", 1) == 0:
            return m, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return m, None
        time.sleep(0.5)


def run(args) -> dict:
    import subprocess
    sys.path.insert(0, str(REPO / "backend"))
    from exspec.serving.launcher import TritonServer, stub_pids

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 5)
    server = TritonServer(args.model_repository, free_ports=True, startup_timeout_s=600,
                          log_path=f"{args.out}_tritonserver.log",
                          extra_args=[f"--exit-timeout-secs={args.exit_timeout_s}"])
    report: dict = {"command": " ".join([sys.executable] + sys.argv), "duration_s": args.duration,
                    "warmup_s": warmup, "users_per_protocol": args.users,
                    "cancel_users_per_protocol": args.cancel_users,
                    "malformed_users": args.malformed_users, "max_tokens": args.max_tokens}
    with server:
        before = scrape(server.urls["metrics"])
        report["memory_start"] = memory(server, args.model)
        poller = ReadinessPoller(triton_ready_urls(server.urls["http"], args.model),
                                 lambda: memory(server, args.model))
        poller.start()
        cmd = locust_command(args, server)
        print("$ " + " ".join(cmd), flush=True)
        started = time.monotonic()
        locust = subprocess.Popen(cmd, env=user_environment(args))
        try:
            locust.wait(timeout=warmup)
        except subprocess.TimeoutExpired:
            pass
        report["memory_warm"] = memory(server, args.model)
        try:
            code = locust.wait(timeout=args.duration - warmup + args.request_timeout + 120)
        except subprocess.TimeoutExpired:
            locust.kill()
            code = "killed (did not stop in time)"
        report["locust_exit"] = code
        report["load_wall_s"] = round(time.monotonic() - started, 1)
        after, idle_s = wait_idle(server.urls["metrics"])
        report["idle_after_s"] = None if idle_s is None else round(idle_s, 1)
        report["running_end"] = after.get("exspec:num_requests_running")
        report["waiting_end"] = after.get("exspec:num_requests_waiting")
        report["server_outcomes"] = {o: after.get(f"exspec:requests_total{{outcome={o}}}", 0)
                                     - before.get(f"exspec:requests_total{{outcome={o}}}", 0)
                                     for o in OUTCOMES}
        time.sleep(2)
        report["memory_end"] = memory(server, args.model)
        poller.stopping.set()
        poller.join()
        report["ready_polls"], report["ready_failures"] = poller.polls, poller.failures
        report["ready_first_failure"] = poller.first_failure
        report["memory_samples"] = poller.memory
        report["memory_under_load"] = under_load_windows(poller.memory, warmup, args.duration)
        marker = str(server.work_dir)
    report["stubs_left"] = stub_pids(marker)
    report.update(tally(args.out))
    return report


def under_load_windows(samples: list, warmup: float, duration: float, window: float = 60.0) -> dict:
    """Median RSS in the window right after warm-up and in the last window of the load: the
    like-for-like comparison (single samples swing with what is in flight at that moment)."""
    def median_in(lo, hi, key):
        values = sorted(m[key] for t, m in samples if lo <= t < hi)
        return values[len(values) // 2] if values else None
    window = min(window, max(5.0, (duration - warmup) / 3))
    spans = {"after_warmup": (warmup, warmup + window), "last": (duration - window, duration)}
    return {name: {key: median_in(lo, hi, key) for key in ("server_mib", "stub_mib")}
            for name, (lo, hi) in spans.items()} | {"window_s": window}


def plot_memory(r: dict, path: str) -> str | None:
    """RSS over the run, one line per process, the windows shaded (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = r["memory_samples"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for key, label in (("stub_mib", "model stub (engine)"), ("server_mib", "tritonserver")):
        ax.plot([t for t, _ in samples], [m[key] for _, m in samples], label=label)
    w = r["memory_under_load"]["window_s"]
    for lo in (r["warmup_s"], r["duration_s"] - w):
        ax.axvspan(lo, lo + w, color="grey", alpha=0.15)
    ax.set_xlabel("seconds since the server was up (shaded: compared windows)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(f"soak: {r['sent']} requests in {r['duration_s']:.0f} s")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rss_checks(under_load: dict, processes: dict[str, str]) -> list[tuple[str, bool, str]]:
    """Per process (sample key -> name): the median RSS of the last window under load against
    the window after warm-up, growth under MAX_RSS_GROWTH."""
    out = []
    for key, name in processes.items():
        warm, end = under_load["after_warmup"][key], under_load["last"][key]
        growth = (end - warm) / warm if warm and end else 0.0
        out.append((f"{name} RSS growth under load, last window vs after warm-up < "
                    f"{MAX_RSS_GROWTH:.0%}", growth < MAX_RSS_GROWTH, f"{growth:+.1%}"))
    return out


def checks(r: dict) -> list[tuple[str, bool, str]]:
    return [
        ("every request got its final response (lost = 0)", r["lost"] == 0, f"lost {r['lost']}"),
        ("requests were served", r["completed"] > 0, f"completed {r['completed']}"),
        ("malformed requests were refused, not served", r["malformed_accepted"] == 0,
         f"accepted {r['malformed_accepted']}"),
        ("whole generations had no server errors", r["whole_errors"] == 0,
         f"errors {r['whole_errors']}"),
        ("ready at every poll", r["ready_failures"] == 0,
         f"{r['ready_failures']} of {r['ready_polls']} failed; first: {r['ready_first_failure']}"),
        ("running and waiting back to 0", r["running_end"] == 0 and r["waiting_end"] == 0,
         f"running {r['running_end']}, waiting {r['waiting_end']}"),
        *rss_checks(r["memory_under_load"], {"server_mib": "server", "stub_mib": "stub"}),
        ("no stub process left after shutdown", not r["stubs_left"], f"{r['stubs_left']}"),
    ]


def table(r: dict) -> str:
    mem = lambda k: " / ".join(f"{r[p][k]:.0f}" for p in ("memory_start", "memory_warm", "memory_end"))  # noqa: E731
    w = r["memory_under_load"]["window_s"]
    loaded = lambda k: " / ".join(  # noqa: E731
        "n/a" if r["memory_under_load"][p][k] is None else f"{r['memory_under_load'][p][k]:.0f}"
        for p in ("after_warmup", "last"))
    rows = [
        ("load", f"{r['duration_s']:.0f} s; {r['users_per_protocol']} gRPC-stream + "
                 f"{r['users_per_protocol']} HTTP-SSE users, {r['cancel_users_per_protocol']} + "
                 f"{r['cancel_users_per_protocol']} cancelling, {r['malformed_users']} malformed; "
                 f"max_tokens {r['max_tokens']}"),
        ("requests sent", r["sent"]),
        ("completed", f"{r['completed']} ({r['whole_completed']} whole, "
                      f"{r['cancel_completed']} finished before the cancel)"),
        ("cancelled mid-stream", r["cancelled"]),
        ("rejected (error response)", f"{r['rejected']} ({r['malformed_rejected']} malformed, "
                                      f"{r['whole_errors'] + r['cancel_errors']} others)"),
        ("no final response (lost)", r["lost"]),
        ("server outcomes (exspec:requests_total)",
         ", ".join(f"{k} {v:.0f}" for k, v in r["server_outcomes"].items())),
        ("readiness", f"{r['ready_polls'] - r['ready_failures']} / {r['ready_polls']} polls ready"),
        ("tritonserver RSS MiB start / warm / end (idle)", mem("server_mib")),
        ("stub RSS MiB start / warm / end (idle)", mem("stub_mib")),
        (f"RSS MiB under load, median of {w:.0f} s after warm-up / of the last {w:.0f} s",
         f"tritonserver {loaded('server_mib')}; stub {loaded('stub_mib')}"),
        ("running / waiting at the end", f"{r['running_end']:.0f} / {r['waiting_end']:.0f} "
                                         f"(idle {r['idle_after_s']} s after the load)"),
        ("stubs left after shutdown", len(r["stubs_left"])),
    ]
    lines = ["| soak | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def save_report(report: dict, results: list[tuple[str, bool, str]], out: str) -> None:
    """The report with its checks, as <out>_soak.json."""
    report["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in results]
    Path(f"{out}_soak.json").write_text(json.dumps(report, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    results = checks(report)
    save_report(report, results, args.out)
    print(table(report))
    png = plot_memory(report, f"{args.out}_memory.png")
    for check, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {detail}")
    if report["failure_messages"]:
        print("locust failures:\n  " + "\n  ".join(report["failure_messages"]))
    print(f"report: {args.out}_soak.json, CSVs: {args.out}_stats.csv, log: "
          f"{args.out}_tritonserver.log" + (f", memory plot: {png}" if png else ""))
    return 0 if all(ok for _, ok, _ in results) else 1


# ---------------------------------------------------------------------------------------------
# The extra locust users (locust imports this file next to load_tests/locustfile.py)
# ---------------------------------------------------------------------------------------------
def _define_users():
    import http.client
    import os
    from urllib.parse import urlsplit

    sys.path.insert(0, str(HERE))
    from locust import User, constant

    from locustfile import GrpcStreamUser, HttpSseUser   # its options and listeners come along
    from exspec_client import ExspecError, ExspecTimeout   # on the path locustfile set up

    def env_int(name, default):
        return int(os.environ.get(name, default))

    whole = env_int("EXSPEC_SOAK_USERS", 4)
    cancelling = env_int("EXSPEC_SOAK_CANCEL_USERS", 1)
    malformed = env_int("EXSPEC_SOAK_MALFORMED_USERS", 1)

    def fire(user, name, start, exc=None):
        user.environment.events.request.fire(
            request_type=user.protocol, name=name, response_time=(time.time() - start) * 1000,
            response_length=0, exception=exc, context={})

    def lost(exc) -> bool:
        return isinstance(exc, ExspecTimeout) or any(m in str(exc) for m in LOST_MARKERS)

    def cancel_mid_stream(user):
        """Read 1-4 deltas of a long generation, then close the stream (cancels on the server)."""
        prompt = user.prompts[user.position % len(user.prompts)]
        user.position += 1
        cut = random.randint(1, 4)
        start = time.time()
        sampling = {**user.sampling, "max_tokens": max(user.sampling["max_tokens"] or 0, 48),
                    "ignore_eos": True}
        try:
            with user.exspec_client.stream(prompt, **sampling) as generation:
                for n, _ in enumerate(generation, 1):
                    if n >= cut:
                        break
                finished = generation.finished
        except ExspecError as exc:
            fire(user, "cancel:lost" if lost(exc) else "cancel:error", start, exc)
            return
        fire(user, "cancel:completed" if finished else "cancel:cancelled", start)

    class SoakGrpcUser(GrpcStreamUser):
        fixed_count = whole

    class SoakHttpUser(HttpSseUser):
        fixed_count = whole

    class CancellingGrpcUser(GrpcStreamUser):
        fixed_count = cancelling

    class CancellingHttpUser(HttpSseUser):
        fixed_count = cancelling

    # Replace the inherited task (locust collects a base class's tasks by function object).
    CancellingGrpcUser.tasks = [cancel_mid_stream]
    CancellingHttpUser.tasks = [cancel_mid_stream]

    BAD_SAMPLING = [{"temperature": -1.0}, {"top_p": 2.5}, {"max_tokens": 0}, {"top_k": -7},
                    {"seed": -1}, {"stop": [""]}, {"num_speculative_tokens": -2},
                    {"max_tokens": 10 ** 9}, {"frobnicate": True}, {"temperature": "hot"}]
    BAD_BODIES = [b"{not json", b"[]", b'{"text_input": 5}', b'{"max_tokens": 4}',
                  json.dumps({"text_input": "x", "sampling_parameters": "{]"}).encode()]

    class MalformedUser(User):
        """Requests the server must refuse with an error response (never serve, never drop)."""
        fixed_count = malformed
        wait_time = constant(0.2)
        protocol = "malformed"

        def on_start(self):
            from exspec_client import Client
            o = self.environment.parsed_options
            self.clients = {"grpc": Client(o.grpc_url, protocol="grpc", model=o.model,
                                           timeout_s=o.request_timeout),
                            "http": Client(self.host, protocol="http", model=o.model,
                                           timeout_s=o.request_timeout)}
            self.model, self.timeout = o.model, o.request_timeout

        def bad_sampling(self):
            protocol = random.choice(["grpc", "http"])
            self.protocol = protocol
            start = time.time()
            try:
                self.clients[protocol].stream("hello", **random.choice(BAD_SAMPLING)).collect()
            except ExspecError as exc:
                fire(self, "malformed:lost" if lost(exc) else "malformed:rejected", start,
                     exc if lost(exc) else None)
                return
            fire(self, "malformed:accepted", start, RuntimeError("a malformed request was served"))

        def bad_body(self):
            self.protocol = "http"
            parts = urlsplit(self.host)
            start = time.time()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
            try:
                conn.request("POST", f"/v2/models/{self.model}/generate_stream",
                             body=random.choice(BAD_BODIES),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                fire(self, "malformed:lost", start, exc)
                return
            finally:
                conn.close()
            if response.status == 200 and b'"error"' not in body:
                fire(self, "malformed:accepted", start,
                     RuntimeError(f"served: {body[:200]!r}"))
            else:
                fire(self, "malformed:rejected", start)

        tasks = [bad_sampling, bad_body]

    return {c.__name__: c for c in (SoakGrpcUser, SoakHttpUser, CancellingGrpcUser,
                                    CancellingHttpUser, MalformedUser)}


if __name__ == "__main__":
    sys.exit(main())
elif "locust" in sys.modules:   # imported by locust as its locustfile (not by soak_openai.py)
    globals().update(_define_users())
