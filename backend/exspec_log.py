"""The model's log, written by one thread: the send thread while it runs.

Every Triton object the adapter calls while serving (its metrics, the response senders and the
logger) has one owner, the send thread: a refusal counted on Triton's execute thread while the
send thread counted another crashed tritonserver (SIGSEGV in libtriton_python.so) within
seconds. A line logged on another thread (Triton's, the engine thread, the unload thread) goes
on the send queue and the send thread writes it; before the send thread starts and once it has
ended nothing else serves, and the caller writes the line itself.
"""
from __future__ import annotations

import logging
import threading

import triton_python_backend_utils as pb_utils

from exspec_messages import LogLine


class Log:
    def __init__(self, sends):
        self.sends = sends
        self.owner: int | None = None   # the send thread's ident while it runs; set by it

    def info(self, text: str) -> None:
        self._log("info", text)

    def warn(self, text: str) -> None:
        self._log("warn", text)

    def error(self, text: str) -> None:
        self._log("error", text)

    def _log(self, level: str, text: str) -> None:
        if self.owner is None or self.owner == threading.get_ident():
            write(LogLine(level, text))
        else:
            self.sends.put(LogLine(level, text))


class EngineLog(logging.Handler):
    """The engine's own `exspec` logger (its warm-up summary, a shape compiled after READY,
    features turned off at load) into Triton's log: every record goes on the send queue, whatever
    thread logged it, and the send thread writes it (those logged while the model loads, once it
    starts). Without it they went nowhere: the stub's Python has no logging handler."""

    def __init__(self, sends):
        super().__init__(logging.INFO)
        self.sends = sends

    def emit(self, record: logging.LogRecord) -> None:
        level = ("error" if record.levelno >= logging.ERROR else
                 "warn" if record.levelno >= logging.WARNING else "info")
        self.sends.put(LogLine(level, self.format(record)))


def write(line: LogLine) -> None:
    {"info": pb_utils.Logger.log_info, "warn": pb_utils.Logger.log_warn,
     "error": pb_utils.Logger.log_error}[line.level](line.text)
