"""The client balances generations over several servers when its gRPC target names them (a
Kubernetes headless Service as dns:///name:port, or a static ipv4: list): one stream per
generation on a round-robin channel, so no single connection pins every stream to one pod."""
from __future__ import annotations

import pytest

from exspec_client import Client

from loadkit import Metrics, TritonServer, build_repository

GENERATIONS = 16


@pytest.fixture(scope="module")
def second_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("exspec-load-2")
    with TritonServer(build_repository(root), free_ports=True, startup_timeout_s=300,
                      log_path=root / "tritonserver.log") as server:
        yield server


def served(server) -> float:
    return sum(Metrics(server).outcomes().values())


def test_dns_target_reaches_the_server(load_server):
    host_port = load_server.urls["grpc"]
    plain = Client(host_port, model="exspec", timeout_s=60).generate("import os\n", max_tokens=8)
    balanced = Client(f"dns:///{host_port}", model="exspec", timeout_s=60).generate(
        "import os\n", max_tokens=8)
    assert balanced.token_ids == plain.token_ids and len(plain.token_ids) == 8


def test_generations_spread_over_every_server_the_target_names(load_server, second_server):
    servers = (load_server, second_server)
    before = [served(s) for s in servers]
    target = "ipv4:" + ",".join(s.urls["grpc"] for s in servers)
    client = Client(target, model="exspec", timeout_s=60)
    for i in range(GENERATIONS):
        assert len(client.generate(f"def f{i}(x):\n", max_tokens=4).token_ids) == 4
    for server in servers:
        Metrics(server).wait_pool_empty()
    counts = [served(s) - b for s, b in zip(servers, before)]
    assert sum(counts) == GENERATIONS
    assert min(counts) >= 1, f"every generation landed on one server: {counts}"
