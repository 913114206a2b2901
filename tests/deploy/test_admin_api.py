"""Triton's administrative APIs behind the chart's admin key, on a real tritonserver started with
the rendered pod's arguments (pods.SimulatedPod: the key comes from the rendered Secret through
the container env and `$(EXSPEC_ADMIN_KEY)`). Without the key, shared-memory registration,
model load / unload and trace-setting changes are refused over HTTP and gRPC and the served
model is unchanged; with it they work; probes, health, metadata, inference and the metrics
scrape need no key."""
from __future__ import annotations

import base64
import json
import os
import time
import urllib.request

import pytest
import yaml

from deploykit import CHART, deep_merge, load_values, one, render
from pods import pair  # noqa: F401  (a fixture)

HEADER = yaml.safe_load((CHART / "values.yaml").read_text())["adminApi"]["header"]
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def docs(pair):
    from pods import pod_values
    # Explicit model control, so that a load or unload that gets past the key check can
    # succeed: in Triton's default mode (the chart's) it is refused whatever the headers.
    values = deep_merge(load_values("cpu"), pod_values(pair))
    values["extraArgs"] = ["--model-control-mode=explicit", "--load-model=*"]
    return render(values)


@pytest.fixture(scope="module")
def key(docs) -> str:
    """What an operator reads with kubectl get secret ... | base64 -d."""
    return base64.b64decode(one(docs, "Secret", "-admin-key")["data"]["admin-key"]).decode()


@pytest.fixture(scope="module")
def pod(docs, pair, tmp_path_factory):
    from pods import SimulatedPod
    pod = SimulatedPod(docs, tmp_path_factory.mktemp("pod"), pair).start()
    try:
        pod.wait_started()
        yield pod
    finally:
        pod.stop()


def client(pod, protocol: str):
    if protocol == "http":
        import tritonclient.http as httpclient
        return httpclient.InferenceServerClient(pod.url("http"))
    import tritonclient.grpc as grpcclient
    return grpcclient.InferenceServerClient(pod.url("grpc"))


def header_name(protocol: str) -> str:
    """Triton prefixes a gRPC restriction's header (gRPC metadata keys are lower case)."""
    return HEADER if protocol == "http" else f"triton-grpc-protocol-{HEADER}"


def admin(protocol: str, key: str) -> dict:
    return {header_name(protocol): key}


def as_json(protocol: str) -> dict:
    return {"as_json": True} if protocol == "grpc" else {}


def refused(protocol: str, call, *args, **kwargs) -> None:
    """`call` fails at Triton's key check (not for some other reason)."""
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    assert f"restricted, expecting header '{header_name(protocol)}'" in str(info.value), \
        f"{call.__name__} failed for another reason: {info.value}"


def generate_http(pod, prompt: str, max_tokens: int = 4) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"http://{pod.url('http')}/v2/models/exspec/generate",
                                     data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["text_output"]


def serves(pod, protocol: str) -> bool:
    """One generation without the key succeeds over `protocol`."""
    if protocol == "http":
        return bool(generate_http(pod, "def add(a, b):"))
    import tritonclient.grpc as grpcclient

    from grpc_calls import generate
    done = generate(grpcclient.InferenceServerClient(pod.url("grpc")), "def add(a, b):", 4)
    return done.final and done.error is None and done.responses > 0


def wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.25)


# -- what stays open -------------------------------------------------------------------------
def test_probes_and_the_metrics_scrape_need_no_key(pod):
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert pod.probe(probe), f"{probe} fails:\n{pod.log_tail()}"
    assert "exspec:num_requests_waiting" in pod.metrics()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_health_metadata_and_inference_need_no_key(pod, protocol):
    c = client(pod, protocol)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("exspec")
    assert c.get_server_metadata(**as_json(protocol))["name"] == "triton"
    assert c.get_model_metadata("exspec", **as_json(protocol))["name"] == "exspec"
    assert serves(pod, protocol)


# -- what needs the key ----------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_admin_group_refuses_without_the_key_and_answers_with_it(pod, key, protocol):
    """Model config, statistics, logging and the repository index: read-only calls of the
    groups that the tests below do not change."""
    c = client(pod, protocol)
    calls = [(c.get_model_config, ("exspec",)), (c.get_inference_statistics, ("exspec",)),
             (c.get_log_settings, ()), (c.get_model_repository_index, ())]
    for call, args in calls:
        refused(protocol, call, *args)
        refused(protocol, call, *args, headers=admin(protocol, "not-" + key))
        assert call(*args, headers=admin(protocol, key)) is not None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_registration_needs_the_key(pod, key, protocol):
    import tritonclient.utils.shared_memory as shm
    c = client(pod, protocol)
    with_key = admin(protocol, key)

    def regions() -> set[str]:
        status = c.get_system_shared_memory_status(headers=with_key, **as_json(protocol))
        return set(status.get("regions", {})) if protocol == "grpc" else {r["name"] for r in status}

    name, shm_key = f"exspec-test-{protocol}", f"/exspec_test_{protocol}_{os.getpid()}"
    handle = shm.create_shared_memory_region(name, shm_key, 64)
    try:
        refused(protocol, c.get_system_shared_memory_status)
        refused(protocol, c.register_system_shared_memory, name, shm_key, 64)
        assert name not in regions(), "registered without the key"
        c.register_system_shared_memory(name, shm_key, 64, headers=with_key)
        assert name in regions()
        refused(protocol, c.unregister_system_shared_memory, name)
        assert name in regions(), "unregistered without the key"
        c.unregister_system_shared_memory(name, headers=with_key)
        assert name not in regions()
    finally:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_model_load_and_unload_need_the_key(pod, key, protocol):
    c = client(pod, protocol)
    with_key = admin(protocol, key)
    config = c.get_model_config("exspec", headers=with_key, **as_json(protocol))
    changed = dict(config.get("config", config))
    changed["parameters"] = {**changed.get("parameters", {}),
                             "drain_timeout_s": {"string_value": "1"}}
    refused(protocol, c.unload_model, "exspec")
    refused(protocol, c.load_model, "exspec", config=json.dumps(changed))
    # The served model is unchanged: still ready, same config, still generating.
    assert c.is_model_ready("exspec")
    assert c.get_model_config("exspec", headers=with_key, **as_json(protocol)) == config
    assert serves(pod, protocol)

    # With the key: unload the unary front model and load it back.
    c.unload_model("exspec_unary", headers=with_key)
    wait_for(lambda: not c.is_model_ready("exspec_unary"), "exspec_unary to unload")
    c.load_model("exspec_unary", headers=with_key)
    wait_for(lambda: c.is_model_ready("exspec_unary"), "exspec_unary to load again")
    assert c.is_model_ready("exspec")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_trace_settings_change_needs_the_key(pod, key, protocol):
    c = client(pod, protocol)
    with_key = admin(protocol, key)

    def trace_rate(settings: dict) -> str:
        return settings["settings"]["trace_rate"]["value"][0] if protocol == "grpc" \
            else settings["trace_rate"]

    before = trace_rate(c.get_trace_settings(headers=with_key, **as_json(protocol)))
    wanted = str(int(before) + 7)
    refused(protocol, c.get_trace_settings)
    refused(protocol, c.update_trace_settings, settings={"trace_rate": wanted})
    assert trace_rate(c.get_trace_settings(headers=with_key, **as_json(protocol))) == before
    try:
        updated = c.update_trace_settings(settings={"trace_rate": wanted}, headers=with_key,
                                          **as_json(protocol))
        assert trace_rate(updated) == wanted
        assert trace_rate(c.get_trace_settings(headers=with_key, **as_json(protocol))) == wanted
    finally:
        c.update_trace_settings(settings={"trace_rate": before}, headers=with_key)


def test_the_key_is_not_written_to_the_server_log(pod, key):
    assert key not in pod.log.read_text(errors="replace")
