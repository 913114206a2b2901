"""Every kind of refusal at once, from several threads, beside ordinary streaming requests on
both protocols, through the real server: it must stay alive and READY, every innocent output
must equal its fault-free baseline, and every refusal must get exactly one error response.

This is the test of "one owner per Triton object": a refusal made while parsing (on Triton's
execute thread) and one made by the engine's add_request (answered on the send thread) used to
count the same Triton metric from two threads, and tritonserver died of it (SIGSEGV in
libtriton_python.so) within seconds.

EXSPEC_STRESS_S sets how long the storm lasts (default 60 s)."""
from __future__ import annotations

import json
import os
import queue
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

from reliabilitykit import LIMITS, clients, ready

DURATION_S = float(os.environ.get("EXSPEC_STRESS_S", "60"))
MODEL = "limits"
TIMEOUT_S = 60.0                   # per request: no answer by then is a hang
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["the cat sat on", "one two three", "a b c d e", "hello world"]
# Held long enough that the pool and queue (2 + 2) fill and later requests are refused busy.
HOLD = {"max_tokens": LIMITS["max_output_tokens"], "ignore_eos": True, "temperature": 0.0}

# One request of each kind the server refuses, as (where it is refused, grpc_inputs keywords).
REFUSALS = {
    "bad JSON (parse)": {"prompt": "hi", "sampling": "{not json"},
    "unknown key (parse)": {"prompt": "hi", "sampling": {"max_tokenz": 3}},
    "bad value (parse)": {"prompt": "hi", "sampling": {"temperature": -1}},
    "over max_tokens (add_request)": {"prompt": "hi",
                                      "sampling": {"max_tokens": LIMITS["max_output_tokens"] + 1}},
    "over max_prompt_tokens (add_request)": {"input_ids": [5] * (LIMITS["max_prompt_tokens"] + 1)},
}
HTTP_REFUSALS = [{"text_input": "hi", "sampling_parameters": "{not json"},
                 {"input_ids": [5] * (LIMITS["max_prompt_tokens"] + 1)},
                 {"text_input": "hi", "max_tokens": LIMITS["max_output_tokens"] + 1}]


class Stream:
    """One gRPC stream with one request in flight at a time: every event it ever receives is
    counted, so a second response to a request shows up as an event nobody asked for."""

    def __init__(self, url: str):
        self.events: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.sent = 0

    def call(self, inputs: list) -> tuple[list[int], str | None]:
        """(ids, error) of one request: the responses up to its final one."""
        self.sent += 1
        self.client.async_stream_infer(MODEL, inputs, request_id=f"r{self.sent}",
                                       enable_empty_final_response=True)
        ids = []
        while True:
            result, error = self.events.get(timeout=TIMEOUT_S)
            if error is not None:   # an error response is the request's last
                return ids, error.message()
            response = result.get_response()
            assert response.id == f"r{self.sent}", f"a response for {response.id} arrived late"
            if "output_ids" in {o.name for o in response.outputs}:
                ids += result.as_numpy("output_ids").reshape(-1).tolist()
            if response.parameters["triton_final_response"].bool_param:
                return ids, None

    def close(self) -> int:
        """Events that arrived after every request's final response."""
        time.sleep(0.5)
        self.client.stop_stream()
        self.client.close()
        return self.events.qsize()


def _grpc_inputs(request: dict, stream_flag: bool = True) -> list:
    return clients.grpc_inputs(**request, stream=stream_flag)


def _http_stream_ids(base: str, prompt: str, sampling: dict) -> tuple[int, list[int] | str]:
    """(status, ids), or (status, the body) where the answer holds an error."""
    status, raw = clients.http_post(f"{base}/v2/models/{MODEL}/generate_stream",
                                    {"text_input": prompt, **sampling}, TIMEOUT_S)
    lines = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: ")]
    try:
        events = [json.loads(line) for line in lines]
    except ValueError:
        return status, raw.decode(errors="replace")[:300]
    if status != 200 or any("error" in e for e in events):
        return status, raw.decode(errors="replace")[:300]
    return status, [t for e in events for t in clients.event_ids(e)]


def _busy(error: str | None) -> bool:
    return error is not None and "busy" in error


def test_refusals_of_every_kind_beside_streams_leave_the_server_up_and_outputs_exact(rel_server):
    grpc_url, http = rel_server.urls["grpc"], rel_server.urls["http"]
    baseline = {}
    base = Stream(grpc_url)
    for prompt in PROMPTS:
        ids, error = base.call(_grpc_inputs({"prompt": prompt, "sampling": GREEDY}))
        assert error is None, error
        baseline[prompt] = ids
    base.close()

    deadline = time.monotonic() + DURATION_S
    failures: list[str] = []
    counts = {"innocent": 0, "busy retries": 0, "refused": 0, "http refused": 0}
    lock = threading.Lock()

    def note(key: str, n: int = 1):
        with lock:
            counts[key] += n

    def innocent_grpc(seed: int):
        stream, i = Stream(grpc_url), seed
        while time.monotonic() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            ids, error = stream.call(_grpc_inputs({"prompt": prompt, "sampling": GREEDY}))
            if _busy(error):   # a real client retries a busy server
                note("busy retries")
                time.sleep(0.01)
            elif error is not None or ids != baseline[prompt]:
                failures.append(f"grpc {prompt!r}: {error or ids} != {baseline[prompt]}")
            else:
                note("innocent")
        if stream.close():
            failures.append("an innocent gRPC stream got responses nobody asked for")

    def innocent_http(seed: int):
        i = seed
        while time.monotonic() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            status, ids = _http_stream_ids(http, prompt, GREEDY)
            if status == 200 and ids == baseline[prompt]:
                note("innocent")
            elif "busy" in str(ids):
                note("busy retries")
                time.sleep(0.01)
            else:
                failures.append(f"http {prompt!r}: {status} {ids} != {baseline[prompt]}")

    def holder():
        stream = Stream(grpc_url)
        while time.monotonic() < deadline:
            _, error = stream.call(_grpc_inputs({"prompt": "hold", "sampling": HOLD}))
            if error is not None and not _busy(error):
                failures.append(f"holder: {error}")
        stream.close()

    def hostile_grpc(kinds: list[str]):
        stream, i = Stream(grpc_url), 0
        while time.monotonic() < deadline:
            kind = kinds[i % len(kinds)]
            i += 1
            ids, error = stream.call(_grpc_inputs(REFUSALS[kind], stream_flag=i % 2 == 0))
            if error is None or ids:
                failures.append(f"{kind}: served ({ids}) instead of refused")
            else:
                note("refused")
        if stream.close():
            failures.append("a refusal got more than one response")

    def hostile_http():
        i = 0
        while time.monotonic() < deadline:
            body = HTTP_REFUSALS[i % len(HTTP_REFUSALS)]
            i += 1
            status, raw = clients.http_post(f"{http}/v2/models/{MODEL}/generate", body, TIMEOUT_S)
            try:
                refused = status != 200 and "error" in json.loads(raw)
            except ValueError:
                refused = False
            if refused:
                note("http refused")
            else:
                failures.append(f"http refusal {list(body)}: {status} {raw[:200]!r}")

    parse_kinds = [k for k in REFUSALS if "(parse)" in k]
    engine_kinds = [k for k in REFUSALS if "(add_request)" in k]
    threads = [threading.Thread(target=innocent_grpc, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=innocent_http, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=holder) for _ in range(2)]
    threads += [threading.Thread(target=hostile_grpc, args=(kinds,))
                for kinds in (parse_kinds, engine_kinds, parse_kinds, engine_kinds)]
    threads += [threading.Thread(target=hostile_http)]
    errors: list[BaseException] = []

    def guarded(thread):
        run = thread.run
        def wrapped():
            try:
                run()
            except BaseException as exc:   # a hang (queue.Empty) or a dead server
                errors.append(exc)
        thread.run = wrapped

    for t in threads:
        guarded(t)
        t.start()
    while any(t.is_alive() for t in threads):
        assert rel_server.process.poll() is None, "tritonserver died under the storm"
        time.sleep(0.5)
    print(f"\nstress {DURATION_S:g} s: {counts}")
    assert rel_server.process.poll() is None, "tritonserver died under the storm"
    assert not errors, errors[:3]
    assert not failures, failures[:5]
    assert ready(rel_server, MODEL)
    assert counts["innocent"] > 20 and counts["refused"] > 20 and counts["http refused"] > 5, counts
    assert counts["busy retries"] > 0, f"nothing was refused busy: {counts}"
