"""The adapter's log is written by one thread at a time (backend/exspec_log.py): the loading
thread, the send thread while it runs, then finalize's. A second thread calling a Triton object
at the same time crashed tritonserver; the logger is only reachable inside the Python stub, so
this test puts a recorder in its place that notes which thread wrote each line, and drives
the model's threads through load, serving and finalize as model.py and exspec_send.py do."""
from __future__ import annotations

import logging
import queue
import sys
import threading
import types
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parent.parent / "backend"


@pytest.fixture
def exspec_log(monkeypatch):
    written = []   # (thread ident, level, text), in the order the "logger" saw them
    logger = types.SimpleNamespace(**{
        f"log_{level}": (lambda text, level=level: written.append((threading.get_ident(), level, text)))
        for level in ("info", "warn", "error")})
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(Logger=logger))
    monkeypatch.syspath_prepend(str(BACKEND))
    monkeypatch.delitem(sys.modules, "exspec_log", raising=False)
    import exspec_log
    yield exspec_log, written
    monkeypatch.delitem(sys.modules, "exspec_log", raising=False)


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

        def send_loop():                                     # exspec_send's loop, in brief
            log.take()
            while not sends.empty():
                mod.write(sends.get_nowait())
            log.warn("send path line")
            log.hand_over()
        sender = threading.Thread(target=send_loop)
        sender.start()
        sender.join()
        assert [w[2] for w in written[2:]] == ["engine record", "ready", "send path line"]
        assert writers()[2:] == [sender.ident] * 3

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
