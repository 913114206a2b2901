"""Ports for servers started side by side: distinct, and reserved until their server binds them.

Asking the kernel for a free port and closing the probe socket frees the port again at once, so
two servers starting together (threads of one test, or two test processes) could be handed the
same one. `reserve_ports` instead holds an exclusive lock file per port (flock: released by the
kernel if the holder dies) until the caller releases it, once its server listens. Candidates
come from below the kernel's ephemeral range, where no outgoing connection is ever given a
local port, so a client's connection cannot take a port between reservation and bind either.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "exspec-ports"
LOWEST_PORT = 20000
_random = random.SystemRandom()   # separate processes must not walk one sequence


def ports_in_use(ports, host: str = "0.0.0.0") -> list[int]:
    """Those of `ports` a server could not bind on `host` now: something listens there.

    Binds with SO_REUSEADDR, as servers do, so a port whose last connection is still in
    TIME_WAIT counts as free (it is: the next server binds it), while a listening socket on
    the same or the wildcard address still makes the bind fail."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _candidates():
    """Ports below the ephemeral range in random order, then (if that range is exhausted or
    absent) whatever the kernel hands out."""
    low, _ = _ephemeral_range()
    if low - LOWEST_PORT >= 1000:
        span = list(range(LOWEST_PORT, low))
        _random.shuffle(span)
        yield from span
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            yield s.getsockname()[1]


class PortReservation:
    """Distinct ports held until `release()` (or the end of a `with` block)."""

    def __init__(self, ports: list[int], locks: list[int]):
        self.ports = ports
        self._locks = locks

    def release(self) -> None:
        while self._locks:
            os.close(self._locks.pop())   # closing the descriptor drops its flock

    def __enter__(self) -> list[int]:
        return self.ports

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def _lock(port: int) -> int | None:
    """An open descriptor holding `port`'s lock file, or None if another holder has it."""
    LOCK_DIR.mkdir(mode=0o1777, parents=True, exist_ok=True)
    try:
        fd = os.open(LOCK_DIR / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:     # another user's lock file: treat the port as theirs
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def reserve_ports(count: int, host: str = "0.0.0.0", attempts: int = 10_000) -> PortReservation:
    """`count` distinct ports that are free on `host` and reserved by no one else, held until
    released. Threads of one process and separate processes never get the same port while it
    is held (each lock file is locked through its own open descriptor)."""
    ports, locks = [], []
    for candidate in _candidates():
        if len(ports) == count:
            break
        attempts -= 1
        if attempts < 0:
            PortReservation(ports, locks).release()
            raise RuntimeError(f"could not reserve {count} free ports")
        if candidate in ports:
            continue
        fd = _lock(candidate)
        if fd is None:
            continue
        if ports_in_use([candidate], host):     # checked under the lock: nobody else tests it now
            os.close(fd)
            continue
        ports.append(candidate)
        locks.append(fd)
    return PortReservation(ports, locks)
