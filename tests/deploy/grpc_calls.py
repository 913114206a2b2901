"""One generation per gRPC stream with plain tritonclient, as exspec-client does: open a stream,
send one request, collect its responses until the final one, close the stream."""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass
class Generation:
    responses: int = 0
    final: bool = False
    error: str | None = None
    ended_at: float | None = None
    text: list = field(default_factory=list)


def inputs(prompt: str, max_tokens: int):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array(
        [json.dumps({"max_tokens": max_tokens, "ignore_eos": True}).encode()], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    return [text, sampling, stream]


def generate(client: grpcclient.InferenceServerClient, prompt: str, max_tokens: int,
             timeout_s: float = 120.0, started: threading.Event | None = None) -> Generation:
    """One stream on `client`'s channel for one request; closed when the request ends."""
    events: queue.Queue = queue.Queue()
    out = Generation()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer("exspec", inputs(prompt, max_tokens),
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while not out.final:
            result, error = events.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                out.error, out.final = error.message(), True
                break
            response = result.get_response()
            out.final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                out.responses += 1
                if started is not None:
                    started.set()
        out.ended_at = time.monotonic()
    finally:
        client.stop_stream()
    return out


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; .result() joins it and returns (or raises) what fn did."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:   # noqa: BLE001 (handed to the caller)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    class Handle:
        @staticmethod
        def result(timeout: float = 180.0):
            thread.join(timeout)
            assert not thread.is_alive(), f"{fn.__name__} still running after {timeout} s"
            if "error" in box:
                raise box["error"]
            return box["value"]
    return Handle()
