"""The send thread: the one path responses leave by. It owns every in-flight request's state
(a Stream per request id), turns the engine's outputs into responses, polls `is_cancelled` (a
round trip, so on a timer, not per token) and aborts cancelled requests, updates the metrics,
answers refused requests, writes the log, hands finished requests to the traffic recorder
(exspec_traffic) and runs the drain and the tick watchdog between items (design: "The Triton
adapter"). It is the one thread that calls Triton's metrics, response
senders and logger while the model serves (exspec_log says why)."""
from __future__ import annotations

import functools
import queue
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from exspec import EngineBusyError, RequestOutput
from exspec_log import write
from exspec_messages import STOP, Drain, EngineDead, LogLine, Register, Reject, StepFailed, Tick
from exspec_responses import (FINAL, code_name, new_error, response, send_error,
                              speculation_tensors, triton_error)
from exspec_stream import Stream, pieces
from exspec_traffic import TrafficLog, records

CANCEL_POLL_S = 0.1          # how often the send thread asks Triton about cancellations
TRAFFIC_REPORT_S = 10.0      # how often, at most, the log says recorded traffic was dropped


class SendThread:
    def __init__(self, sends, engine, engine_thread, lifecycle, metrics, log, k: int,
                 traffic: TrafficLog | None = None):
        self.sends = sends
        self.log = log
        self.engine = engine
        self.engine_thread = engine_thread   # for the watchdog
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.k = k
        self.traffic = traffic   # model.json's record_traffic; None: off
        self._next_traffic_report = 0.0
        self.tokenizer = engine.tokenizer
        # a token's own text, as vLLM decodes logprobs' decoded_token (cached: few ids recur)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda i: self.tokenizer.decode([i]))
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._loop, name="exspec-send", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self, engine_ended: bool) -> bool:
        """Join, telling the thread to stop first if the engine thread (which would) could not.
        True when the thread ended."""
        if not engine_ended:   # a tick that does not end: still answer everyone
            self.sends.put(STOP)
        self._thread.join(timeout=5.0)
        return not self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self):
        self.log.take()
        next_poll = time.monotonic() + CANCEL_POLL_S
        while True:
            try:
                item = self.sends.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = None
            if item is STOP:
                break
            try:
                self._handle(item)
                next_poll = self._between_items(next_poll)
            except Exception:
                self.log.error(f"exspec: send path: {traceback.format_exc()}")
        self._handle_left_over()
        for stream in list(self._streams.values()):   # nothing may end without a final flag
            self._finish_with_error(stream, new_error(
                "the model was unloaded before this request finished", "UNAVAILABLE"), "error")
        self.metrics.idle()
        self._report_traffic(force=True)
        self.log.hand_over()   # finalize takes it once it sees this thread ended

    def _handle_left_over(self):
        """What reached the queue behind STOP: log lines, and requests refused or registered
        just before intake closed (each still gets its one response)."""
        while True:
            try:
                item = self.sends.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, (LogLine, Reject, Register)):
                self._handle(item)

    def _between_items(self, next_poll: float) -> float:
        """The watchdog, the cancellation poll (when due) and the drain; returns the next
        poll's time."""
        overdue = self.lifecycle.overdue_tick(self.engine_thread)
        if overdue:
            self._handle(EngineDead(overdue))
        now = time.monotonic()
        if now >= next_poll:
            self._poll_cancellations()
            next_poll = now + CANCEL_POLL_S
        if self.lifecycle.drain_file_appeared(now):
            self._handle(Drain(f"{self.lifecycle.drain_file} appeared"))
        self.lifecycle.drain_step(self._streams, self.engine)
        self._report_traffic()
        return next_poll

    def _report_traffic(self, force: bool = False):
        """Records the traffic recorder dropped or failed to write, at most every
        TRAFFIC_REPORT_S (its writer thread may not log: exspec_log)."""
        now = time.monotonic()
        if self.traffic is None or (now < self._next_traffic_report and not force):
            return
        self._next_traffic_report = now + TRAFFIC_REPORT_S
        news = self.traffic.news()
        if news:
            self.log.warn(news)

    def _handle(self, item):
        if item is None:
            return
        if isinstance(item, Tick):
            self._on_tick(item)
        elif isinstance(item, Register):
            self._streams[item.stream.request_id] = item.stream
            item.stream.record = self.traffic is not None
            if self.lifecycle.dead:   # it passed execute's check just before the engine stopped
                self._finish_with_error(item.stream, triton_error(
                    EngineBusyError(self.lifecycle.dead), item.stream.tag_error_codes), "error")
        elif isinstance(item, Reject):
            self.metrics.rejected()
            if item.request_id is not None:
                self._streams.pop(item.request_id, None)
            send_error(item.sender, triton_error(item.error, item.tag_error_codes), self.log)
        elif isinstance(item, LogLine):
            write(item)
        elif isinstance(item, Drain):
            self.lifecycle.start_drain(item.reason, len(self._streams))
        elif isinstance(item, EngineDead):
            self._on_engine_dead(item.message)
        elif isinstance(item, StepFailed):
            for stream in list(self._streams.values()):
                self.engine.abort(stream.request_id)
                self._finish_with_error(stream, new_error(
                    f"engine step failed: {item.message}", "INTERNAL"), "error")

    def _on_tick(self, tick: Tick):
        for output in tick.outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                self._on_output(stream, output)
            elif output.new_token_ids or not output.finished:
                # Its final response is already out (or the adapter failed it): the engine
                # broke "one finished output per request"; the client never sees this.
                self.log.warn(
                    f"exspec: dropped an engine output for {output.request_id} after its "
                    f"final response ({len(output.new_token_ids)} tokens)")
        if tick.stats is not None:
            self.metrics.tick(tick.stats, self.k)
        if not self._streams:
            self.metrics.idle()

    def _on_engine_dead(self, message: str):
        first = self.lifecycle.dead is None
        dead = self.lifecycle.stop_engine(message, len(self._streams))
        if first:
            self.metrics.engine_up.set(0)
        for stream in list(self._streams.values()):
            self._finish_with_error(stream, triton_error(
                EngineBusyError(dead), stream.tag_error_codes), "error")

    def _poll_cancellations(self):
        for stream in self._streams.values():
            if not stream.cancelled and stream.sender.is_cancelled():
                stream.cancelled = True
                # the vLLM backend's words too: log watchers (and its CI) look for them
                self.log.info("[vllm] Cancelling the request")
                self.engine.abort(stream.request_id)

    # -- one engine output -------------------------------------------------------------------
    def _on_output(self, stream: Stream, out: RequestOutput):
        if out.new_token_ids:
            self._record_tokens(stream, out)
        stream.observe(out)
        if not out.finished:   # with n > 1, also a sample's last output while others run
            if stream.req.stream:
                parts = pieces(out)   # none for an output that committed no token
                speculation = speculation_tensors(out) if parts else None   # the step's, shared
                for part in parts:
                    self._respond(stream, part, final=False, speculation=speculation)
            else:
                stream.collect(out)
            return
        if out.finish_reason == "abort" or out.finish_reason == "error":
            self._finish_with_error(stream, *self._final_error(stream, out), out)
            return
        # counted before its final response leaves: a client that scrapes the metrics once it
        # has its answer finds the request counted
        if stream.req.stream:
            parts = pieces(out) or [out]
            speculation = speculation_tensors(out)
            for part in parts[:-1]:
                self._respond(stream, part, final=False, speculation=speculation)
            self._record_finished(stream, out.finish_reason, out)
            self._respond(stream, parts[-1], final=True, speculation=speculation)
        else:
            stream.collect(out)
            self._record_finished(stream, out.finish_reason, out)
            self._respond(stream, out, final=True)
        self._streams.pop(stream.request_id, None)
        if self.traffic is not None:   # completed: cancelled, aborted or failed ones are not
            self.traffic.offer(records(stream))

    def _record_tokens(self, stream: Stream, out: RequestOutput):
        now = time.monotonic()
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.metrics.first_token(now - stream.arrived, out.num_prompt_tokens)
        self.metrics.tokens(len(out.new_token_ids), now - stream.last_token_at
                            if stream.last_token_at is not None else None)
        stream.last_token_at = now

    def _final_error(self, stream: Stream, out: RequestOutput):
        """The error (and metrics outcome) that ends an aborted or failed request."""
        if stream.cancelled:
            self.log.info(f"exspec: request {stream.request_id} cancelled by its client")
            self.log.info("[vllm] Successfully cancelled the request")
            error, outcome = new_error("request cancelled", "CANCELLED"), "cancelled"
        elif out.finish_reason == "abort":
            why = (f"the server is shutting down and the drain deadline "
                   f"({self.lifecycle.drain_timeout_s:g} s) passed; retry on another server"
                   if stream.shutting_down else "aborted")
            error, outcome = new_error(f"request not completed: {why}", "UNAVAILABLE"), "abort"
        else:
            self.log.error(f"exspec: request {stream.request_id} failed: {out.error}")
            last_line = (out.error or "unknown error").strip().splitlines()[-1]
            error, outcome = new_error(f"generation failed: {last_line}", "INTERNAL"), "error"
        if stream.tag_error_codes:
            error = new_error(f"[{code_name(error)}] {error.message()}", code_name(error))
        return error, outcome

    # -- sending -----------------------------------------------------------------------------
    def _respond(self, stream: Stream, out: RequestOutput, final: bool, speculation=None):
        if stream.req.stream:   # cumulative up to this response's last token
            stream.samples[out.index].cumulative_logprob += sum(
                lp.logprob for lp in out.new_logprobs or [])
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
            self.log.warn(f"exspec: send to {stream.request_id} failed: {exc}")

    def _finish_with_error(self, stream: Stream, error, outcome: str, out: RequestOutput | None = None):
        self._streams.pop(stream.request_id, None)
        self._record_finished(stream, outcome, out)   # counted before the answer leaves
        self._send(stream, pb_utils.InferenceResponse(output_tensors=[], error=error), final=True)

    def _record_finished(self, stream: Stream, outcome: str, out: RequestOutput | None):
        now = time.monotonic()
        self.metrics.finished(
            outcome, out.num_prompt_tokens if out else 0, stream.num_output_tokens if out else 0,
            now - stream.arrived,
            None if stream.first_token_at is None else stream.first_token_at - stream.arrived,
            n=len(stream.samples))
