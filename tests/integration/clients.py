"""Small wrappers over real tritonclient gRPC/HTTP calls and plain-HTTP generate endpoints."""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens", "return_logprobs", "return_cumulative_logprob")


@dataclass
class Response:
    outputs: dict                  # name -> numpy array
    final: bool
    error: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.outputs["text_output"].reshape(-1)[0].decode("utf-8")

    def ids(self) -> list[int]:
        return [int(t) for t in self.outputs["output_ids"].reshape(-1)]


@dataclass
class Call:
    """One request over a gRPC stream: its responses in arrival order."""
    request_id: str
    responses: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return any(r.final for r in self.responses)

    def text(self) -> str:
        return "".join(r.text() for r in self.responses if "text_output" in r.outputs)

    def ids(self) -> list[int]:
        return [t for r in self.responses if "output_ids" in r.outputs for t in r.ids()]


def grpc_inputs(prompt=None, input_ids=None, sampling=None, **flags):
    inputs = []
    if prompt is not None:
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
        inputs.append(t)
    if input_ids is not None:
        t = grpcclient.InferInput("input_ids", [len(input_ids)], "INT64")
        t.set_data_from_numpy(np.array(input_ids, dtype=np.int64))
        inputs.append(t)
    if sampling is not None:
        t = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        t.set_data_from_numpy(np.array([raw.encode()], dtype=np.object_))
        inputs.append(t)
    for name, value in flags.items():
        assert name in FLAGS, name
        t = grpcclient.InferInput(name, [1], "BOOL")
        t.set_data_from_numpy(np.array([value], dtype=bool))
        inputs.append(t)
    return inputs


def grpc_stream(url: str, model: str, requests: list[dict], timeout_s: float = 120.0) -> list[Call]:
    """Send every request on one gRPC stream; wait until each has its final response.

    Each request dict holds grpc_inputs() keywords plus optional `parameters`. With
    enable_empty_final_response the client also reports a final flag without data, so a
    request that never gets its final response shows up as a timeout, not as a silent hang."""
    calls = {f"r{i}": Call(f"r{i}") for i in range(len(requests))}
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        for (rid, call), req in zip(calls.items(), requests):
            req = dict(req)
            params = req.pop("parameters", None)
            client.async_stream_infer(model, grpc_inputs(**req), request_id=rid,
                                      parameters=params, enable_empty_final_response=True)
        pending = set(calls)
        while pending:
            result, error = events.get(timeout=timeout_s)
            if error is not None:   # errors carry no request id: callers send one request
                rid = next(iter(pending)) if len(pending) == 1 else "?"
                calls[rid].responses.append(Response({}, True, error.message(), error.status()))
                pending.discard(rid)
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            calls[response.id].responses.append(Response(outputs, final))
            if final:
                pending.discard(response.id)
    finally:
        client.stop_stream()
        client.close()
    return list(calls.values())


def first_response_then_cancel(url: str, model: str, inputs: list):
    """Stream one request, wait for its first response, then cancel it by closing the stream;
    returns that first response (a tritonclient result)."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="long")
        result, error = events.get(timeout=60)
        assert error is None, error
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return result


def grpc_one(url: str, model: str, **request) -> Call:
    return grpc_stream(url, model, [request])[0]


def http_post(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def generate(base: str, model: str, body: dict) -> tuple[int, dict]:
    status, raw = http_post(f"{base}/v2/models/{model}/generate", body)
    return status, json.loads(raw)


def generate_stream(base: str, model: str, body: dict) -> tuple[int, list[dict]]:
    """HTTP generate_stream: the server-sent events, parsed."""
    status, raw = http_post(f"{base}/v2/models/{model}/generate_stream", body)
    events = [json.loads(line[len(b"data: "):]) for line in raw.splitlines()
              if line.startswith(b"data: ")]
    if status != 200:
        return status, [json.loads(raw)]
    return status, events


def http_infer(base_url: str, model: str, prompt: str, parameters: dict | None = None):
    client = httpclient.InferenceServerClient(base_url.replace("http://", ""))
    t = httpclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    try:
        return client.infer(model, [t], parameters=parameters)
    finally:
        client.close()


def grpc_infer(url: str, model: str, prompt: str, parameters: dict | None = None):
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.infer(model, grpc_inputs(prompt=prompt), parameters=parameters)
    finally:
        client.close()


def event_ids(event: dict) -> list[int]:
    """output_ids from a generate JSON body: Triton writes a one-element tensor as a scalar."""
    ids = event.get("output_ids", [])
    return ids if isinstance(ids, list) else [ids]
