"""Runs in the Python of Triton's OpenAI frontend, before its main.py; exspec-openai execs it:

    python openai_bootstrap.py FRONTEND_DIR BACKENDS_DIR REMOVE_AT_EXIT [main.py arguments]

Standard library and the frontend's own imports only: it runs by path in the frontend's Python,
where exspec need not be installed. It changes no file of the frontend; it adapts, at import
time, the three places where the frontend (r26.06) falls short of the Triton path:

- the backend folder: every tritonserver.Server gets BACKENDS_DIR unless told otherwise (the
  frontend has no --backend-directory flag);
- cancellation: the frontend drops a request's response iterator when its client goes away and
  never cancels it, so the model generates to the end. Each iterator `Model.async_infer`
  returns is tied to the HTTP request that made it (`TieToClient`, an ASGI middleware outside
  the frontend's own); when that HTTP request ends, or its client disconnects while the answer
  is still being computed, every unfinished one is cancelled (TRITONSERVER_InferenceRequestCancel),
  which the exspec model sees within its 0.1 s poll and aborts in the engine;
- errors: a backend INVALID_ARG becomes the frontend's ClientError, which it answers with 400
  (else 500; UNAVAILABLE, exspec's "busy, retry", becomes 503 on its way out), and an error
  after a stream has started ends the stream with an SSE error event, the shape OpenAI's
  clients raise as APIError, instead of a cut connection.

REMOVE_AT_EXIT ("" for none) is exspec-openai's temporary folder, removed when this process
exits (the frontend handles SIGINT and SIGTERM and returns, so exit handlers run).
"""
from __future__ import annotations

import asyncio
import atexit
import contextvars
import json
import runpy
import shutil
import sys

import tritonserver

# The HTTP request being served: set by TieToClient, read by async_infer (same task, or a task
# it started, which copies the context).
_http_request: contextvars.ContextVar[HttpRequest] = contextvars.ContextVar("exspec_http_request")


class HttpRequest:
    """The in-process inference requests one HTTP request started, and its first backend error."""

    def __init__(self):
        self.inferences: list[Inference] = []
        self.error: tritonserver.TritonError | None = None

    def cancel_unfinished(self):
        for inference in self.inferences:
            inference.cancel_unless_final()


class Inference:
    """A response iterator of async_infer that knows whether its final response came, records
    a backend error on its HTTP request and raises INVALID_ARG as the frontend's ClientError."""

    def __init__(self, responses, http_request: HttpRequest):
        self._responses = responses
        self._http_request = http_request
        self.final = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            response = await self._responses.__anext__()
        except tritonserver.TritonError as error:
            # raise_on_error: the error's last argument is the response that carried it
            self.final = self.final or getattr(error.args[-1], "final", True)
            if self._http_request.error is None:
                self._http_request.error = error
            if isinstance(error, tritonserver.InvalidArgumentError):
                from utils.utils import ClientError   # the frontend's: its routers answer 400
                raise ClientError(error_message(error)) from error
            raise
        self.final = self.final or response.final
        return response

    def cancel_unless_final(self):
        if not self.final:
            self.final = True
            self._responses.cancel()


def error_message(error: BaseException) -> str:
    return str(error.args[0]) if error.args else str(error)


_async_infer = tritonserver.Model.async_infer


def async_infer(self, *args, **kwargs):
    responses = _async_infer(self, *args, **kwargs)
    http_request = _http_request.get(None)
    if http_request is None:                    # not started by an HTTP request
        return responses
    inference = Inference(responses, http_request)
    http_request.inferences.append(inference)
    return inference


class TieToClient:
    """ASGI middleware, outermost: ties the inference requests an HTTP request starts to its
    client (cancelled when it goes or the HTTP request ends) and shapes backend errors.

    Once the request body has been read this middleware alone reads the client's messages (a
    watcher waiting for http.disconnect); the app's later receive() calls wait on the same
    event, so Starlette's streaming responses still see the disconnect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        http_request = HttpRequest()
        token = _http_request.set(http_request)
        gone = asyncio.Event()
        watcher: asyncio.Task | None = None
        response = {"started": False, "stream": False, "ended": False}

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            http_request.cancel_unfinished()

        async def app_receive():
            nonlocal watcher
            if watcher is not None:
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                watcher = asyncio.ensure_future(watch())
            return message

        async def app_send(message):
            if message["type"] == "http.response.start":
                response["started"] = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                response["stream"] = content_type.startswith(b"text/event-stream")
                if message["status"] == 500 and isinstance(http_request.error,
                                                           tritonserver.UnavailableError):
                    message = {**message, "status": 503}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                response["ended"] = True
            await send(message)

        try:
            await self.app(scope, app_receive, app_send)
        except Exception:
            streaming = response["stream"] and response["started"] and not response["ended"]
            if not (streaming and http_request.error is not None):
                raise
            if not gone.is_set():
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse_error(http_request.error)})
        finally:
            _http_request.reset(token)
            http_request.cancel_unfinished()
            if watcher is not None:
                watcher.cancel()


def sse_error(error: tritonserver.TritonError) -> bytes:
    """The stream's last events for a backend error: OpenAI's error object, then [DONE]."""
    client = isinstance(error, tritonserver.InvalidArgumentError)
    body = {"message": error_message(error), "code": 400 if client else 500,
            "type": "invalid_request_error" if client else "server_error"}
    return f"data: {json.dumps({'error': body})}\n\ndata: [DONE]\n\n".encode()


def install(frontend: str, backends: str) -> None:
    class Server(tritonserver.Server):
        def __init__(self, options=None, **kwargs):
            kwargs.setdefault("backend_directory", backends)
            super().__init__(options, **kwargs)

    tritonserver.Server = Server
    tritonserver.Model.async_infer = async_infer
    sys.path.insert(0, frontend)
    from frontend.fastapi_frontend import FastApiFrontend

    create_app = FastApiFrontend._create_app

    def create_tied_app(self):
        app = create_app(self)
        app.add_middleware(TieToClient)   # added last: outermost of the frontend's middleware
        return app

    FastApiFrontend._create_app = create_tied_app


def main() -> None:
    frontend, backends, remove_at_exit = sys.argv[1:4]
    if remove_at_exit:
        atexit.register(shutil.rmtree, remove_at_exit, ignore_errors=True)
    del sys.path[0]                              # this folder: its modules are not the frontend's
    install(frontend, backends)
    sys.argv = [frontend + "/main.py"] + sys.argv[4:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
