"""Hostile input through the real server (hypothesis): random JSON values and types, unicode,
huge and negative numbers, NaN/Inf, nested objects and oversized strings in
sampling_parameters, request parameters, text_input and input_ids (wrong dtypes and shapes
too), over one gRPC stream and over HTTP generate / generate_stream. Every case must end with
exactly one final response (an answer or an error) within a per-request timeout; no error may
be INTERNAL (a parser bug); the server and the model stay ready.

EXSPEC_FUZZ_EXAMPLES sets the number of cases per test (CI default 120; try 2000 for a long
run); the counts are printed (-s) at the end of each test."""
from __future__ import annotations

import json
import math
import os
import queue
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliabilitykit import ready

EXAMPLES = int(os.environ.get("EXSPEC_FUZZ_EXAMPLES", "120"))
TIMEOUT_S = 60.0   # per request: no answer by then is a hang
MODEL = "limits"
KEYS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
        "ignore_eos", "num_speculative_tokens", "logprobs"]
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))

numbers = st.one_of(st.integers(), st.integers(-2, 70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 30, 1e308, -0.0]))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "\ud800", "NaN", "true",
                                                         "[1, 2]", "{]", "🚀" * 20]),
                  st.integers(0, 200_000).map(lambda n: "y" * n))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), numbers, texts),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
hostile_sampling = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)),
                                   json_values, max_size=5)
# Values inside the limits model's ranges, so about half of the cases generate tokens (greedy
# and sampled, with stops, seeds and speculation lengths) and the serving paths get fuzzed too,
# not only the refusals.
valid_values = {
    "max_tokens": st.integers(1, 16),
    "temperature": st.one_of(st.just(0.0), st.floats(0.05, 2.0)),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
    "seed": st.integers(0, 2 ** 31 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=6), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 30), max_size=3),
    "ignore_eos": st.booleans(),
    "num_speculative_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 5),
}
valid_sampling = st.fixed_dictionaries({}, optional=valid_values)
sampling_dicts = st.one_of(valid_sampling, hostile_sampling)
valid_prompts = st.text(st.characters(codec="ascii", exclude_categories=["Cc"]), min_size=1, max_size=40)


def _dumps(value) -> str:
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


@st.composite
def grpc_cases(draw):
    """(inputs as (name, datatype, numpy array), request parameters, whether the request is
    valid: then it must be served, not refused)."""
    inputs = []
    if draw(st.booleans()):   # a request the server should serve
        prompt = (draw(valid_prompts).encode() if draw(st.booleans())
                  else np.array(draw(st.lists(st.integers(1, 300), min_size=1, max_size=40)), dtype=np.int64))
        if isinstance(prompt, bytes):
            inputs.append(("text_input", "BYTES", np.array([prompt], dtype=np.object_)))
        else:
            inputs.append(("input_ids", "INT64", prompt))
        inputs.append(("sampling_parameters", "BYTES",
                       np.array([_dumps(draw(valid_sampling)).encode()], dtype=np.object_)))
        inputs.append(("stream", "BOOL", np.array([draw(st.booleans())], dtype=bool)))
        return inputs, {}, True
    prompt_kind = draw(st.sampled_from(["text", "ids", "both", "none", "text_bad", "ids_bad"]))
    if prompt_kind in ("text", "both"):
        inputs.append(("text_input", "BYTES", np.array(
            [draw(texts).encode("utf-8", "surrogatepass")], dtype=np.object_)))
    if prompt_kind in ("ids", "both"):
        ids = draw(st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1) | st.integers(0, 400), max_size=80))
        inputs.append(("input_ids", "INT64", np.array(ids, dtype=np.int64)))
    if prompt_kind == "text_bad":   # wrong shape, wrong dtype or invalid UTF-8
        choice = draw(st.integers(0, 3))
        arr = [np.array([b"a", b"b"], dtype=np.object_), np.array([[b"ab"]], dtype=np.object_),
               np.array([b"\xff\xfe\xc3"], dtype=np.object_), np.array([1.5], dtype=np.float32)][choice]
        inputs.append(("text_input", "FP32" if arr.dtype == np.float32 else "BYTES", arr))
    if prompt_kind == "ids_bad":
        choice = draw(st.integers(0, 3))
        arr = [np.array([1, 2], dtype=np.int32), np.array([[1, 2], [3, 4]], dtype=np.int64),
               np.array([1.0, 2.0], dtype=np.float32), np.array([], dtype=np.int64)][choice]
        dtype = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
                 np.dtype(np.float32): "FP32"}[arr.dtype]
        inputs.append(("input_ids", dtype, arr))
    sp = draw(st.one_of(st.none(), sampling_dicts.map(_dumps), json_values.map(_dumps), texts))
    if sp is not None:
        inputs.append(("sampling_parameters", "BYTES",
                       np.array([sp.encode("utf-8", "surrogatepass")], dtype=np.object_)))
    for flag in draw(st.lists(st.sampled_from(["stream", "exclude_input_in_output",
                                               "return_finish_reason", "return_logprobs"]),
                              max_size=3, unique=True)):
        if draw(st.booleans()):
            inputs.append((flag, "BOOL", np.array([draw(st.booleans())], dtype=bool)))
        else:
            inputs.append((flag, "INT32", np.array([draw(st.integers(-3, 3))], dtype=np.int32)))
    params = draw(st.dictionaries(
        st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=10)),
        st.one_of(st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1),
                  st.floats(allow_nan=True, allow_infinity=True), texts), max_size=4))
    return inputs, params, False


class Stream:
    """One gRPC stream for the whole test; cases go one at a time, each must end with exactly
    one final response (an error or a response flagged final); a response for an earlier case
    arriving later is a duplicate."""

    def __init__(self, url):
        self.events: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def case(self, rid: str, inputs, params) -> str:
        tensors = []
        for name, dtype, arr in inputs:
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        try:
            self.client.async_stream_infer(MODEL, tensors, request_id=rid, parameters=params or None,
                                           enable_empty_final_response=True)
        except Exception as exc:   # the client library itself refused to build it
            return f"client refused: {type(exc).__name__}"
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                result, error = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"hang: no final response for {rid} within {TIMEOUT_S} s: "
                                     f"{inputs!r:.300} {params!r:.300}") from None
            if error is not None:
                return "error: " + error.message()
            response = result.get_response()
            assert response.id == rid, f"a response for {response.id} arrived during {rid}: duplicate"
            if response.parameters["triton_final_response"].bool_param:
                return "ok"

    def close(self):
        self.client.stop_stream()
        self.client.close()


def classify(outcome: str) -> str:
    if outcome == "ok" or outcome.startswith("client refused"):
        return outcome.split(":")[0]
    return "error"


ADAPTER_BUGS = ("exspec: parsing failed", "exspec: add_request failed")


class AdapterLog:
    """The server log since the last look: an adapter bug is logged there (the client only
    gets the exception's text), so each case is checked right after it, with its inputs."""

    def __init__(self, server):
        self.path, self.offset = Path(server.log_path), Path(server.log_path).stat().st_size

    def check(self, outcome: str, what) -> None:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        new = data.decode("utf-8", "replace")
        bugs = [line for line in new.splitlines() if any(b in line for b in ADAPTER_BUGS)]
        assert not bugs, f"an adapter bug answered {what!r:.300}: {bugs[0][:500]}"
        lowered = outcome.lower()
        assert "stub" not in lowered and "unhealthy" not in lowered, f"stub trouble: {outcome}"


def report(name, counts: Counter, server, log: AdapterLog):
    # the model's own readiness: the server's counts models the fault tests left dead
    assert ready(server, MODEL), f"{name}: model not ready after fuzzing"
    time.sleep(0.5)   # the stub's log lines reach the server log a moment after the response
    log.check("", "one of the last cases")
    print(f"\n{name}: {sum(counts.values())} cases: {dict(counts)}; crashes 0, hangs 0")


def test_fuzz_grpc_stream_tensors_and_parameters(rel_server):
    stream = Stream(rel_server.urls["grpc"])
    log = AdapterLog(rel_server)
    counts: Counter = Counter()

    @SETTINGS
    @given(grpc_cases())
    def case(c):
        inputs, params, valid = c
        n = sum(counts.values())
        outcome = stream.case(f"f{n}", inputs, params)
        counts[classify(outcome) + (" valid" if valid else "")] += 1
        log.check(outcome, c)
        assert outcome == "ok" or not valid, f"a valid request was refused: {c!r:.400}: {outcome}"

    try:
        case()
        assert stream.case("sentinel", [("text_input", "BYTES", np.array([b"hello"], dtype=np.object_))],
                           {"max_tokens": 2}) == "ok", "the stream stopped working after the fuzz"
    finally:
        stream.close()
    report("gRPC stream fuzz", counts, rel_server, log)


def http_post(url, raw: bytes):
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@st.composite
def http_bodies(draw):
    """(endpoint, raw body, whether the body is valid: then it must be served to the end)."""
    endpoint = draw(st.sampled_from(["generate", "generate_stream"]))
    if draw(st.booleans()):
        body = {"text_input": draw(valid_prompts), "return_finish_reason": True,
                "sampling_parameters": _dumps(draw(valid_sampling))}
        return endpoint, _dumps(body).encode(), True
    body = draw(sampling_dicts)
    if draw(st.booleans()):
        body["text_input"] = draw(json_values)
    else:
        body["text_input"] = draw(texts)
    if draw(st.booleans()):
        body["input_ids"] = draw(json_values)
    if draw(st.booleans()):
        body["sampling_parameters"] = draw(st.one_of(sampling_dicts.map(_dumps), json_values))
    if draw(st.booleans()):
        body[draw(st.sampled_from(["stream", "exclude_input_in_output", "return_finish_reason"]))] = (
            draw(json_values))
    raw = _dumps(body).encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:   # broken JSON now and then
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return endpoint, raw, False


def _final_reason(answer: dict) -> str:
    reason = answer.get("finish_reason")
    return reason[0] if isinstance(reason, list) else str(reason)


def test_fuzz_http_generate_bodies(rel_server):
    counts: Counter = Counter()
    base = f"{rel_server.urls['http']}/v2/models/{MODEL}"
    log = AdapterLog(rel_server)

    @SETTINGS
    @given(http_bodies())
    def case(c):
        endpoint, raw, valid = c
        start = time.monotonic()
        try:
            status, body = http_post(f"{base}/{endpoint}", raw)
        except (TimeoutError, OSError) as exc:
            raise AssertionError(f"hang or dropped connection after {time.monotonic() - start:.1f} s "
                                 f"on {endpoint} {raw[:300]!r}: {exc}") from None
        # 400: refused by the model; 500: also Triton's own JSON-to-tensor conversion errors,
        # before the model sees the request. Either way one answer, and it is an error.
        assert status in (200, 400, 500), f"{endpoint} {raw[:300]!r}: HTTP {status} {body[:300]!r}"
        if status != 200:
            assert b'"error"' in body, f"{endpoint} {raw[:300]!r}: HTTP {status} {body[:300]!r}"
        if status == 200 and endpoint == "generate_stream":
            events = [line for line in body.splitlines() if line.startswith(b"data: ")]
            assert events, f"a stream with no events: {raw[:300]!r}"
        if valid:   # served to the end: one final answer that says why it stopped
            assert status == 200, f"a valid request was refused: {raw[:300]!r}: {status} {body[:300]!r}"
            last = json.loads(events[-1][6:] if endpoint == "generate_stream" else body)
            assert _final_reason(last) in ("stop", "length"), f"{raw[:300]!r}: last answer {last}"
        counts[f"{endpoint} {status}{' valid' if valid else ''}"] += 1
        log.check(body.decode("utf-8", "replace"), raw[:300])

    case()
    report("HTTP generate fuzz", counts, rel_server, log)


def test_nan_and_inf_in_sampling_parameters_are_refused(rel_server):
    """Python's json writes NaN/Infinity, which some clients send: refused, not served."""
    for value in (math.nan, math.inf, -math.inf):
        status, body = http_post(f"{rel_server.urls['http']}/v2/models/{MODEL}/generate",
                                 _dumps({"text_input": "hi", "sampling_parameters": _dumps(
                                     {"temperature": value})}).encode())
        assert status == 400 and b"temperature" in body, (value, status, body[:300])


def test_parameters_that_are_not_utf8_are_invalid_arg(rel_server):
    """Found by the 2000-case fuzz run: a body key that is a lone surrogate (bytes ED A0 80)
    reaches the model as request parameters it cannot decode. A client error, said so."""
    raw = b'{"text_input": "hi", "\xed\xa0\x80": 1}'
    log = AdapterLog(rel_server)
    for endpoint in ("generate", "generate_stream"):
        status, body = http_post(f"{rel_server.urls['http']}/v2/models/{MODEL}/{endpoint}", raw)
        assert status == 400 and b"not valid UTF-8" in body, (endpoint, status, body[:300])
    time.sleep(0.5)
    log.check(body.decode("utf-8", "replace"), raw)
