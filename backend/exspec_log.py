"""The model's log, written by one thread at a time: its owner.

Every Triton object the adapter calls while serving (its metrics, the response senders and the
logger) has one owner, the send thread: a refusal counted on Triton's execute thread while the
send thread counted another crashed tritonserver (SIGSEGV in libtriton_python.so) within
seconds. The log's owner is the loading thread until the send thread starts, the send thread
while it runs, and finalize's thread once the send thread has ended. A line logged on any other
thread (Triton's, the engine thread, the unload thread) goes on the send queue, which the send
thread writes as it serves and the owner writes after a failed load or the send thread's end;
a thread still running once finalize has written the queue (an engine thread past its join)
is not written at all, rather than beside finalize's own lines.
"""
from __future__ import annotations

import logging
import queue
import threading

import triton_python_backend_utils as pb_utils

from exspec_messages import LogLine

_HANDED_OVER = -1   # no thread's ident: every line queues until the next owner takes the log


class Log:
    def __init__(self, sends):
        self.sends = sends
        self.owner = threading.get_ident()   # the loading thread, until it hands the log over

    def hand_over(self) -> None:
        """From now on lines queue until the next owner takes the log: the loading thread's
        last act before starting the send thread, the send thread's as it ends (a thread's ident
        is reused once it ends, so a dead owner's must not stay)."""
        self.owner = _HANDED_OVER

    def take(self) -> None:
        """This thread owns the log from now on: the send thread as it starts, finalize once
        the send thread has ended."""
        self.owner = threading.get_ident()

    def write_queued(self) -> None:
        """Writes the log lines on the queue (the owner only: after a failed load, or once the
        send thread ended); anything else there has no one to serve it any more."""
        assert self.owner == threading.get_ident(), "only the log's owner writes"
        while True:
            try:
                item = self.sends.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, LogLine):
                write(item)

    def info(self, text: str) -> None:
        self.line("info", text)

    def warn(self, text: str) -> None:
        self.line("warn", text)

    def error(self, text: str) -> None:
        self.line("error", text)

    def line(self, level: str, text: str) -> None:
        if self.owner == threading.get_ident():
            write(LogLine(level, text))
        else:
            self.sends.put(LogLine(level, text))


class EngineLog(logging.Handler):
    """The engine's own `exspec` logger (its warm-up summary, a shape compiled after READY,
    features turned off at load) into Triton's log, through the model's Log: written at once on
    its owner's thread, queued from any other. Without it they went nowhere: the stub's Python
    has no logging handler."""

    def __init__(self, log: Log):
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        level = ("error" if record.levelno >= logging.ERROR else
                 "warn" if record.levelno >= logging.WARNING else "info")
        self.log.line(level, self.format(record))


def write(line: LogLine) -> None:
    {"info": pb_utils.Logger.log_info, "warn": pb_utils.Logger.log_warn,
     "error": pb_utils.Logger.log_error}[line.level](line.text)
