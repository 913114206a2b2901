"""What the other threads put on the send thread's queue: the send thread's whole inbox.

Triton's thread registers and rejects requests, the engine thread hands over ticks and says
when a step failed or the engine died, the drain starts a drain, any thread hands over a log
line (exspec_log); STOP ends the send thread.
"""
from __future__ import annotations

from dataclasses import dataclass

from exspec_stream import Stream


@dataclass
class Register:
    stream: Stream


@dataclass
class Reject:
    """A request refused before the engine took it: the send thread counts it and sends its
    one (error) response."""
    sender: object
    error: Exception
    tag_error_codes: bool = False
    request_id: str | None = None   # once registered: its stream is dropped too


@dataclass
class LogLine:
    level: str   # info, warn or error
    text: str


@dataclass
class Tick:
    outputs: list
    stats: dict | None


@dataclass
class StepFailed:
    message: str


@dataclass
class EngineDead:
    """The engine thread died, or a tick ran past tick_timeout_s: no tick will run again."""
    message: str


@dataclass
class Drain:
    """Stop intake; abort whatever is still in flight once the drain deadline passes."""
    reason: str


STOP = object()
