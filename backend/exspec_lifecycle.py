"""Whether the exspec model takes requests, and how it stops: the drain, the tick watchdog and
the orphan guard (design: "The Triton adapter").

Drain (shutdown without dropping streams). After SIGTERM, Triton itself refuses new requests to
the model and keeps in-flight streams going, but it tells the model nothing until it unloads it,
and it unloads only when every client stream has closed or --exit-timeout-secs has run out (then
it exits at once, cutting streams without a final response). So the drain starts from either
of two signals: the file named by the config.pbtxt parameter `drain_file` appearing (the Helm
chart's preStop hook creates it, before the kubelet sends SIGTERM), or `finalize`. Draining
refuses new requests with UNAVAILABLE, lets in-flight requests finish until `drain_timeout_s`
has passed, then ends the rest with an UNAVAILABLE error that says why. Keep drain_timeout_s
below the exit timeout, so that every stream gets its final response before Triton gives up.

A dead engine (its thread died, or the watchdog gave up on a tick) makes the model not ready
(`is_ready`, Triton 26.03 and later) and, unless config.pbtxt's `unload_when_dead` is "false",
unloads it, so that the repository index says UNAVAILABLE and the model's ready endpoint fails
on any Triton version (Triton unloads only under --model-control-mode=explicit, which
exspec-serve uses; otherwise the log says so). With the vLLM backend's ENABLE_VLLM_HEALTH_CHECK
"true" the requests it refuses get that backend's exact words (the reason goes to the log).

The send thread runs the drain and the watchdog between the items it handles; Triton's thread
reads `intake_open` and `dead` (plain attributes, each written by one thread at a time).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from exspec_messages import Drain

FINALIZE_DRAIN_S = 10.0      # how long finalize lets aborted requests reach their final response
DRAIN_POLL_S = 0.5           # how often the send thread looks for the drain file
ORPHAN_POLL_S = 0.5          # how often the stub checks that tritonserver is still its parent


# The vLLM backend's words for requests to an unhealthy engine, which its CI tests match.
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


class Lifecycle:
    def __init__(self, drain_file: str | None, drain_timeout_s: float, tick_timeout_s: float | None,
                 log, unload_when_dead: str | None = None, vllm_words: bool = False):
        self.log = log
        self.unload_when_dead = unload_when_dead   # the model to unload once dead
        self.vllm_words = vllm_words               # ENABLE_VLLM_HEALTH_CHECK: its words on the wire
        self.drain_file = drain_file
        self.drain_timeout_s = drain_timeout_s
        self.tick_timeout_s = tick_timeout_s      # the watchdog's limit; None: off
        if drain_file and os.path.exists(drain_file):
            os.remove(drain_file)   # left by an earlier run of this container: not for us
        self.intake_open = True
        self.dead: str | None = None               # why the engine stopped; set by the send thread
        self.drain_deadline: float | None = None   # set and read by the send thread only
        self.drained = threading.Event()           # draining and nothing left in flight
        self._next_drain_check = time.monotonic()

    @property
    def ready(self) -> bool:
        return self.dead is None and self.intake_open

    # -- the drain (on the send thread) ------------------------------------------------------
    def drain_file_appeared(self, now: float) -> bool:
        """Not yet draining and the drain file is there (looked for every DRAIN_POLL_S)."""
        if self.drain_deadline is not None or not self.drain_file or now < self._next_drain_check:
            return False
        self._next_drain_check = now + DRAIN_POLL_S
        return os.path.exists(self.drain_file)

    def start_drain(self, reason: str, in_flight: int):
        if self.drain_deadline is None:
            self.intake_open = False
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            self.log.info(
                f"exspec: draining ({reason}): new requests are refused; "
                f"{in_flight} in flight get up to {self.drain_timeout_s:g} s to finish")

    def drain_step(self, streams: dict, engine):
        """While draining: past the deadline, abort what is left (each still gets its final
        response, an UNAVAILABLE error); once nothing is in flight, say so to finalize."""
        if self.drain_deadline is None:
            return
        if not streams:
            if not self.drained.is_set():
                self.log.info("exspec: drained: no request in flight")
                self.drained.set()
            return
        if time.monotonic() >= self.drain_deadline:
            late = [s for s in streams.values() if not s.shutting_down]
            if late:
                self.log.warn(f"exspec: drain deadline passed; ending {len(late)} "
                                         "requests in flight")
            for stream in late:
                stream.shutting_down = True
                engine.abort(stream.request_id)

    def drain_for_unload(self, sends):
        """finalize's drain: stop intake, have the send thread drain, and wait (bounded)
        until nothing is in flight."""
        self.intake_open = False
        sends.put(Drain("finalize"))
        if not self.drained.wait(timeout=self.drain_timeout_s + FINALIZE_DRAIN_S):
            self.log.warn("exspec: finalize: requests still in flight after the drain")

    # -- the engine stopping -----------------------------------------------------------------
    def stop_engine(self, message: str, in_flight: int) -> str:
        """Mark the engine stopped for good (the first reason wins); return why, as the
        requests it ends and the ones refused from now on are told."""
        if self.dead is None:
            reason = (f"the exspec engine has stopped ({message}); this model cannot serve "
                      "until the server is restarted")
            # the vLLM backend's sentence alone: its CI compares the error text with ==
            self.dead = UNHEALTHY if self.vllm_words else reason
            self.log.error(f"exspec: {reason}; ending {in_flight} requests in flight")
            if self.unload_when_dead:
                # its own thread: the unload calls finalize, which joins the calling send thread
                threading.Thread(target=self._unload, name="exspec-unload", daemon=True).start()
        return self.dead

    def _unload(self):
        name = self.unload_when_dead
        self.log.error(f"exspec: the engine is not healthy; unloading model {name} "
                       "(unload_when_dead)")
        try:
            # the one Triton call off the send thread: made once, on a thread of its own, since
            # the unload runs finalize, which joins the send thread
            pb_utils.unload_model(name)
        except Exception as exc:   # e.g. not in explicit model control mode
            self.log.error(
                f"exspec: could not unload model {name}: {exc}; Triton unloads a model only "
                "under --model-control-mode=explicit (the model stays loaded, refusing requests, "
                "and not ready on Triton 26.03 and later)")

    def overdue_tick(self, engine_thread) -> str | None:
        """The watchdog: a tick running past tick_timeout_s stops the engine for good (the
        thread cannot be interrupted, and what it holds is unknown), with its stack logged.
        Returns why, or None while all is well."""
        started = engine_thread.tick_started
        if (self.tick_timeout_s is None or started is None or self.dead
                or time.monotonic() - started <= self.tick_timeout_s):
            return None
        frame = sys._current_frames().get(engine_thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        self.log.error(f"exspec: a tick has run past tick_timeout_s "
                                  f"({self.tick_timeout_s:g} s); the engine thread is at:\n{stack}")
        return f"a tick ran past tick_timeout_s ({self.tick_timeout_s:g} s)"


def start_orphan_guard(model_name: str):
    """Exit once tritonserver is gone. The stub's own check can hang: a response send
    blocks until the server acknowledges it, and a dead server never does (seen here: the
    stub outlived tritonserver by over a minute after an exit timeout cut live streams)."""
    server_pid = os.getppid()

    def guard():
        while True:
            time.sleep(ORPHAN_POLL_S)
            if os.getppid() != server_pid:
                print(f"exspec: tritonserver (pid {server_pid}) is gone; the stub for "
                      f"{model_name} exits", file=sys.stderr, flush=True)
                os._exit(0)

    threading.Thread(target=guard, name="exspec-orphan-guard", daemon=True).start()
