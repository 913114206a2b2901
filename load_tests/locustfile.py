"""Locust users for exspec: gRPC streaming (GrpcStreamUser) and HTTP generate_stream
(HttpSseUser), both through exspec_client, so the load test exercises the shipped client.

Each generation is one locust request (type "grpc" or "http", name "generate_stream",
response_length = output tokens), plus custom entries under the same type:
  ttft  time to the first response that carried tokens;
  itl   inter-token latency, once per token after the first response: the gap to the previous
        response ÷ the tokens the later response carried (speculation delivers bursts).
A server error, a timeout or a stream that ends without its final response is a failure, with
the server's message.

gevent: locust monkey-patches the standard library, so tritonclient's receive thread and queue
become greenlets; grpcio is made cooperative with grpc.experimental.gevent.init_gevent() before
any channel exists. HTTP uses http.client over patched sockets. The run summary prints the most
requests each protocol had in flight at once, which shows that the users really overlap.

Options (command line or environment): --prompts-file/EXSPEC_PROMPTS (SpecBench question.jsonl
or one prompt a line; default the demo prompts), --max-tokens/EXSPEC_MAX_TOKENS,
--temperature/EXSPEC_TEMPERATURE, --top-p, --top-k, --seed, --ignore-eos,
--num-speculative-tokens/EXSPEC_NUM_SPECULATIVE_TOKENS, --model/EXSPEC_MODEL,
--grpc-url/EXSPEC_GRPC_URL (default: --host's port + 1, Triton's layout),
--requests-per-user/EXSPEC_REQUESTS_PER_USER (0: until -t ends; otherwise the run quits once
every user has finished its share), --request-timeout/EXSPEC_REQUEST_TIMEOUT.

    locust -f load_tests/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 \
        --csv runs/load/demo --max-tokens 64
(load_tests/run.py wraps this and prints a summary table.)
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import gevent
import locust.stats
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.exception import StopUser

grpc_gevent.init_gevent()

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "client"))   # a checkout works without installing the client

from exspec_client import Client  # noqa: E402
from exspec_client.types import DEFAULT_MODEL  # noqa: E402
from exspec_client.prompts import load_prompts  # noqa: E402

DEMO_PROMPTS = REPO / "model_repository" / "exspec" / "1" / "demo" / "prompts.jsonl"


@events.init_command_line_parser.add_listener
def _options(parser):
    add = parser.add_argument
    add("--prompts-file", env_var="EXSPEC_PROMPTS", default=str(DEMO_PROMPTS),
        help="SpecBench question.jsonl or one prompt a line")
    add("--max-tokens", env_var="EXSPEC_MAX_TOKENS", type=int, default=64)
    add("--temperature", env_var="EXSPEC_TEMPERATURE", type=float, default=0.0)
    add("--top-p", env_var="EXSPEC_TOP_P", type=float, default=None)
    add("--top-k", env_var="EXSPEC_TOP_K", type=int, default=None)
    add("--seed", env_var="EXSPEC_SEED", type=int, default=None)
    add("--ignore-eos", env_var="EXSPEC_IGNORE_EOS", action="store_true", default=False,
        help="every request generates exactly --max-tokens")
    add("--num-speculative-tokens", env_var="EXSPEC_NUM_SPECULATIVE_TOKENS", type=int,
        default=None, help="per-request cap on k (0: no speculation)")
    add("--model", env_var="EXSPEC_MODEL", default=DEFAULT_MODEL)
    add("--grpc-url", env_var="EXSPEC_GRPC_URL", default=None,
        help="gRPC host:port (default: --host's port + 1)")
    add("--requests-per-user", env_var="EXSPEC_REQUESTS_PER_USER", type=int, default=0)
    add("--request-timeout", env_var="EXSPEC_REQUEST_TIMEOUT", type=float, default=300.0)


class Tracker:
    """Per protocol: requests in flight now and the most at once; users that finished their
    share (the run quits when all have)."""

    def __init__(self, environment):
        self.environment = environment
        self.in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}
        self.users_started = 0
        self.users_done = 0

    def user_started(self) -> int:
        self.users_started += 1
        return self.users_started

    def begin(self, protocol):
        self.in_flight[protocol] = self.in_flight.get(protocol, 0) + 1
        self.max_in_flight[protocol] = max(self.max_in_flight.get(protocol, 0),
                                           self.in_flight[protocol])

    def end(self, protocol):
        self.in_flight[protocol] -= 1

    def user_done(self):
        self.users_done += 1
        if self.users_done >= self.environment.parsed_options.num_users:
            gevent.spawn_later(0.1, self.environment.runner.quit)


@events.init.add_listener
def _init(environment, **_):
    environment.exspec = Tracker(environment)
    _refuse_unreachable(environment)


def grpc_url(options, host: str) -> str:
    if options.grpc_url:
        return options.grpc_url
    parts = urlsplit(host)
    return f"{parts.hostname}:{(parts.port or 8000) + 1}"


def _refuse_unreachable(environment) -> None:
    """A wrong address would make every user fail in a tight loop (seen: 28,000 failed requests
    in 40 s, then a gevent LoopExit): stop at start instead, naming what cannot be reached."""
    options, host = environment.parsed_options, environment.host
    if options is None or not host:
        return
    targets = {}
    for cls in environment.user_classes:
        if issubclass(cls, GrpcStreamUser):
            targets["gRPC"] = grpc_url(options, host)
        elif issubclass(cls, HttpSseUser):
            parts = urlsplit(host)
            targets["HTTP"] = f"{parts.hostname}:{parts.port or 80}"
    problems = []
    for name, address in targets.items():
        hostname, _, port = address.rpartition(":")
        try:
            socket.create_connection((hostname.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            problems.append(f"{name} {address}: {exc}")
    if problems:
        print("exspec: cannot reach the server, not starting the load test:\n  "
              + "\n  ".join(problems) + "\n(check --host and --grpc-url)", file=sys.stderr, flush=True)
        raise SystemExit(2)


@events.quitting.add_listener
def _report(environment, **_):
    tracker = getattr(environment, "exspec", None)
    if tracker is None:
        return
    print(f"exspec: most requests in flight at once: {tracker.max_in_flight}", flush=True)
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        # locust's CSV writer rewrites the files every CSV_STATS_INTERVAL_SEC and does not write
        # again on shutdown: give it one more turn, so requests that ended in the last second
        # are in the CSVs too.
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.25)
        Path(f"{prefix}_exspec.json").write_text(json.dumps(
            {"max_in_flight": tracker.max_in_flight, "users_done": tracker.users_done}))


class ExspecUser(User):
    abstract = True
    protocol = ""
    wait_time = constant(0)

    def on_start(self):
        o = self.environment.parsed_options
        self.prompts = load_prompts(o.prompts_file)
        # Users start at different prompts, then walk the file in order.
        self.position = 7 * self.environment.exspec.user_started() % len(self.prompts)
        self.sent = 0
        self.sampling = {"max_tokens": o.max_tokens, "temperature": o.temperature,
                         "top_p": o.top_p, "top_k": o.top_k, "seed": o.seed,
                         "num_speculative_tokens": o.num_speculative_tokens}
        if o.ignore_eos:
            self.sampling["ignore_eos"] = True
        self.exspec_client = Client(self.url(o), protocol=self.protocol, model=o.model,
                                    timeout_s=o.request_timeout)

    def url(self, options) -> str:
        return self.host

    @task
    def generate(self):
        options = self.environment.parsed_options
        if options.requests_per_user and self.sent >= options.requests_per_user:
            self.environment.exspec.user_done()
            raise StopUser()
        prompt = self.prompts[self.position % len(self.prompts)]
        self.position += 1
        self.sent += 1
        fire = self.environment.events.request.fire
        tracker = self.environment.exspec
        tracker.begin(self.protocol)
        start = time.time()
        try:
            with self.exspec_client.stream(prompt, **self.sampling) as generation:
                for _ in generation:
                    pass
                result = generation.result
                if not generation.finished:
                    raise RuntimeError("the stream ended without a final response")
        except Exception as exc:   # recorded as a failure, with the server's message
            fire(request_type=self.protocol, name="generate_stream",
                 response_time=(time.time() - start) * 1000, response_length=0,
                 exception=exc, context={})
            return
        finally:
            tracker.end(self.protocol)
        fire(request_type=self.protocol, name="generate_stream",
             response_time=result.latency_s * 1000, response_length=result.num_output_tokens,
             exception=None, context={})
        if result.ttft_s is not None:
            fire(request_type=self.protocol, name="ttft", response_time=result.ttft_s * 1000,
                 response_length=0, exception=None, context={})
        for gap in result.inter_token_latencies():
            fire(request_type=self.protocol, name="itl", response_time=gap * 1000,
                 response_length=0, exception=None, context={})


class GrpcStreamUser(ExspecUser):
    """One gRPC bidirectional stream per generation."""
    protocol = "grpc"

    def url(self, options) -> str:
        return grpc_url(options, self.host)


class HttpSseUser(ExspecUser):
    """POST /v2/models/<model>/generate_stream, server-sent events read as they arrive."""
    protocol = "http"
