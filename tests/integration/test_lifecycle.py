"""Cancellation, a full queue, metrics that match what was served, exactly one final response."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

from clients import first_response_then_cancel, grpc_inputs, grpc_one, grpc_stream
from serverkit import fill_pool_and_queue, scrape, wait_for

DESIGN_METRICS = [
    "exspec:requests_total", "exspec:prompt_tokens_total", "exspec:generation_tokens_total",
    "exspec:draft_tokens_total", "exspec:accepted_draft_tokens_total", "exspec:steps_total",
    "exspec:realign_bytes_total", "exspec:isolated_rows_total", "exspec:num_requests_running", "exspec:num_requests_waiting",
    "exspec:kv_cache_tokens", "exspec:num_speculative_tokens",
    "exspec:prefix_cache_queries_total", "exspec:prefix_cache_hits_total", "exspec:prefix_cache_blocks",
    "exspec:time_to_first_token_seconds_count", "exspec:time_per_output_token_seconds_count",
    "exspec:e2e_request_latency_seconds_count", "exspec:step_phase_seconds_count"]


def test_cancelled_stream_stops_and_frees_the_pool(server):
    cancelled_before = scrape(server, "exspec:requests_total", model="exspec", outcome="cancelled")
    tokens_before = scrape(server, "exspec:generation_tokens_total", model="exspec")
    result = first_response_then_cancel(server.urls["grpc"], "exspec", grpc_inputs(
        prompt="hello", stream=True, sampling={"max_tokens": 480, "ignore_eos": True}))
    assert result.as_numpy("text_output") is not None

    wait_for(lambda: scrape(server, "exspec:requests_total", model="exspec",
                            outcome="cancelled") == cancelled_before + 1,
             what="the cancelled request to be counted")
    wait_for(lambda: scrape(server, "exspec:num_requests_running", model="exspec") == 0,
             what="exspec:num_requests_running to return to 0")
    for role in ("allocated", "reserved"):   # its caches and its reservation are gone
        wait_for(lambda: scrape(server, "exspec:kv_cache_tokens", model="exspec", role=role) == 0,
                 what=f"exspec:kv_cache_tokens{{role={role}}} to return to 0")
    generated = scrape(server, "exspec:generation_tokens_total", model="exspec") - tokens_before
    assert generated < 480, f"the cancelled request ran to the end ({generated} tokens)"
    wait_for(lambda: "cancelled by its client" in Path(server.log_path).read_text(errors="replace"),
             what="the cancel to be logged")
    log = Path(server.log_path).read_text(errors="replace")   # and in the vLLM backend's words
    assert "[vllm] Cancelling the request" in log and "[vllm] Successfully cancelled the request" in log
    # and the server carries on
    (call,) = grpc_stream(server.urls["grpc"], "exspec", [{"prompt": "hello",
                                                           "sampling": {"max_tokens": 4}}])
    assert call.responses[-1].final and len(call.ids()) == 4


def test_http_client_disconnect_cancels_the_request(server):
    import http.client
    import json
    from urllib.parse import urlparse
    cancelled_before = scrape(server, "exspec:requests_total", model="exspec", outcome="cancelled")
    url = urlparse(server.urls["http"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v2/models/exspec/generate_stream", body=json.dumps(
        {"text_input": "hello", "stream": True, "max_tokens": 480, "ignore_eos": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.fp.readline()   # the first event arrived
    conn.sock.shutdown(2)    # the client goes away mid-stream
    conn.close()
    wait_for(lambda: scrape(server, "exspec:requests_total", model="exspec",
                            outcome="cancelled") == cancelled_before + 1,
             what="the disconnected request to be counted as cancelled")
    wait_for(lambda: scrape(server, "exspec:num_requests_running", model="exspec") == 0,
             what="exspec:num_requests_running to return to 0")


def test_full_queue_refuses_with_busy_and_serves_the_rest(server):
    # "small" holds one sequence and queues one more; once both are full, three more are
    # refused. One stream per request: a gRPC stream's error responses carry no request id.
    hold = {"max_tokens": 200, "ignore_eos": True}   # at most 4 tokens a slowed tick: >= 2.5 s
    send = lambda i: grpc_one(server.urls["grpc"], "small", prompt=f"hello {i}",   # noqa: E731
                              sampling=hold)
    with cf.ThreadPoolExecutor(5) as pool:
        held = fill_pool_and_queue(server, "small", pool, send, slots=1, queue=1)
        busy = list(pool.map(send, range(2, 5)))
        served = [call.result() for call in held]
    for c in busy:
        assert len(c.responses) == 1 and c.responses[0].final
        assert "busy" in (c.responses[0].error or ""), c.responses
    for c in served:
        assert not c.responses[-1].error and len(c.ids()) == 200, c.responses[-1]
        assert sum(r.final for r in c.responses) == 1


def test_exactly_one_final_response_per_request_under_concurrency(server):
    requests = [{"prompt": "def f(x):" * (1 + i % 3), "stream": i % 2 == 0,
                 "sampling": {"max_tokens": 3 + 5 * i}} for i in range(8)]
    requests.append({"prompt": "x", "sampling": {"max_tokens": -1}})      # an error among them
    for call in grpc_stream(server.urls["grpc"], "exspec", requests[:-1]):
        assert sum(r.final for r in call.responses) == 1, call
        assert call.responses[-1].final
    (bad,) = grpc_stream(server.urls["grpc"], "exspec", requests[-1:])
    assert len(bad.responses) == 1 and bad.responses[0].final and bad.responses[0].error


def test_metrics_match_the_requests_just_served(server, engine):
    names = {line.split("{")[0].split(" ")[0]
             for line in _metrics_text(server).splitlines() if line.startswith("exspec:")}
    missing = [m for m in DESIGN_METRICS if m not in names]
    assert not missing, f"metrics missing from the scrape: {missing}"

    before = {key: scrape(server, key[0], **dict(key[1:])) for key in _KEYS}
    prompts = ["hello", "def add(a, b):", "The quick brown fox"]
    max_tokens = [5, 9, 13]
    calls = grpc_stream(server.urls["grpc"], "exspec",
                        [{"prompt": p, "sampling": {"max_tokens": n, "ignore_eos": True}}
                         for p, n in zip(prompts, max_tokens)])
    assert all(len(c.ids()) == n for c, n in zip(calls, max_tokens))
    prompt_tokens = sum(len(engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    expected = {
        ("exspec:requests_total", ("model", "exspec"), ("outcome", "length")): 3,
        ("exspec:generation_tokens_total", ("model", "exspec")): sum(max_tokens),
        ("exspec:prompt_tokens_total", ("model", "exspec")): prompt_tokens,
        ("exspec:e2e_request_latency_seconds_count", ("model", "exspec")): 3,
        ("exspec:time_to_first_token_seconds_count", ("model", "exspec")): 3,
    }

    def deltas():
        return {key: scrape(server, key[0], **dict(key[1:])) - before[key] for key in _KEYS}
    wait_for(lambda: deltas() == expected, timeout_s=10, what=f"metric deltas {expected}")
    drafted = scrape(server, "exspec:draft_tokens_total", model="exspec")
    accepted = scrape(server, "exspec:accepted_draft_tokens_total", model="exspec")
    assert 0 <= accepted <= drafted and drafted > 0
    assert scrape(server, "exspec:steps_total", model="exspec", kind="all") > 0
    assert scrape(server, "exspec:num_speculative_tokens", model="exspec") == 4


_KEYS = [
    ("exspec:requests_total", ("model", "exspec"), ("outcome", "length")),
    ("exspec:generation_tokens_total", ("model", "exspec")),
    ("exspec:prompt_tokens_total", ("model", "exspec")),
    ("exspec:e2e_request_latency_seconds_count", ("model", "exspec")),
    ("exspec:time_to_first_token_seconds_count", ("model", "exspec")),
]


def _metrics_text(server) -> str:
    import urllib.request
    with urllib.request.urlopen(server.urls["metrics"], timeout=10) as r:
        return r.read().decode()



def test_the_server_log_names_the_torch_threads_it_runs_with(server):
    """The stub applies the thread rule at load and says so (no OMP_NUM_THREADS is set for
    the test server, so it runs on the default single thread)."""
    text = Path(server.log_path).read_text(errors="replace")
    assert "ready on cpu, 1 torch thread (default)" in text, text[-2000:]
