"""Request intake: on Triton's thread each request is parsed, then registered with the send
thread and handed to the engine (`add_request`, which may compile a grammar for a second or
tokenize a long prompt) on a small pool of submit threads, so `execute` returns at once and
one heavy request holds up neither Triton's thread nor the requests behind it. Nothing here
sends, counts or logs through Triton: a refused request is handed to the send thread, which
answers it (exspec_log says why one thread owns those objects)."""
from __future__ import annotations

import itertools
import json
import traceback
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from exspec import EngineBusyError, InvalidRequestError
from exspec_messages import Register, Reject
from exspec_request import (ERROR_CODE_TAG_PARAMETER, FLAG_INPUTS, ParsedRequest, parse_request,
                            render_chat)
from exspec_stream import Stream

INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    {"name": "messages", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    # HTTP generate's top-level "stop": [...] (an array reaches a model only as an input)
    {"name": "stop", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in FLAG_INPUTS),
]
SUBMIT_THREADS = 4   # requests admitted at once (each may compile a grammar)


class Intake:
    def __init__(self, engine, sends, lifecycle, log, per_token: bool):
        self.engine = engine
        self.sends = sends
        self.lifecycle = lifecycle
        self.log = log
        self.per_token = per_token
        self._ids = itertools.count()
        self._submits = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="exspec-submit")

    def close(self):
        """finalize, before the drain: every request taken is registered or refused."""
        self._submits.shutdown(wait=True)

    def take(self, request):
        sender = request.get_response_sender()
        tag = False
        try:
            parameters = _request_parameters(request)
            tag = bool(parameters.get(ERROR_CODE_TAG_PARAMETER, False))
            parsed = self._parse(request, parameters)
        except Exception as exc:  # a bug in parsing must still answer this request once
            if not isinstance(exc, (InvalidRequestError, EngineBusyError)):
                self.log.error(f"exspec: parsing failed: {traceback.format_exc()}")
            self.sends.put(Reject(sender, exc, tag))
            return
        request_id = f"{next(self._ids)}:{request.request_id()}"
        stream = Stream(request_id, sender, parsed,
                        parsed.prompt if isinstance(parsed.prompt, str) else None,
                        tag_error_codes=tag)
        self._submits.submit(self._submit, stream)

    def _parse(self, request, parameters: dict) -> ParsedRequest:
        """The request as the engine takes it; refused while draining or once the engine stopped."""
        if not self.lifecycle.intake_open:
            raise EngineBusyError("this server is draining before it shuts down; "
                                  "retry on another server")
        if self.lifecycle.dead:
            raise EngineBusyError(self.lifecycle.dead)
        parsed = parse_request(_inputs(request), parameters, self.engine.config.max_request_bytes)
        if parsed.messages is not None:
            parsed.prompt = render_chat(self.engine.tokenizer, parsed.messages)
        parsed.params.text_per_token = parsed.stream and self.per_token
        return parsed

    def _submit(self, stream: Stream):
        """On a submit thread. Registered before the engine sees it, so its first output finds
        it; whatever goes wrong, the request is answered once (by the send thread)."""
        self.sends.put(Register(stream))
        try:
            self.engine.add_request(stream.request_id, stream.req.prompt, stream.req.params)
        except Exception as exc:
            if not isinstance(exc, (InvalidRequestError, EngineBusyError)):
                self.log.error(f"exspec: add_request failed: {traceback.format_exc()}")
            self.sends.put(Reject(stream.sender, exc, stream.tag_error_codes, stream.request_id))


def _request_parameters(request) -> dict:
    """The request's parameters; Triton hands them over as JSON text, which fails to decode
    when a client sent bytes that are not UTF-8 (found by the fuzz test)."""
    try:
        return json.loads(request.parameters() or "{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(f"request parameters are not valid UTF-8 JSON: {exc}") from None


def _inputs(request) -> dict:
    out = {}
    for spec in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, spec["name"])
        if tensor is not None:
            out[spec["name"]] = tensor.as_numpy()
    return out
