"""Pod simulation: the rendered CPU pod's container (command arguments, env, ports, mounts,
probes, preStop) run on loopback with the real tritonserver and a tiny model pair."""
from __future__ import annotations

import re
import time

import pytest

from deploykit import deep_merge, load_values, one, render
from pods import pair  # noqa: F401  (a fixture)

LONGEST_STREAM_S = 10     # the drain deadline in this pod: long enough for a loaded CI machine
PRE_STOP_S = 2
TICK_DELAY_S = 0.03       # 3900 tokens take >= 23 s even if every draft is accepted (k = 5)


@pytest.fixture(scope="module")
def docs(pair):
    from pods import pod_values
    # Ticks of at least TICK_DELAY_S: the "long" stream must outlast the drain deadline however
    # fast the engine gets (it once finished 3900 tokens in under 10 s and the test broke).
    values = deep_merge(load_values("cpu"), pod_values(
        pair, fault_injection={"tick_delay_s": TICK_DELAY_S}))
    values = deep_merge(values, {"longestStreamSeconds": LONGEST_STREAM_S,
                                 "drain": {"preStopSeconds": PRE_STOP_S}})
    return render(values)


@pytest.fixture(scope="module")
def pod(docs, pair, tmp_path_factory):
    from pods import SimulatedPod
    pod = SimulatedPod(docs, tmp_path_factory.mktemp("pod"), pair).start()
    yield pod
    pod.stop()


def test_probes_answer_within_their_budgets(pod):
    took = pod.wait_started()
    spec = pod.container["startupProbe"]
    assert took < spec["periodSeconds"] * spec["failureThreshold"]
    assert pod.probe("readinessProbe"), pod.log_tail()
    assert pod.probe("livenessProbe"), pod.log_tail()


def test_metrics_carry_the_autoscaling_gauges(pod):
    pod.wait_started()
    autoscaling = {m["pods"]["metric"]["name"] for m in
                   one(render(load_values("gpu")), "HorizontalPodAutoscaler")["spec"]["metrics"]}
    query = one(render(load_values("multi-gpu")), "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    autoscaling |= set(re.findall(r"exspec:[a-z_]+", query))
    text = pod.metrics()
    for name in sorted(autoscaling | {"exspec:num_requests_running"}):
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model="exspec"[^}}]*\}} ', text, re.M), \
            f"{name} with model=\"exspec\" is not on {pod.url('metrics')}/metrics"


def test_sigterm_mid_stream_drains_within_the_grace_period(pod):
    import threading

    import tritonclient.grpc as grpcclient

    from grpc_calls import generate, in_thread
    pod.wait_started()
    grace = pod.spec["terminationGracePeriodSeconds"]
    url = pod.url("grpc")
    # One stream far longer than the drain deadline; then, at the token rate measured beside
    # it, one that needs about 2 s: in flight when the drain starts, done well before its end.
    long_started, short_started = threading.Event(), threading.Event()
    long = in_thread(generate, grpcclient.InferenceServerClient(url), "hello", 3900,
                     started=long_started)
    assert long_started.wait(60), pod.log_tail()
    begin = time.monotonic()
    probe = generate(grpcclient.InferenceServerClient(url), "def f(x):", 30)
    assert probe.error is None, probe
    rate = 30 / (probe.ended_at - begin)
    short = in_thread(generate, grpcclient.InferenceServerClient(url), "def add(a, b):",
                      max(8, int(rate * 2)), started=short_started)
    assert short_started.wait(60), pod.log_tail()   # accepted before the drain file exists

    # The kubelet: preStop, then SIGTERM to PID 1 when the hook returns.
    deletion = time.monotonic()
    hook = pod.pre_stop()
    time.sleep(1.2)          # the model notices the drain file within half a second
    refused = generate(grpcclient.InferenceServerClient(url), "late", 4, timeout_s=30)
    assert hook.wait(PRE_STOP_S + 10) == 0
    pod.sigterm()

    short_done, long_done = short.result(), long.result()
    assert short_done.final and short_done.error is None, short_done
    assert short_done.ended_at > deletion, "the short stream ended before the drain began"
    assert long_done.final and long_done.error, "the long stream ended without an error"
    assert "drain deadline" in long_done.error and "retry on another server" in long_done.error, \
        long_done.error
    # Ended by the model at the deadline, not cut by Triton's exit timeout.
    assert long_done.ended_at - deletion < LONGEST_STREAM_S + 3, long_done.ended_at - deletion
    # (a gRPC stream carries an error's message, not its code: the code is UNAVAILABLE)
    assert refused.error and "draining" in refused.error and "retry on another server" in refused.error, \
        refused

    code = pod.process.wait(grace)
    took = time.monotonic() - deletion
    print(f"deletion to exit: {took:.1f} s (grace {grace} s); long stream ended after "
          f"{long_done.ended_at - deletion:.1f} s, short after {short_done.ended_at - deletion:.1f} s")
    assert took <= grace, f"pod took {took:.1f} s to stop; grace is {grace} s"
    assert code == 0, f"tritonserver exit code {code}:\n{pod.log_tail()}"
    log = pod.log.read_text(errors="replace")
    for line in ("exspec: draining", "exspec: drained", "exspec: model exspec finalized"):
        assert line in log, f"{line!r} not in the log:\n{pod.log_tail()}"
