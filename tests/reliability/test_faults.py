"""Injected faults (model.json fault_injection, off by default) on a real server: a failing model
forward ends at most the request stepping alone when it raised (the rows of a shared step are
prefilled again and stepped alone), a request that raises in every step ends alone while the
requests batched with it are served exactly, and the engine carries on; a dead engine
thread or a tick past tick_timeout_s ends every in-flight and every new request with UNAVAILABLE
(never a hang) and logs the traceback. Other models on the server are untouched throughout."""
from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from reliabilitykit import (MODELS, TritonServer, clients, ready, scrape, server_log, wait_for,
                            write_model)

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n", "The quick brown fox", "hello world",
           "import os\nimport sys\n", "class Engine:\n", "Grüße, naïve café", "emoji: 🚀"]
MAX_TOKENS = 24
SAMPLING = {"max_tokens": MAX_TOKENS, "ignore_eos": True}


def one(server, model, prompt, timeout_s=60.0, **request):
    request.setdefault("sampling", SAMPLING)
    return clients.grpc_stream(server.urls["grpc"], model, [{"prompt": prompt, **request}],
                               timeout_s=timeout_s)[0]


def concurrently(server, model, prompts, **request):
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: one(server, model, p, **request), prompts))


def assert_one_final(call, what):
    finals = [r for r in call.responses if r.final]
    assert len(finals) == 1 and call.responses[-1].final, (
        f"{what}: expected exactly one final response, last; got {call.responses}")


@pytest.fixture(scope="module")
def reference(rel_server):
    """Greedy ids from the fault-free model (same pair: output-equivalent whatever the batch)."""
    return {p: one(rel_server, "limits", p).ids() for p in PROMPTS}


FAULTS = {"RuntimeError: injected fault: exception in a model forward": "exception",
          "OutOfMemoryError: injected fault: out of memory": "out of memory"}


def test_failing_forward_fails_at_most_a_lone_row_and_the_engine_carries_on(rel_server, reference):
    model = "faulty"
    calls = [c for _ in range(3) for c in concurrently(rel_server, model, PROMPTS)]
    failed, served, kinds = [], [], set()
    for i, call in enumerate(calls):
        prompt = PROMPTS[i % len(PROMPTS)]
        assert_one_final(call, f"{model} request {i} ({prompt!r})")
        last = call.responses[-1]
        if last.error:
            kind = [k for needle, k in FAULTS.items() if needle in last.error]
            assert kind and last.error.startswith("generation failed: "), (
                f"request {i}: unexpected error: {last.error}")
            kinds.update(kind)
            failed.append(i)
        else:
            assert call.ids() == reference[prompt], (
                f"request {i} ({prompt!r}) survived the fault but its output differs from the "
                f"fault-free model: {call.ids()} vs {reference[prompt]}")
            served.append(i)
    isolated = scrape(rel_server, "exspec:isolated_rows_total", model=model)
    assert failed or isolated, f"{model}: no request hit the injected fault; lower its *_every"
    assert served, f"{model}: every request failed; the fault did not stay within one row"
    # The engine keeps serving: within a few tries (a later forward may fault again) a new
    # request completes, and the server counted each failure once.
    short = {"max_tokens": 2, "ignore_eos": True}   # a handful of forwards each
    later = [one(rel_server, model, PROMPTS[0], sampling=short) for _ in range(5)]
    assert any(c.ids() == reference[PROMPTS[0]][:2] for c in later), (
        f"{model} stopped serving: {later}")
    errors = sum(1 for c in calls + later if c.responses[-1].error)
    assert scrape(rel_server, "exspec:requests_total", model=model, outcome="error") == errors
    assert ready(rel_server, model)
    status, body = clients.generate(rel_server.urls["http"], model, {
        "text_input": PROMPTS[0], "max_tokens": 200, "ignore_eos": True})   # ~50 forwards: faults
    assert status != 200 and "injected fault" in body["error"], (status, body)
    print(f"\n{model}: {len(calls)} concurrent requests: {isolated:.0f} rows re-prefilled after a "
          f"shared fault, {len(failed)} failed alone ({sorted(kinds)}), {len(served)} served with "
          f"exact output")


def test_a_request_that_raises_fails_alone_and_its_batch_is_served_exactly(rel_server, reference):
    """A bug only one request triggers (fault injection: every step holding a prompt with "~"
    raises as it reaches that row's commit): it ends with the error every time, and the request
    batched with it is prefilled again, stepped alone once, and served exactly.

    Batched for certain, whatever the machine's load: a partner runs (one token a slowed tick)
    before the culprit arrives, and groups of one are stepped together (max_batch_size 2)."""
    model, culprit = "culprit", "Culprit: ~~~"
    count = lambda name, **labels: scrape(rel_server, name, model=model, **labels)  # noqa: E731
    slow = {**SAMPLING, "num_speculative_tokens": 0}
    for partner in PROMPTS[:2]:
        isolated = count("exspec:isolated_rows_total")
        with cf.ThreadPoolExecutor(2) as pool:
            held = pool.submit(one, rel_server, model, partner, sampling=slow)
            wait_for(lambda: count("exspec:num_requests_running") == 1, timeout_s=30,
                     what="the partner to run")
            bad = one(rel_server, model, culprit)
            good = held.result()
        for call, prompt in [(good, partner), (bad, culprit)]:
            assert_one_final(call, f"{model} request {prompt!r}")
        assert bad.responses[-1].error and "injected fault: exception on a row" in bad.responses[-1].error, bad
        assert not good.responses[-1].error and good.ids() == reference[partner], (
            f"{partner!r} beside the failing request: {good.responses[-1].error or good.ids()}")
        assert count("exspec:isolated_rows_total") > isolated, (
            "the failing request shared a step, yet no row was prefilled again on its own")
    assert count("exspec:requests_total", outcome="error") == 2
    print(f"\n{model}: 2 failing requests, each beside a running one: "
          f"{count('exspec:isolated_rows_total'):.0f} rows re-prefilled, the others exact")


def test_engine_thread_death_ends_in_flight_and_new_requests_with_unavailable(rel_server, reference):
    start = time.monotonic()
    calls = concurrently(rel_server, "crash", PROMPTS[:3], stream=True,
                         sampling={"max_tokens": 200, "ignore_eos": True})
    for call in calls:
        assert_one_final(call, "in-flight request on the crashed engine")
        last = call.responses[-1]
        assert last.error and refused_as_dead(last.error, "EngineCrash"), last
        assert len(call.ids()) < 200
    # those the engine held are told why (one sent later may find the model unloaded)
    assert any("the engine thread died" in c.responses[-1].error and "EngineCrash"
               in c.responses[-1].error for c in calls), [c.responses[-1].error for c in calls]
    t_new = time.monotonic()
    new = one(rel_server, "crash", "hello", timeout_s=20)
    assert_one_final(new, "new request on the crashed engine")
    assert refused_as_dead(new.responses[-1].error, "restarted"), new.responses[-1].error
    status, body = clients.generate(rel_server.urls["http"], "crash", {"text_input": "hello"})
    assert status != 200 and refused_as_dead(body["error"], "has stopped"), (status, body)
    log = server_log(rel_server)
    assert "exspec: the engine thread died: Traceback" in log and "EngineCrash" in log
    # The default setup (exspec-serve: explicit model control) reports it not ready: the model
    # unloads itself, so its ready endpoint fails on any Triton version.
    wait_for(lambda: not ready(rel_server, "crash"), 60, "the crashed model not ready")
    assert "unloading model crash (unload_when_dead)" in server_log(rel_server)
    # its finalize ran to the end and wrote its last line (as the log's owner: exspec_log)
    wait_for(lambda: "exspec: model crash finalized" in server_log(rel_server), 30, "crash finalized")
    # Triton's strict readiness counts the model that unloaded after failing: the server's own
    # /v2/health/ready fails too (what the Helm chart's probe asks).
    assert not ready(rel_server)
    # The other models carry on.
    assert ready(rel_server, "limits")
    assert one(rel_server, "limits", PROMPTS[0]).ids() == reference[PROMPTS[0]]
    print(f"\ncrash: in-flight answered after {t_new - start:.1f} s, a new request after "
          f"{time.monotonic() - t_new:.2f} s")


def test_tick_past_tick_timeout_ends_requests_with_unavailable(rel_server, reference):
    start = time.monotonic()
    calls = concurrently(rel_server, "slow", PROMPTS[:3], timeout_s=30)
    took = time.monotonic() - start
    for call in calls:
        assert_one_final(call, "request on the stuck engine")
        last = call.responses[-1]
        assert last.error and "tick_timeout_s (0.5 s)" in last.error, last
    status, body = clients.generate(rel_server.urls["http"], "slow", {"text_input": "hello"})
    assert status != 200 and refused_as_dead(body["error"], "tick_timeout_s"), (status, body)
    log = server_log(rel_server)
    assert "a tick has run past tick_timeout_s" in log and "before_tick" in log, (
        "the stuck engine thread's stack is not in the log")
    wait_for(lambda: not ready(rel_server, "slow"), 60, "the stuck model not ready")
    wait_for(lambda: "exspec: model slow finalized" in server_log(rel_server), 30, "slow finalized")
    assert ready(rel_server, "limits")
    assert one(rel_server, "limits", PROMPTS[1]).ids() == reference[PROMPTS[1]]
    print(f"\nslow: stuck tick answered after {took:.1f} s (tick_delay_s 2.5, tick_timeout_s 0.5)")


def refused_as_dead(error: str, why: str) -> bool:
    """A request to a dead engine's model: refused by the model saying why, or, once the model
    has unloaded itself, by Triton."""
    return why in error or "unknown model" in error or "not ready" in error.lower()


UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"
HEALTH_CHECK = '\nparameters { key: "ENABLE_VLLM_HEALTH_CHECK" value { string_value: "true" } }\n'


def repository_state(server, model: str) -> str | None:
    import json
    import urllib.request
    req = urllib.request.Request(server.urls["http"] + "/v2/repository/index", data=b"{}")
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read())
    return next((m.get("state") for m in index if m["name"] == model), None)


KEEP_LOADED = '\nparameters { key: "unload_when_dead" value { string_value: "false" } }\n'


def test_dead_engines_unload_with_the_vllm_backends_words_or_stay_loaded_when_told(pair, tmp_path):
    """ENABLE_VLLM_HEALTH_CHECK "true" (the vLLM backend's switch): once the engine thread dies,
    requests get exactly the vLLM backend's words (its CI compares with ==) and the model
    unloads, so its ready endpoint fails and the repository index says UNAVAILABLE on any
    Triton version. unload_when_dead "false": the model stays loaded, refusing with exspec's
    words, and exspec:engine_up says 0. Other models serve on."""
    repo = tmp_path / "models"
    write_model(repo, "crash_hc", pair, MODELS["crash"], config_extra=HEALTH_CHECK)
    write_model(repo, "crash_kept", pair, MODELS["crash"], config_extra=KEEP_LOADED)
    write_model(repo, "limits", pair, MODELS["limits"])
    with TritonServer(repo, free_ports=True, startup_timeout_s=300, log_path=tmp_path / "log",
                      extra_args=["--exit-timeout-secs=10"]) as server:
        assert ready(server, "crash_hc") and repository_state(server, "crash_hc") == "READY"
        for model in ("crash_hc", "crash_kept"):
            calls = concurrently(server, model, PROMPTS[:2], stream=True,
                                 sampling={"max_tokens": 200, "ignore_eos": True})
            errors = []
            for call in calls:
                assert_one_final(call, f"in-flight request on {model}")
                errors.append(call.responses[-1].error)
            # The engine dies 6 ticks into the first request; the second may arrive after that,
            # and then finds the model stopped (or, with the health check, already unloaded).
            if model == "crash_hc":
                assert UNHEALTHY in errors, errors
                assert all(e == UNHEALTHY or refused_as_dead(e, UNHEALTHY) for e in errors), errors
            else:
                assert any("the engine thread died" in e for e in errors), errors
                assert all(("the engine thread died" in e or "has stopped" in e)
                           and UNHEALTHY not in e for e in errors), errors
        wait_for(lambda: repository_state(server, "crash_hc") == "UNAVAILABLE", 60,
                 "crash_hc unloaded")
        assert not ready(server, "crash_hc")
        new = one(server, "crash_hc", "hello", timeout_s=20)
        assert new.responses[-1].error, new.responses
        log = server_log(server)
        assert "unloading model crash_hc (unload_when_dead)" in log
        assert "successfully unloaded 'crash_hc'" in log
        assert "the engine thread died" in log   # the reason the wire leaves out
        # kept loaded: refusing with exspec's own words, engine_up 0 for the alert
        assert repository_state(server, "crash_kept") == "READY"
        refused = one(server, "crash_kept", "hello", timeout_s=20).responses[-1].error
        assert "has stopped" in refused and UNHEALTHY not in refused
        assert scrape(server, "exspec:engine_up", model="crash_kept") == 0
        assert scrape(server, "exspec:engine_up", model="limits") == 1
        assert "unloading model crash_kept" not in server_log(server)
        assert ready(server, "limits") and not one(server, "limits", PROMPTS[0]).responses[-1].error
