"""The port allocator servers started side by side share (exspec.serving.ports)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
from exspec.serving.ports import PortReservation, ports_in_use, reserve_ports  # noqa: E402


def test_threads_allocating_at_once_get_distinct_ports():
    threads, results, start = 16, [], threading.Barrier(16)

    def claim():
        start.wait()
        results.append(reserve_ports(3))

    workers = [threading.Thread(target=claim) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    try:
        ports = [p for r in results for p in r.ports]
        assert len(ports) == threads * 3
        assert len(set(ports)) == len(ports), f"a port was handed out twice: {sorted(ports)}"
    finally:
        for r in results:
            r.release()


def test_processes_allocating_at_once_get_distinct_ports():
    """Each process reserves, reports its ports and holds them until its stdin closes."""
    # The module alone, by path: importing the exspec package would load torch in each process.
    code = ("import importlib.util, sys;"
            "spec = importlib.util.spec_from_file_location('ports', sys.argv[1]);"
            "ports = importlib.util.module_from_spec(spec); spec.loader.exec_module(ports);"
            "r = ports.reserve_ports(5); print(*r.ports, flush=True); sys.stdin.read()")
    backend = str(Path(__file__).resolve().parents[1] / "backend" / "exspec" / "serving" / "ports.py")
    procs = [subprocess.Popen([sys.executable, "-c", code, backend], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        ports = [int(p) for proc in procs for p in proc.stdout.readline().split()]
        assert len(ports) == 20
        assert len(set(ports)) == 20, f"two processes were handed one port: {sorted(ports)}"
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(10)


def test_a_reserved_port_is_not_handed_out_again_until_released():
    with reserve_ports(1) as (held,):
        again = [p for _ in range(50) for p in reserve_ports(20).ports]
        assert held not in again
    # released: the lock is free, so a reservation can take exactly that port again
    from exspec.serving.ports import _lock
    fd = _lock(held)
    assert fd is not None
    PortReservation([held], [fd]).release()


def test_a_port_in_time_wait_is_reported_free():
    """A stopped server's last connections sit in TIME_WAIT for a minute; the next server
    binds the port anyway (servers set SO_REUSEADDR, tritonserver too), so it is free."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as servers do
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()          # the server side closes first: its end goes to TIME_WAIT
    time.sleep(0.1)
    client.close()
    listener.close()
    with socket.socket() as plain:   # the state is real: a bind without SO_REUSEADDR fails
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert ports_in_use([port]) == []
    assert ports_in_use([port], host="127.0.0.1") == []


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_a_listening_socket_is_reported_busy(address):
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert ports_in_use([port]) == [port]
        assert ports_in_use([port], host="127.0.0.1") == [port]


def test_reserved_ports_are_free_when_handed_out():
    with reserve_ports(4) as ports:
        assert ports_in_use(ports) == []
