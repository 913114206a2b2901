"""exspec-openai for real: Triton's OpenAI frontend (r26.06) in front of the exspec backend, on
this suite's model repository. Cancellation when a client goes away, errors as HTTP statuses and
SSE error events, the temporary folder gone after SIGTERM.

The frontend needs Triton's in-process bindings, built from Triton's sources (docs/serving.md, "Triton's
OpenAI frontend"), so CI does not run it: set TRITON_OPENAI_FRONTEND (its openai_frontend/
folder) and EXSPEC_OPENAI_PYTHON (the Python with its requirements and the bindings).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from serverkit import REPO, wait_for

FRONTEND = os.environ.get("TRITON_OPENAI_FRONTEND")
FRONTEND_PYTHON = os.environ.get("EXSPEC_OPENAI_PYTHON")
pytestmark = pytest.mark.skipif(
    not (FRONTEND and FRONTEND_PYTHON),
    reason="set TRITON_OPENAI_FRONTEND and EXSPEC_OPENAI_PYTHON to run Triton's OpenAI frontend")

MODEL = "exspec"
K = 4            # the exspec model's num_speculative_tokens: a step commits at most K + 1 tokens


class OpenAIServer:
    """exspec-openai on a free port: `url`, the metrics in `scrape`, `stop()` by SIGTERM."""

    def __init__(self, repository: Path, log: Path):
        from exspec.serving.ports import reserve_ports
        with reserve_ports(1, host="127.0.0.1") as (port,):
            self.port = port
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exspec.serving.openai_frontend", "--model-repository",
             str(repository), "--frontend", FRONTEND, "--python", FRONTEND_PYTHON,
             "--openai-port", str(port), "--", "--model-control-mode", "explicit",
             "--load-model", MODEL],
            cwd=REPO / "backend", stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(self.ready, timeout_s=300, what=f"exspec-openai to be ready (log: {log})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"exspec-openai exited {self.proc.returncode}:\n"
                                 + self.log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(self.url + "/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def scrape(self, name: str, **labels) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        values = [float(line.rsplit(" ", 1)[1]) for line in lines
                  if line.startswith(name + "{")
                  and all(f'{k}="{v}"' in line for k, v in {"model": MODEL, **labels}.items())]
        assert values, f"{name}{labels} not in the frontend's /metrics"
        return sum(values)

    def temporary_folder(self) -> Path:
        """The folder exspec-openai laid the backend out in (its command line names it)."""
        for line in self.log.read_text().splitlines():
            if line.startswith("exspec-openai: "):
                return Path(line.split()[5])
        raise AssertionError("exspec-openai printed no command")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def openai_server(repository, tmp_path_factory):
    server = OpenAIServer(repository, tmp_path_factory.mktemp("openai") / "frontend.log")
    yield server
    if server.proc.poll() is None:
        server.stop()


def post(server, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.connection = conn
    return response


def events(response: http.client.HTTPResponse):
    """The SSE data payloads of a streamed response, as they arrive."""
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def wait_idle(server, what: str):
    wait_for(lambda: server.scrape("exspec:num_requests_running") == 0, timeout_s=30, what=what)


def test_closed_streams_are_cancelled_within_a_tick(openai_server):
    """The issue's scenario: several streams (chat and completions) of large max_tokens, each
    closed after a few chunks. Each is cancelled, counted so, and generates about nothing more."""
    server = openai_server
    wait_idle(server, "an idle server")
    cancelled = server.scrape("exspec:requests_total", outcome="cancelled")
    generated = server.scrape("exspec:generation_tokens_total")   # counted as requests end
    streams, chunks_read = [], 3
    for i in range(4):
        if i % 2:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": f"hello {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": f"hello {i}"}
        response = post(server, path, {"model": MODEL, "stream": True, **LONG, **body})
        assert response.status == 200, response.read()
        chunks = events(response)
        for _ in range(chunks_read):
            next(chunks)
        streams.append(response)
    wait_for(lambda: server.scrape("exspec:num_requests_running") == len(streams),
             timeout_s=10, what="every stream to be running")
    for response in streams:
        response.connection.sock.shutdown(2)   # the client goes away mid-stream
        response.connection.close()
    t0 = time.monotonic()
    wait_for(lambda: server.scrape("exspec:num_requests_running") == 0, timeout_s=10,
             what="the closed streams to stop running")
    idle_s = time.monotonic() - t0
    assert server.scrape("exspec:requests_total", outcome="cancelled") == cancelled + len(streams)
    # A chunk is one engine step (1 to K + 1 tokens): the clients read at most chunks_read
    # steps each, and each stream may run about one more step after its close.
    per_request = (server.scrape("exspec:generation_tokens_total") - generated) / len(streams)
    assert per_request <= (chunks_read + 2) * (K + 1), (
        f"{per_request:.1f} tokens per request for {chunks_read} chunks read (max_tokens 480)")
    assert idle_s < 2.0, f"running requests took {idle_s:.1f} s to return to 0"
    for role in ("allocated", "reserved"):
        assert server.scrape("exspec:kv_cache_tokens", role=role) == 0, role


def test_a_client_gone_before_a_plain_answer_cancels_it(openai_server):
    """Not streamed: the frontend waits for the whole answer, so only the disconnect watcher
    can stop it."""
    server = openai_server
    wait_idle(server, "an idle server")
    cancelled = server.scrape("exspec:requests_total", outcome="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": MODEL, "prompt": "hello", **LONG}))
    wait_for(lambda: server.scrape("exspec:num_requests_running") == 1, timeout_s=30,
             what="the request to start")
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: server.scrape("exspec:requests_total", outcome="cancelled") == cancelled + 1,
             timeout_s=10, what="the abandoned request to be cancelled")
    wait_idle(server, "the abandoned request to stop running")


def test_bad_input_is_a_400_with_exspec_s_message(openai_server):
    """A negative seed passes the frontend's schema (OpenAI's allows it) and exspec refuses it."""
    response = post(openai_server, "/v1/completions", {
        "model": MODEL, "prompt": "hello", "max_tokens": 4, "seed": -1})
    body = json.loads(response.read())
    assert response.status == 400, (response.status, body)
    assert "seed" in body["detail"], body


def test_frequency_penalty_is_answered(openai_server):
    response = post(openai_server, "/v1/completions", {
        "model": MODEL, "prompt": "hello", "max_tokens": 4, "frequency_penalty": 0.5,
        "presence_penalty": 0.5, "logit_bias": {"5": -100}})
    body = json.loads(response.read())
    assert response.status == 200, (response.status, body)
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1, body


def test_a_streamed_error_ends_with_an_sse_error_event(openai_server):
    """Streamed echo is refused by exspec (as by the vLLM backend); the stream has started, so
    the refusal comes as OpenAI's error event and the stream ends cleanly."""
    response = post(openai_server, "/v1/completions", {
        "model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True, "echo": True})
    assert response.status == 200
    payloads = list(events(response))          # reads to the end: no cut connection
    assert payloads[-1] == "[DONE]", payloads
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == 400 and "exclude_input_in_output" in error["message"], error


def test_top_k_is_refused_by_the_frontend_itself(openai_server):
    """The frontend's request schemas forbid fields they do not list, and top_k is not among
    them: it never reaches exspec (docs/serving.md). Fails, and should be changed, once it does."""
    response = post(openai_server, "/v1/completions", {
        "model": MODEL, "prompt": "hello", "max_tokens": 4, "top_k": 1})
    body = response.read().decode()
    assert response.status == 422 and "top_k" in body, (response.status, body)


def test_sigterm_removes_the_temporary_folder(repository, tmp_path):
    server = OpenAIServer(repository, tmp_path / "frontend.log")
    folder = server.temporary_folder()
    assert folder.is_dir() and folder.name.startswith("exspec-openai-")
    assert server.stop() == 0
    assert not folder.exists(), f"{folder} was left behind"
