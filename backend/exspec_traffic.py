"""Recording served traffic (model.json `record_traffic`): each finished request as the offline
replay reads it (`python -m exspec.bench.replay --traces`), one JSON line per sample.

A line: "prompt_token_ids" (the prompt as the model saw it: a chat after its template, text
after tokenization), "output_token_ids" (what the client received, the EOS id included where
EOS stopped it), "finish_reason" (stop or length), "category" (the request's `category`
parameter, when it gave one) and, for a request with n > 1, "sample" (its index). Only requests
that completed are written: a cancelled, aborted (drain deadline) or failed request, and a
refused one, writes nothing, since the replay reads every line as a whole answer.

Neither the engine's step nor the send thread waits on the disk: the send thread offers each
request's lines to a bounded queue and drops them when it is full (counted; the send thread
logs the count, `news`), and a writer thread of its own appends them, flushing after each batch.
Past max_bytes the file is renamed to <path>.1 (replacing the old one) and a new one begun.
The writer never calls Triton (exspec_log): its errors are counted and reported the same way.
"""
from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import dataclass

QUEUE_RECORDS = 4096          # lines waiting for the writer before new ones are dropped
DEFAULT_MAX_BYTES = 256 << 20  # record_traffic.max_bytes when not given
_STOP = object()


@dataclass(frozen=True)
class TrafficSettings:
    path: str          # absolute
    max_bytes: int = DEFAULT_MAX_BYTES


def records(stream) -> list[dict]:
    """A finished request's lines (exspec_stream.Stream, every sample done), one per sample."""
    many = len(stream.samples) > 1
    lines = []
    for index, sample in enumerate(stream.samples):
        line = {"prompt_token_ids": stream.prompt_ids, "output_token_ids": sample.ids,
                "finish_reason": sample.finish_reason}
        if stream.req.category is not None:
            line["category"] = stream.req.category
        if many:
            line["sample"] = index
        lines.append(line)
    return lines


class TrafficLog:
    """The bounded queue and the writer thread behind it. `offer` and `news` are the send
    thread's; the file is the writer's."""

    def __init__(self, settings: TrafficSettings, queue_records: int = QUEUE_RECORDS):
        self.path = settings.path
        self.max_bytes = settings.max_bytes
        self._queue: queue.Queue = queue.Queue(maxsize=queue_records)
        try:   # at load: a path we cannot write fails the load
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "ab")
        except OSError as exc:
            raise OSError(f"model.json record_traffic: cannot write {self.path}: {exc}") from None
        self._size = os.fstat(self._file.fileno()).st_size
        self.dropped = 0             # the send thread's count
        self.write_errors = 0        # the writer's count (failed writes and rotations)
        self.last_error: str | None = None
        self._reported = (0, 0)      # (dropped, write_errors) as last reported
        self._thread = threading.Thread(target=self._loop, name="exspec-traffic", daemon=True)

    def start(self):
        self._thread.start()

    def offer(self, lines: list[dict]) -> None:
        """Never blocks: what the queue cannot take is dropped and counted."""
        for line in lines:
            try:
                self._queue.put_nowait(line)
            except queue.Full:
                self.dropped += 1

    def news(self) -> str | None:
        """What went wrong since the last call, as one log line, or None."""
        now = (self.dropped, self.write_errors)
        if now == self._reported:
            return None
        dropped, errors = (a - b for a, b in zip(now, self._reported))
        self._reported = now
        parts = []
        if dropped:
            parts.append(f"dropped {dropped} records (the writer's queue of {self._queue.maxsize} "
                         f"was full; {self.dropped} in all)")
        if errors:
            parts.append(f"{errors} write or rotation errors ({self.write_errors} in all; last: "
                         f"{self.last_error})")
        return f"exspec: record_traffic {self.path}: " + "; ".join(parts)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop (bounded: finalize calls it)."""
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                pass
            self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._file.close()

    # -- the writer thread -------------------------------------------------------------------
    def _loop(self):
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not _STOP:   # what else is waiting: one flush for all of it
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for line in batch:
                if line is not _STOP:
                    self._write(line)
            try:
                self._file.flush()
            except (OSError, ValueError) as exc:
                self._failed(exc)
            if batch[-1] is _STOP:
                return

    def _write(self, line: dict) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        if self._size and self._size + len(data) > self.max_bytes:
            try:
                self._rotate()
            except OSError as exc:   # counted; the line is still written (the file grows)
                self._failed(exc)
        try:
            self._file.write(data)
            self._size += len(data)
        except (OSError, ValueError) as exc:   # ValueError: a reopen failed, the file is closed
            self._failed(exc)

    def _rotate(self) -> None:
        self._file.close()
        try:
            os.replace(self.path, self.path + ".1")   # the one old file kept
        finally:   # renamed or not, write on (a failed rename is counted by _write)
            self._file = open(self.path, "ab")
            self._size = os.fstat(self._file.fileno()).st_size

    def _failed(self, exc: Exception) -> None:
        self.write_errors += 1
        self.last_error = str(exc)
