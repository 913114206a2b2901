"""One generation as an iterator of Deltas, over a gRPC stream of its own or an HTTP
generate_stream (server-sent events).

Leaving early cancels on the server: `close()` (also called by `with`, by the garbage
collector when the caller drops the iterator, and on a timeout) cancels the gRPC call or closes
the HTTP connection, and Triton aborts the request. A server error ends the iteration with an
ExspecError carrying the server's message.
"""
from __future__ import annotations

import http.client
import json
import queue
import socket
import uuid
from urllib.parse import urlsplit

from .types import Clock, Delta, ExspecError, ExspecTimeout, Result
from . import wire

POLL_S = 0.25    # wake up this often while waiting, so Ctrl-C and deadlines are seen


class Generation:
    """Iterate for Deltas; `result` fills in as they arrive and is complete once iteration ends."""

    def __init__(self, timeout_s: float | None):
        self.clock = Clock(timeout_s)
        self.result = Result()
        self.finished = False
        self._closed = False

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        if self.finished or self._closed:
            raise StopIteration
        try:
            delta = self._next_delta()
        except BaseException:
            self.close()
            raise
        if delta is None:                 # the stream ended without more data
            self.close()
            raise StopIteration
        self.result.add(delta)
        if self.finished:
            self.result.latency_s = delta.time_s
            self._release()
        return delta

    def collect(self) -> Result:
        """Run to the end and return the Result."""
        for _ in self:
            pass
        return self.result

    def close(self) -> None:
        """Cancel on the server unless the final response has arrived; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.finished:
            self._release()
        else:
            self._cancel()

    def _timed_out(self):
        self.close()
        return ExspecTimeout(f"no final response within the timeout "
                             f"({self.clock.now():.1f} s); the request was cancelled")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # subclasses
    def _next_delta(self) -> Delta | None: ...
    def _cancel(self) -> None: ...
    def _release(self) -> None: ...


class GrpcGeneration(Generation):
    """One request on a gRPC bidirectional stream of its own (so an HTTP/2-aware proxy can
    balance generations, not connections). tritonclient's receive thread fills a queue."""

    def __init__(self, url: str, model: str, prompt, sampling: str, stream: bool = True,
                 timeout_s: float | None = None, headers: dict | None = None):
        import tritonclient.grpc as grpcclient
        super().__init__(timeout_s)
        self._events: queue.Queue = queue.Queue()
        self._client = wire.grpc_client(grpcclient, url)   # one channel per generation
        self._streaming = False
        try:
            self._client.start_stream(callback=self._on_response, stream_timeout=timeout_s,
                                      headers=headers)
            self._streaming = True
            self._client.async_stream_infer(model, wire.infer_inputs(prompt, sampling, stream),
                                            request_id=uuid.uuid4().hex,
                                            enable_empty_final_response=True)
        except BaseException:
            self._cancel()
            raise

    def _on_response(self, result, error):
        self._events.put((result, error, self.clock.now()))

    def _next_delta(self):
        while True:
            remaining = self.clock.remaining()
            if remaining is not None and remaining <= 0:
                raise self._timed_out()
            wait = POLL_S if remaining is None else min(POLL_S, remaining)
            try:
                result, error, t = self._events.get(timeout=wait)
                break
            except queue.Empty:
                continue
        if error is not None:
            status = error.status()
            if status and "DEADLINE_EXCEEDED" in status:
                raise self._timed_out()
            self.finished = True    # one request per stream: an error is its end
            raise ExspecError(error.message(), status)
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        delta = wire.delta_from_arrays(result.as_numpy, t)
        self.finished = final
        if final and not delta.token_ids and not delta.text and delta.finish_reason is None:
            self.result.latency_s = t
            return None     # an empty final response (sent only after a cancellation)
        return delta

    def _cancel(self):
        if self._streaming:
            self._client.stop_stream(cancel_requests=True)
            self._streaming = False
        self._client.close()

    def _release(self):
        if self._streaming:
            self._client.stop_stream(cancel_requests=False)   # the server has closed its side
            self._streaming = False
        self._client.close()


class HttpGeneration(Generation):
    """POST /v2/models/<model>/generate_stream and read its server-sent events line by line (or
    /generate, one JSON body, when not streaming). Closing the connection cancels the request."""

    def __init__(self, url: str, model: str, prompt, sampling: str, stream: bool = True,
                 timeout_s: float | None = None, headers: dict | None = None):
        super().__init__(timeout_s)
        parts = urlsplit(url if "://" in url else f"http://{url}")
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port or 80,
                                                timeout=timeout_s)
        path = f"{parts.path.rstrip('/')}/v2/models/{model}/{'generate_stream' if stream else 'generate'}"
        body = json.dumps(wire.http_body(prompt, sampling, stream)).encode()
        self._stream = stream
        try:
            self._conn.request("POST", path, body=body, headers={
                "Content-Type": "application/json", **(headers or {})})
            # Held here: http.client drops conn.sock once a response says it will close.
            self._sock = self._conn.sock
            self._response = self._conn.getresponse()
        except (socket.timeout, TimeoutError):
            raise self._timed_out() from None
        except BaseException:
            self._cancel()
            raise
        if self._response.status != 200:
            raw = self._response.read()
            self.finished = True
            self._release()
            raise ExspecError(_error_text(raw), self._response.status)

    def _next_delta(self):
        try:
            if not self._stream:
                return self._final(json.loads(self._response.read()), self.clock.now())
            while True:
                remaining = self.clock.remaining()
                if remaining is not None:
                    if remaining <= 0:
                        raise self._timed_out()
                    self._sock.settimeout(remaining)
                line = self._response.readline()
                if not line:
                    raise ExspecError("the server closed the stream before the final response")
                if line.startswith(b"data:"):
                    return self._event(json.loads(line[5:]), self.clock.now())
        except (socket.timeout, TimeoutError):
            raise self._timed_out() from None

    def _event(self, event: dict, t: float) -> Delta:
        if "error" in event:
            self.finished = True
            raise ExspecError(str(event["error"]))
        delta = wire.delta_from_json(event, t)
        # SSE carries no final flag: the last event is the one with a finish reason.
        self.finished = delta.finish_reason is not None
        return delta

    def _final(self, event: dict, t: float) -> Delta:
        delta = self._event(event, t)
        self.finished = True
        return delta

    def _cancel(self):
        self._release()      # Triton sees the disconnect and cancels the request

    def _release(self):
        response = getattr(self, "_response", None)
        if response is not None:
            response.close()
        self._conn.close()


def _error_text(raw: bytes) -> str:
    """The server's message from an error body: JSON {"error": ...}, or the same as one
    server-sent event (generate_stream answers a refused request that way)."""
    text = raw.decode("utf-8", errors="replace").strip()
    body = text[5:] if text.startswith("data:") else text
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return text or "(empty error body)"
