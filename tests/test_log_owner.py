"""The adapter's log is written by one thread at a time (backend/exspec_log.py): the loading
thread, the send thread while it runs, then finalize's. A second thread calling a Triton object
at the same time crashed tritonserver; the logger and the response senders are only reachable
inside the Python stub, so this test puts recorders in their place (a stand-in
triton_python_backend_utils) that note which thread called them, and drives the model's threads
through load, serving and finalize as model.py does, serving through the real SendThread
(exspec_send.py)."""
from __future__ import annotations

import logging
import queue
import sys
import threading
import types
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parent.parent / "backend"


class TritonError:
    """The stub's error type, as exspec_responses uses it."""
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

    def __init__(self, message, code):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


ADAPTER_MODULES = ("exspec_log", "exspec_send", "exspec_responses", "exspec_messages",
                   "exspec_stream", "exspec_request", "exspec_traffic")


@pytest.fixture
def exspec_log(monkeypatch):
    written = []   # (thread ident, level, text), in the order the "logger" saw them
    logger = types.SimpleNamespace(**{
        f"log_{level}": (lambda text, level=level: written.append((threading.get_ident(), level, text)))
        for level in ("info", "warn", "error")})
    stub = types.SimpleNamespace(
        Logger=logger, TritonError=TritonError, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        InferenceResponse=lambda output_tensors, error=None: types.SimpleNamespace(error=error))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    monkeypatch.syspath_prepend(str(BACKEND))
    for name in ADAPTER_MODULES:   # each imported against this test's stub
        monkeypatch.delitem(sys.modules, name, raising=False)
    import exspec_log
    yield exspec_log, written
    for name in ADAPTER_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)


class Sender:
    """A request's response sender that notes the thread of each send."""

    def __init__(self):
        self.sent = []   # (thread ident, error message, flags)

    def send(self, response, flags=0):
        self.sent.append((threading.get_ident(), response.error.message(), flags))


def send_thread(log, sends, engine_thread):
    """The real SendThread, its engine, lifecycle and metrics reduced to what a refusal and
    a log line touch."""
    from exspec_send import SendThread
    lifecycle = types.SimpleNamespace(dead=None, overdue_tick=lambda thread: None,
                                      drain_file_appeared=lambda now: False,
                                      drain_step=lambda streams, engine: None)
    metrics = types.SimpleNamespace(rejected=lambda: None, idle=lambda: None)
    engine = types.SimpleNamespace(tokenizer=None, abort=lambda request_id: None)
    return SendThread(sends, engine, engine_thread, lifecycle, metrics, log, k=0)


class Worker:
    """A thread that lives through every phase (as the engine thread does) and runs what it is
    given, one call at a time."""

    def __init__(self):
        self.jobs, self.done = queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            job()
            self.done.put(True)

    def __call__(self, job):
        self.jobs.put(job)
        self.done.get(timeout=10)

    def stop(self):
        self.jobs.put(None)
        self.thread.join()


def test_each_line_is_written_once_by_the_logs_owner_of_the_moment(exspec_log):
    mod, written = exspec_log
    sends = queue.Queue()
    log = mod.Log(sends)
    engine_logger = logging.getLogger("exspec-test-owner")
    engine_logger.setLevel(logging.INFO)
    engine_logger.addHandler(mod.EngineLog(log))
    loading, engine = threading.get_ident(), Worker()
    writers = lambda: [w[0] for w in written]   # noqa: E731
    try:
        log.info("loading")                                  # the loading thread owns the log
        engine_logger.info("warm-up summary")                # the engine's record, same thread
        engine(lambda: engine_logger.warning("engine record"))   # another thread: queued
        log.hand_over()                                      # model.initialize, then the send thread
        log.info("ready")                                    # queued too
        assert [w[2] for w in written] == ["loading", "warm-up summary"]
        assert writers() == [loading, loading]

        # two kinds of refused request at once, the crash of old: a refusal from execute's
        # thread, and an engine record that comes with one from the engine thread
        from exspec import EngineBusyError, InvalidRequestError
        from exspec_messages import Reject
        refused = Sender(), Sender()
        sender = send_thread(log, sends, engine.thread)
        sender.start()
        sends.put(Reject(refused[0], InvalidRequestError("max_tokens must be at least 1")))
        engine(lambda: (engine_logger.warning("engine refusal"),
                        sends.put(Reject(refused[1], EngineBusyError("the queue is full")))))
        sender.stop(engine_ended=False)                      # STOP, then finalize's turn
        assert not sender._thread.is_alive()
        assert [w[2] for w in written[2:]] == ["engine record", "ready", "engine refusal"]
        assert writers()[2:] == [sender._thread.ident] * 3
        assert [r.sent for r in refused] == [[(sender._thread.ident, "max_tokens must be at least 1", 1)],
                                             [(sender._thread.ident, "the queue is full", 1)]]

        # the send thread has ended and the engine thread still runs: its lines must wait
        engine(lambda: (engine_logger.error("late engine record"), log.error("late engine line")))
        assert len(written) == 5

        log.take()                                           # model.finalize, the send thread ended
        log.write_queued()
        log.info("finalized")
        assert [w[1:] for w in written[5:]] == [("error", "late engine record"),
                                                ("error", "late engine line"), ("info", "finalized")]
        assert writers()[5:] == [loading] * 3
        assert engine.thread.ident not in writers()
    finally:
        engine.stop()
        engine_logger.handlers.clear()


def test_only_the_owner_writes_what_queued(exspec_log):
    mod, written = exspec_log
    log = mod.Log(queue.Queue())
    log.hand_over()
    log.info("queued")
    with pytest.raises(AssertionError, match="owner"):
        log.write_queued()
    assert written == []
