"""Two replicas on loopback behind HAProxy: a TCP (layer 4) balancer pins every stream of one
client channel to one server; an HTTP/2-aware one spreads them stream by stream. This is why
docs/deploy.md asks for an HTTP/2-aware ingress for gRPC, or client-side round robin. The shipped
client (exspec_client) opens one stream per generation and spreads behind the HTTP/2 one."""
from __future__ import annotations

import concurrent.futures as cf
import socket
import subprocess
import time
import urllib.request

import pytest

from deploykit import need_binary, need_module
from grpc_calls import generate

STREAMS = 8


def build_repository(root, pair):
    import json
    from deploykit import REPO
    models = root / "models"
    (models / "exspec" / "1").mkdir(parents=True)
    (models / "exspec" / "config.pbtxt").write_text(
        (REPO / "model_repository" / "exspec" / "config.pbtxt").read_text())
    (models / "exspec" / "1" / "model.json").write_text(json.dumps({
        "target_model": str(pair / "target"), "draft_model": str(pair / "draft"),
        "tokenizer": str(pair / "tokenizer"), "max_batch_size": 4, "max_num_seqs": 8}))
    return models


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    need_binary("haproxy")
    need_module("tritonclient.grpc")
    from exspec.serving.launcher import TritonServer
    from pods import build_pair
    root = tmp_path_factory.mktemp("replicas")
    models = build_repository(root, build_pair(root / "pair"))
    servers = [TritonServer(models, free_ports=True, log_path=root / f"replica{i}.log",
                            startup_timeout_s=300, work_dir=root / f"work{i}") for i in range(2)]
    try:
        with cf.ThreadPoolExecutor(2) as pool:      # both replicas load at once
            list(pool.map(lambda s: s.start(), servers))
        yield servers
    finally:
        for server in servers:
            server.stop()
            server.cleanup()


@pytest.fixture(scope="module")
def haproxy(replicas, tmp_path_factory):
    from exspec.serving.ports import reserve_ports
    binary = need_binary("haproxy")
    reservation = reserve_ports(2, host="127.0.0.1")   # held until haproxy listens on both
    tcp_port, h2_port = reservation.ports
    backends = [s.urls["grpc"] for s in replicas]
    config = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    config.write_text(f"""
defaults
    timeout connect 5s
    timeout client 120s
    timeout server 120s

# Layer 4: a TCP connection goes to one server, and so do all its HTTP/2 streams.
frontend grpc_tcp
    mode tcp
    bind 127.0.0.1:{tcp_port}
    default_backend replicas_tcp
backend replicas_tcp
    mode tcp
    balance roundrobin
    server a {backends[0]}
    server b {backends[1]}

# Layer 7, HTTP/2 on both sides (h2c): each gRPC stream is a request, balanced on its own.
frontend grpc_h2
    mode http
    bind 127.0.0.1:{h2_port} proto h2
    default_backend replicas_h2
backend replicas_h2
    mode http
    balance roundrobin
    server a {backends[0]} proto h2
    server b {backends[1]} proto h2
""")
    check = subprocess.run([binary, "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    process = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        for port in (tcp_port, h2_port):
            wait_listening(port, process)
        reservation.release()
        yield {"tcp": f"127.0.0.1:{tcp_port}", "h2": f"127.0.0.1:{h2_port}"}
    finally:
        reservation.release()
        process.terminate()
        process.wait(10)


def wait_listening(port: int, process, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"haproxy exited: {process.stderr.read()}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"haproxy does not listen on {port}")


def served(server) -> float:
    """Requests this replica finished (any outcome but rejected)."""
    with urllib.request.urlopen(server.urls["metrics"], timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("exspec:requests_total{") and 'outcome="rejected"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def streams_per_replica(replicas, url: str) -> list[int]:
    """STREAMS generations, one gRPC stream each, one after another on ONE client channel."""
    import tritonclient.grpc as grpcclient
    before = [served(s) for s in replicas]
    client = grpcclient.InferenceServerClient(url)
    try:
        for i in range(STREAMS):
            result = generate(client, f"def f{i}(x):", 4, timeout_s=60)
            assert result.final and result.error is None, result
    finally:
        client.close()
    time.sleep(0.5)       # the metrics are updated on the send thread after the final response
    return [int(served(s) - b) for s, b in zip(replicas, before)]


def test_tcp_balancer_pins_one_channels_streams_to_one_replica(replicas, haproxy):
    counts = streams_per_replica(replicas, haproxy["tcp"])
    assert sum(counts) == STREAMS and sorted(counts) == [0, STREAMS], \
        f"streams per replica through a TCP balancer: {counts}"


def test_http2_balancer_spreads_one_channels_streams(replicas, haproxy):
    counts = streams_per_replica(replicas, haproxy["h2"])
    assert sum(counts) == STREAMS and min(counts) >= STREAMS // 4, \
        f"streams per replica through an HTTP/2 balancer: {counts}"


def test_the_shipped_clients_generations_spread(replicas, haproxy):
    """exspec_client.Client, as users call it: one Client, STREAMS generations in a row behind
    the HTTP/2-aware balancer, each its own stream, spread over both replicas. (Behind the TCP
    balancer its per-generation channels spread only by chance: gRPC may reuse a connection.)"""
    from exspec_client import Client
    before = [served(s) for s in replicas]
    client = Client(haproxy["h2"], model="exspec", timeout_s=60)
    for i in range(STREAMS):
        result = client.generate(f"def f{i}(x):", max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4, result
    time.sleep(0.5)
    counts = [int(served(s) - b) for s, b in zip(replicas, before)]
    assert sum(counts) == STREAMS and min(counts) >= STREAMS // 4, \
        f"the shipped client's generations per replica through HTTP/2: {counts}"
