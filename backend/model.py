"""The exspec Triton backend: a thin adapter between Triton's decoupled Python API and LLMEngine.

Three threads, each with one job:
- Triton's thread calls `execute`, which parses each request, registers it with the send
  thread, hands it to the engine and returns None at once;
- the engine thread runs ticks (`engine.step()`) and queues each tick's outputs together with a
  stats snapshot; it never sends;
- the send thread owns every in-flight request's state: it turns outputs into responses, polls
  `is_cancelled` (a round trip, so on a timer, not per token) and aborts cancelled requests,
  and updates the metrics.
No decoding or scheduling lives here. DESIGN §4 has the contract and the response rules.

Drain (shutdown without dropping streams). After SIGTERM, Triton itself refuses new requests to
the model and keeps in-flight streams going, but it tells the model nothing until it unloads it,
and it unloads only when every client stream has closed or --exit-timeout-secs has run out (then
it exits at once, cutting streams without a final response). So the drain starts from either
of two signals: the file named by the config.pbtxt parameter `drain_file` appearing (the Helm
chart's preStop hook creates it, before the kubelet sends SIGTERM), or `finalize`. Draining
refuses new requests with UNAVAILABLE, lets in-flight requests finish until `drain_timeout_s`
has passed, then ends the rest with an UNAVAILABLE error that says why. Keep drain_timeout_s
below the exit timeout, so that every stream gets its final response before Triton gives up.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from exspec import EngineBusyError, EngineConfig, InvalidRequestError, RequestOutput
from exspec.config import resolve_model_paths
from exspec.engine import LLMEngine
from exspec_metrics import Metrics
from exspec_request import ERROR_CODE_TAG_PARAMETER, FLAG_INPUTS, ParsedRequest, parse_request
from exspec_responses import (FINAL, OUTPUTS, code_name, new_error, response, send_error,
                              speculation_tensors, triton_error)

MODEL_JSON = "model.json"
CANCEL_POLL_S = 0.1          # how often the send thread asks Triton about cancellations
FINALIZE_DRAIN_S = 10.0      # how long finalize lets aborted requests reach their final response
DRAIN_POLL_S = 0.5           # how often the send thread looks for the drain file
ORPHAN_POLL_S = 0.5         # how often the stub checks that tritonserver is still its parent
DEFAULT_DRAIN_TIMEOUT_S = 20.0   # config.pbtxt parameter drain_timeout_s; below the default exit timeout (30 s)

INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in FLAG_INPUTS),
]


@dataclass
class Stream:
    """One in-flight request, owned by the send thread once registered."""
    request_id: str
    sender: object
    req: ParsedRequest
    prompt_text: str | None              # for prepending when not streaming
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    texts: list = field(default_factory=list)       # totals, when not streaming
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    cancelled: bool = False              # the client went away; we asked the engine to abort
    shutting_down: bool = False          # finalize aborted it
    tag_error_codes: bool = False        # forwarded by the unary front model (see exspec_request)
    failure: str | None = None           # set when the adapter failed the request itself


# Items on the send queue besides ticks.
@dataclass
class _Register:
    stream: Stream


@dataclass
class _Reject:
    stream: Stream
    error: Exception


@dataclass
class _Tick:
    outputs: list
    stats: dict | None


@dataclass
class _StepFailed:
    message: str


@dataclass
class _EngineDead:
    """The engine thread died, or a tick ran past tick_timeout_s: no tick will run again."""
    message: str


@dataclass
class _Drain:
    """Stop intake; abort whatever is still in flight once the drain deadline passes."""
    reason: str


_STOP = object()


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        present = config.as_dict()
        have_in = {i["name"] for i in present.get("input", [])}
        have_out = {o["name"] for o in present.get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                config.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                config.add_output(spec)
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
        return config

    # -- setup ------------------------------------------------------------------------------
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("the exspec backend streams: set model_transaction_policy "
                             "{ decoupled: true } in config.pbtxt (or leave it out)")
        self.model_name = args["model_name"]
        engine_config = self._engine_config(args)
        pb_utils.Logger.log_info(f"exspec: loading {engine_config}")
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self.k = engine_config.num_speculative_tokens if engine_config.speculative else 0
        self.per_token = engine_config.stream_granularity == "token"
        # a token's own text, as vLLM decodes logprobs' decoded_token (cached: few ids recur)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda i: self.tokenizer.decode([i]))
        # REPORT_CUSTOM_METRICS: the vLLM backend's switch for its vllm: families
        report_vllm = _parameter(self.model_config, "REPORT_CUSTOM_METRICS").lower() == "true"
        self.metrics = Metrics(self.model_name, args["model_version"],
                               self.engine.max_model_len if report_vllm else None)
        self.drain_file, self.drain_timeout_s = _drain_settings(self.model_config)
        if self.drain_file and os.path.exists(self.drain_file):
            os.remove(self.drain_file)   # left by an earlier run of this container: not for us
        self._ids = itertools.count()
        self._intake_open = True
        self._drain_deadline: float | None = None   # set and read by the send thread only
        self._drained = threading.Event()            # draining and nothing left in flight
        self._sends: queue.Queue = queue.Queue()
        self._stop_engine = threading.Event()   # read by the engine thread only
        self._streams: dict[str, Stream] = {}    # owned by the send thread
        self.tick_timeout_s = engine_config.tick_timeout_s   # the watchdog's limit; None: off
        self._tick_started: float | None = None  # set by the engine thread during a tick
        self._dead: str | None = None            # why the engine stopped; set by the send thread
        self._engine_thread = threading.Thread(target=self._engine_loop, name="exspec-engine",
                                               daemon=True)
        self._send_thread = threading.Thread(target=self._send_loop, name="exspec-send",
                                             daemon=True)
        self._server_pid = os.getppid()
        self._engine_thread.start()
        self._send_thread.start()
        threading.Thread(target=self._guard_orphan, name="exspec-orphan-guard", daemon=True).start()
        warm = self.engine.warm_up
        path = "eager" if warm is None else f"compiled ({warm.describe()})"
        pb_utils.Logger.log_info(f"exspec: model {self.model_name} ready on {engine_config.device}, "
                                 f"{self.engine.threads.describe()}, decode path {path}")

    @staticmethod
    def _engine_config(args) -> EngineConfig:
        """model.json beside the version folder, paths resolved, device from the instance kind."""
        folder = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(folder, MODEL_JSON)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the exspec backend reads its engine "
                                    "arguments (EngineConfig fields) from it")
        with open(path) as f:
            try:
                values = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a JSON object of EngineConfig fields")
        values = resolve_model_paths(values, folder)
        kind = args.get("model_instance_kind", "CPU")
        wanted = values.get("device")
        if kind == "GPU":
            device = f"cuda:{int(args.get('model_instance_device_id', 0))}"
            if wanted and not str(wanted).startswith("cuda"):
                raise ValueError(f"{path} asks for device {wanted!r} but the instance is KIND_GPU; "
                                 "use KIND_CPU in config.pbtxt or drop 'device'")
            values["device"] = device
        elif kind == "CPU":
            if wanted and wanted != "cpu":
                raise ValueError(f"{path} asks for device {wanted!r} but the instance is KIND_CPU; "
                                 "use KIND_GPU in config.pbtxt or drop 'device'")
            values["device"] = "cpu"
        return EngineConfig.from_dict(values)   # unknown keys: ValueError naming them

    # -- intake (Triton's thread) -----------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            tag = False
            try:
                parameters = _request_parameters(request)
                tag = bool(parameters.get(ERROR_CODE_TAG_PARAMETER, False))
                if not self._intake_open:
                    raise EngineBusyError("this server is draining before it shuts down; "
                                          "retry on another server")
                if self._dead:
                    raise EngineBusyError(self._dead)
                parsed = parse_request(_inputs(request), parameters,
                                       self.engine.config.max_request_bytes)
                parsed.params.text_per_token = parsed.stream and self.per_token
            except (InvalidRequestError, EngineBusyError) as exc:
                self.metrics.rejected()
                send_error(sender, triton_error(exc, tag))
                continue
            except Exception as exc:  # a bug in parsing must still answer this request once
                pb_utils.Logger.log_error(f"exspec: parsing failed: {traceback.format_exc()}")
                self.metrics.rejected()
                send_error(sender, triton_error(exc, tag))
                continue
            request_id = f"{next(self._ids)}:{request.request_id()}"
            stream = Stream(request_id, sender, parsed,
                            parsed.prompt if isinstance(parsed.prompt, str) else None,
                            tag_error_codes=tag)
            # Registered before the engine sees it, so its first output finds it.
            self._sends.put(_Register(stream))
            try:
                self.engine.add_request(request_id, parsed.prompt, parsed.params)
            except (InvalidRequestError, EngineBusyError) as exc:
                self._sends.put(_Reject(stream, exc))
            except Exception as exc:
                pb_utils.Logger.log_error(f"exspec: add_request failed: {traceback.format_exc()}")
                self._sends.put(_Reject(stream, exc))
        return None

    # -- the engine thread ------------------------------------------------------------------
    def _engine_loop(self):
        try:
            while True:
                if self._dead:   # the watchdog gave up on this thread's last tick
                    self._stop_engine.wait()
                    break
                if not self.engine.has_unfinished():
                    if self._stop_engine.is_set():
                        break
                    self.engine.wait_for_work(timeout=0.5)
                    continue
                self._tick_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                    stats = self.engine.stats()
                except Exception:
                    message = traceback.format_exc(limit=5)
                    pb_utils.Logger.log_error(f"exspec: engine step failed: {message}")
                    self._sends.put(_StepFailed(message.strip().splitlines()[-1]))
                    time.sleep(0.05)
                    continue
                finally:
                    self._tick_started = None
                if not self._dead:
                    self._sends.put(_Tick(outputs, stats))
        except BaseException:   # e.g. EngineCrash: nothing runs ticks any more
            message = traceback.format_exc()
            pb_utils.Logger.log_error(f"exspec: the engine thread died: {message}")
            self._sends.put(_EngineDead(f"the engine thread died: {message.strip().splitlines()[-1]}"))
            self._stop_engine.wait()   # the send thread answers every request until finalize
        finally:
            self._sends.put(_STOP)

    # -- the send thread --------------------------------------------------------------------
    def _send_loop(self):
        next_poll = time.monotonic() + CANCEL_POLL_S
        next_drain_check = time.monotonic()
        while True:
            try:
                item = self._sends.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            try:
                self._handle(item)
                self._watch_tick()
                now = time.monotonic()
                if now >= next_poll:
                    self._poll_cancellations()
                    next_poll = now + CANCEL_POLL_S
                if self._drain_deadline is None and self.drain_file and now >= next_drain_check:
                    next_drain_check = now + DRAIN_POLL_S
                    if os.path.exists(self.drain_file):
                        self._handle(_Drain(f"{self.drain_file} appeared"))
                if self._drain_deadline is not None:
                    self._drain_step()
            except Exception:
                pb_utils.Logger.log_error(f"exspec: send path: {traceback.format_exc()}")
        for stream in list(self._streams.values()):   # nothing may end without a final flag
            self._finish_with_error(stream, new_error(
                "the model was unloaded before this request finished", "UNAVAILABLE"), "error")
        self.metrics.idle()

    def _watch_tick(self):
        """The watchdog: a tick running past tick_timeout_s stops the engine for good (the
        thread cannot be interrupted, and what it holds is unknown), with its stack logged."""
        started = self._tick_started
        if (self.tick_timeout_s is None or started is None or self._dead
                or time.monotonic() - started <= self.tick_timeout_s):
            return
        frame = sys._current_frames().get(self._engine_thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        pb_utils.Logger.log_error(f"exspec: a tick has run past tick_timeout_s "
                                  f"({self.tick_timeout_s:g} s); the engine thread is at:\n{stack}")
        self._handle(_EngineDead(f"a tick ran past tick_timeout_s ({self.tick_timeout_s:g} s)"))

    def _handle(self, item):
        if item is None:
            return
        if isinstance(item, _Tick):
            for output in item.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    self._on_output(stream, output)
                elif output.new_token_ids or not output.finished:
                    # Its final response is already out (or the adapter failed it): the engine
                    # broke "one finished output per request"; the client never sees this.
                    pb_utils.Logger.log_warn(
                        f"exspec: dropped an engine output for {output.request_id} after its "
                        f"final response ({len(output.new_token_ids)} tokens)")
            if item.stats is not None:
                self.metrics.tick(item.stats, self.k)
            if not self._streams:
                self.metrics.idle()
        elif isinstance(item, _Register):
            self._streams[item.stream.request_id] = item.stream
            if self._dead:   # it passed execute's check just before the engine stopped
                self._finish_with_error(item.stream, triton_error(
                    EngineBusyError(self._dead), item.stream.tag_error_codes), "error")
        elif isinstance(item, _Reject):
            self.metrics.rejected()
            self._streams.pop(item.stream.request_id, None)
            send_error(item.stream.sender, triton_error(item.error, item.stream.tag_error_codes))
        elif isinstance(item, _Drain):
            if self._drain_deadline is None:
                self._intake_open = False
                self._drain_deadline = time.monotonic() + self.drain_timeout_s
                pb_utils.Logger.log_info(
                    f"exspec: draining ({item.reason}): new requests are refused; "
                    f"{len(self._streams)} in flight get up to {self.drain_timeout_s:g} s to finish")
        elif isinstance(item, _EngineDead):
            if self._dead is None:
                self._dead = (f"the exspec engine has stopped ({item.message}); this model "
                              "cannot serve until the server is restarted")
                pb_utils.Logger.log_error(f"exspec: {self._dead}; ending {len(self._streams)} "
                                          "requests in flight")
                self.metrics.engine_up.set(0)
            for stream in list(self._streams.values()):
                self._finish_with_error(stream, triton_error(
                    EngineBusyError(self._dead), stream.tag_error_codes), "error")
        elif isinstance(item, _StepFailed):
            for stream in list(self._streams.values()):
                self.engine.abort(stream.request_id)
                self._finish_with_error(stream, new_error(
                    f"engine step failed: {item.message}", "INTERNAL"), "error")

    def _drain_step(self):
        """While draining: past the deadline, abort what is left (each still gets its final
        response, an UNAVAILABLE error); once nothing is in flight, say so to finalize."""
        if not self._streams:
            if not self._drained.is_set():
                pb_utils.Logger.log_info("exspec: drained: no request in flight")
                self._drained.set()
            return
        if time.monotonic() >= self._drain_deadline:
            late = [s for s in self._streams.values() if not s.shutting_down]
            if late:
                pb_utils.Logger.log_warn(f"exspec: drain deadline passed; ending {len(late)} "
                                         "requests in flight")
            for stream in late:
                stream.shutting_down = True
                self.engine.abort(stream.request_id)

    def _poll_cancellations(self):
        for stream in self._streams.values():
            if not stream.cancelled and stream.sender.is_cancelled():
                stream.cancelled = True
                self.engine.abort(stream.request_id)

    def _on_output(self, stream: Stream, out: RequestOutput):
        if out.new_token_ids:
            now = time.monotonic()
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.first_token(now - stream.arrived, out.num_prompt_tokens)
            self.metrics.tokens(len(out.new_token_ids), now - stream.last_token_at
                                if stream.last_token_at is not None else None)
            stream.last_token_at = now
        if not out.finished:
            if stream.req.stream:
                pieces = self._pieces(out)   # none for an output that committed no token
                speculation = speculation_tensors(out) if pieces else None   # the step's, shared
                for piece in pieces:
                    self._respond(stream, piece, final=False, speculation=speculation)
            else:
                self._collect(stream, out)
            return
        if out.finish_reason == "abort" or out.finish_reason == "error":
            if stream.cancelled:
                error, outcome = new_error("request cancelled", "CANCELLED"), "cancelled"
            elif out.finish_reason == "abort":
                why = (f"the server is shutting down and the drain deadline "
                       f"({self.drain_timeout_s:g} s) passed; retry on another server"
                       if stream.shutting_down else "aborted")
                error, outcome = new_error(f"request not completed: {why}", "UNAVAILABLE"), "abort"
            else:
                pb_utils.Logger.log_error(f"exspec: request {stream.request_id} failed: {out.error}")
                last_line = (out.error or "unknown error").strip().splitlines()[-1]
                error, outcome = new_error(f"generation failed: {last_line}", "INTERNAL"), "error"
            if stream.tag_error_codes:
                error = new_error(f"[{code_name(error)}] {error.message()}", code_name(error))
            self._finish_with_error(stream, error, outcome, out)
            return
        if stream.req.stream:
            pieces = self._pieces(out) or [out]
            speculation = speculation_tensors(out)
            for piece in pieces[:-1]:
                self._respond(stream, piece, final=False, speculation=speculation)
            self._respond(stream, pieces[-1], final=True, speculation=speculation)
        else:
            self._collect(stream, out)
            self._respond(stream, out, final=True)
        self._streams.pop(stream.request_id, None)
        self._record_finished(stream, out.finish_reason, out)

    def _pieces(self, out: RequestOutput) -> list[RequestOutput]:
        """A streamed output as responses: one per token (stream_granularity "token", the
        engine gave each token's text) or the whole step; none when it committed nothing."""
        if not out.new_token_ids:
            return []
        if out.token_texts is None or len(out.new_token_ids) == 1:
            return [out]
        return [dataclasses.replace(out, new_token_ids=[token], text_delta=text, token_texts=[text],
                                    new_logprobs=out.new_logprobs and [out.new_logprobs[i]])
                for i, (token, text) in enumerate(zip(out.new_token_ids, out.token_texts))]

    def _collect(self, stream: Stream, out: RequestOutput):
        """Not streaming: the totals the one response will carry."""
        stream.texts.append(out.text_delta)
        stream.ids += out.new_token_ids
        stream.logprobs += out.new_logprobs or []
        stream.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs or [])

    def _respond(self, stream: Stream, out: RequestOutput, final: bool, speculation=None):
        if stream.req.stream:   # cumulative up to this response's last token
            stream.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs or [])
        self._send(stream, response(stream, out, final, lambda: self._prompt_text(stream),
                                    self.token_text, speculation), final)

    def _prompt_text(self, stream: Stream) -> str:
        if stream.prompt_text is None:   # the prompt came as input_ids
            stream.prompt_text = self.tokenizer.decode(stream.req.prompt)
        return stream.prompt_text

    def _send(self, stream: Stream, response, final: bool):
        try:
            stream.sender.send(response, flags=FINAL if final else 0)
        except Exception as exc:   # the client is gone; the request still ends here
            pb_utils.Logger.log_warn(f"exspec: send to {stream.request_id} failed: {exc}")

    def _finish_with_error(self, stream: Stream, error, outcome: str, out: RequestOutput | None = None):
        self._streams.pop(stream.request_id, None)
        self._send(stream, pb_utils.InferenceResponse(output_tensors=[], error=error), final=True)
        self._record_finished(stream, outcome, out)

    def _record_finished(self, stream: Stream, outcome: str, out: RequestOutput | None):
        now = time.monotonic()
        self.metrics.finished(
            outcome, out.num_prompt_tokens if out else 0, out.num_output_tokens if out else 0,
            now - stream.arrived,
            None if stream.first_token_at is None else stream.first_token_at - stream.arrived)

    # -- health -----------------------------------------------------------------------------
    def is_ready(self):
        """/v2/models/<model>/ready on Triton 26.03 and later (older ones never ask): not ready
        once the engine stopped or while draining, so load balancers and Kubernetes stop
        sending requests here. The exspec:engine_up gauge says the same on any version."""
        return self._dead is None and self._intake_open

    def _guard_orphan(self):
        """Exit once tritonserver is gone. The stub's own check can hang: a response send
        blocks until the server acknowledges it, and a dead server never does (seen here: the
        stub outlived tritonserver by over a minute after an exit timeout cut live streams)."""
        while True:
            time.sleep(ORPHAN_POLL_S)
            if os.getppid() != self._server_pid:
                print(f"exspec: tritonserver (pid {self._server_pid}) is gone; the stub for "
                      f"{self.model_name} exits", file=sys.stderr, flush=True)
                os._exit(0)

    # -- shutdown ---------------------------------------------------------------------------
    def finalize(self):
        """Bounded: drain (stop intake, let in-flight requests finish until the drain deadline,
        end the rest with an error), wait for the pool to empty, join threads with timeouts."""
        self._intake_open = False
        self._sends.put(_Drain("finalize"))
        if not self._drained.wait(timeout=self.drain_timeout_s + FINALIZE_DRAIN_S):
            pb_utils.Logger.log_warn("exspec: finalize: requests still in flight after the drain")
        deadline = time.monotonic() + FINALIZE_DRAIN_S
        while self.engine.has_unfinished() and not self._dead and time.monotonic() < deadline:
            time.sleep(0.05)   # a dead engine will not empty its pool: do not wait for it
        self._stop_engine.set()
        self._engine_thread.join(timeout=max(1.0, deadline - time.monotonic()))
        if self._engine_thread.is_alive():   # a tick that does not end: still answer everyone
            self._sends.put(_STOP)
        self._send_thread.join(timeout=5.0)
        pb_utils.Logger.log_info("exspec: finalized")


def _parameter(model_config: dict, name: str) -> str:
    """A config.pbtxt parameter's string_value, stripped; "" when absent."""
    return model_config.get("parameters", {}).get(name, {}).get("string_value", "").strip()


def _drain_settings(model_config: dict) -> tuple[str | None, float]:
    """config.pbtxt parameters drain_file (default: none) and drain_timeout_s (seconds >= 0)."""
    raw = _parameter(model_config, "drain_timeout_s")
    try:
        timeout = float(raw) if raw else DEFAULT_DRAIN_TIMEOUT_S
    except ValueError:
        raise ValueError(f"config.pbtxt parameter drain_timeout_s must be a number of seconds, "
                         f"got {raw!r}") from None
    if timeout < 0:
        raise ValueError(f"config.pbtxt parameter drain_timeout_s must be >= 0, got {timeout:g}")
    return _parameter(model_config, "drain_file") or None, timeout


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
