"""AsyncClient: the asyncio twin of Client (tritonclient.grpc.aio streams, aiohttp SSE).

    async with AsyncClient("127.0.0.1:8001") as client:
        async with client.stream("def fib(n):", max_tokens=64) as gen:
            async for delta in gen:
                print(delta.text, end="", flush=True)
        print(gen.result.summary())

Leaving the `async with` early, cancelling the task, or a timeout cancels the request on the
server (the gRPC call is cancelled; the HTTP connection is closed).
"""
from __future__ import annotations

import asyncio
import json
import uuid

from . import wire
from .client import split_url
from .types import DEFAULT_MODEL, Clock, Delta, ExspecError, ExspecTimeout, Result, sampling_json


class AsyncGeneration:
    def __init__(self, timeout_s: float | None):
        self.clock = Clock(timeout_s)
        self.result = Result()
        self.finished = False
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            remaining = self.clock.remaining()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            delta = await asyncio.wait_for(self._next_delta(), remaining)
        except asyncio.TimeoutError:
            await self.aclose()
            raise ExspecTimeout(f"no final response within the timeout ({self.clock.now():.1f} s); "
                                "the request was cancelled") from None
        except BaseException:
            await self.aclose()
            raise
        if delta is None:
            await self.aclose()
            raise StopAsyncIteration
        self.result.add(delta)
        if self.finished:
            self.result.latency_s = delta.time_s
            await self.aclose()
        return delta

    async def collect(self) -> Result:
        async for _ in self:
            pass
        return self.result

    async def aclose(self) -> None:
        """Cancel on the server unless the final response has arrived; idempotent."""
        if not self._closed:
            self._closed = True
            await self._close()

    async def __aenter__(self):
        await self._start()
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __await__(self):          # `gen = await client.stream(...)` starts it too
        async def started():
            await self._start()
            return self
        return started().__await__()


class _AsyncGrpc(AsyncGeneration):
    def __init__(self, client, model, prompt, sampling, stream, timeout_s):
        super().__init__(timeout_s)
        self._client, self._model = client, model
        self._request = {"model_name": model, "inputs": wire.infer_inputs(prompt, sampling, stream),
                         "request_id": uuid.uuid4().hex}
        self._done = asyncio.Event()
        self._call = None
        self._timeout_s = timeout_s

    async def _start(self):
        if self._call is not None:
            return

        async def requests():
            yield self._request
            await self._done.wait()     # keep our side open until the final response

        self._call = self._client.stream_infer(requests(), stream_timeout=self._timeout_s)

    async def _next_delta(self):
        await self._start()
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            raise ExspecError("the server closed the stream before the final response") from None
        t = self.clock.now()
        if error is not None:
            self.finished = True
            raise ExspecError(error.message(), error.status())
        final = result.get_response().parameters["triton_final_response"].bool_param
        self.finished = final
        delta = wire.delta_from_arrays(result.as_numpy, t)
        if final and not delta.token_ids and not delta.text and delta.finish_reason is None:
            return None
        return delta

    async def _close(self):
        self._done.set()
        if self._call is not None and not self.finished:
            self._call.cancel()


class _AsyncHttp(AsyncGeneration):
    def __init__(self, session, url, model, prompt, sampling, stream, timeout_s):
        super().__init__(timeout_s)
        self._session = session
        self._url = f"{url.rstrip('/')}/v2/models/{model}/{'generate_stream' if stream else 'generate'}"
        self._body = wire.http_body(prompt, sampling, stream)
        self._stream = stream
        self._response = None

    async def _start(self):
        if self._response is not None:
            return
        self._response = await self._session.post(self._url, json=self._body)
        if self._response.status != 200:
            raw = await self._response.read()
            self.finished = True
            self._response.release()
            from .streams import _error_text
            raise ExspecError(_error_text(raw), self._response.status)

    async def _next_delta(self):
        await self._start()
        if not self._stream:
            event = json.loads(await self._response.read())
            delta = self._event(event)
            self.finished = True
            return delta
        while True:
            line = await self._response.content.readline()
            if not line:
                raise ExspecError("the server closed the stream before the final response")
            if line.startswith(b"data:"):
                return self._event(json.loads(line[5:]))

    def _event(self, event):
        if "error" in event:
            self.finished = True
            raise ExspecError(str(event["error"]))
        delta = wire.delta_from_json(event, self.clock.now())
        self.finished = delta.finish_reason is not None
        return delta

    async def _close(self):
        if self._response is not None:
            if self.finished:
                self._response.release()
            else:
                self._response.close()   # drop the connection: Triton cancels the request


class AsyncClient:
    def __init__(self, url: str | None = None, protocol: str | None = None,
                 model: str = DEFAULT_MODEL, timeout_s: float | None = None):
        self.protocol, self.url = split_url(url, protocol)
        self.model = model
        self.timeout_s = timeout_s
        self._grpc = None
        self._session = None

    def stream(self, prompt, *, max_tokens=None, temperature=None, timeout_s=None,
               stream: bool = True, **sampling) -> AsyncGeneration:
        """`async with client.stream(...) as gen: async for delta in gen` (or `await` it)."""
        sampling_text = sampling_json(max_tokens, temperature, **sampling)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.protocol == "grpc":
            if self._grpc is None:
                import tritonclient.grpc.aio as grpcaio
                self._grpc = wire.grpc_client(grpcaio, self.url)
            return _AsyncGrpc(self._grpc, self.model, prompt, sampling_text, stream, timeout_s)
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession()
        return _AsyncHttp(self._session, self.url, self.model, prompt, sampling_text, stream,
                          timeout_s)

    async def generate(self, prompt, **kwargs) -> Result:
        async with self.stream(prompt, **kwargs) as generation:
            return await generation.collect()

    async def close(self):
        if self._grpc is not None:
            await self._grpc.close()
            self._grpc = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
