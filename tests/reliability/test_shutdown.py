"""A client that vanishes mid-stream costs nothing after a tick or two, and SIGTERM with streams
in flight ends every stream (full output, a shutdown error, or a closed stream; never a hang)
within the exit timeout + 10 s, leaving no stub process behind. Its own server: it is killed."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from reliabilitykit import clients, scrape, stub_pids, wait_for, wait_gone, write_model

from exspec.serving.launcher import TritonServer

EXIT_TIMEOUT_S = 5
ENGINE = {"method": "exspec", "num_speculative_tokens": 4, "max_batch_size": 4, "max_num_seqs": 16,
          "max_output_tokens": 900, "fault_injection": {"tick_delay_s": 0.03}}   # slow, steady ticks

CLIENT = textwrap.dedent("""
    import sys, json, http.client, numpy as np, tritonclient.grpc as g
    protocol, url = sys.argv[1], sys.argv[2]
    if protocol == "grpc":
        c = g.InferenceServerClient(url)
        def cb(result, error):
            print("got", flush=True)
        c.start_stream(callback=cb)
        t = g.InferInput("text_input", [1], "BYTES"); t.set_data_from_numpy(np.array([b"hello"], dtype=object))
        s = g.InferInput("sampling_parameters", [1], "BYTES")
        s.set_data_from_numpy(np.array([json.dumps({"max_tokens": 800, "ignore_eos": True}).encode()], dtype=object))
        f = g.InferInput("stream", [1], "BOOL"); f.set_data_from_numpy(np.array([True]))
        c.async_stream_infer("long", [t, s, f])
    else:
        host, port = url.replace("http://", "").split(":")
        conn = http.client.HTTPConnection(host, int(port))
        conn.request("POST", "/v2/models/long/generate_stream", body=json.dumps(
            {"text_input": "hello", "max_tokens": 800, "ignore_eos": True, "stream": True}))
        r = conn.getresponse(); r.fp.readline(); print("got", flush=True)
    import time; time.sleep(600)
""")


@pytest.fixture(scope="module")
def own_server(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("exspec-rel-term")
    repo = root / "models"
    write_model(repo, "long", pair, ENGINE)
    server = TritonServer(repo, free_ports=True, startup_timeout_s=300, log_path=root / "log",
                          extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}"])
    with server:
        yield server


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_vanished_client_frees_its_sequence(own_server, protocol):
    url = own_server.urls["grpc"] if protocol == "grpc" else own_server.urls["http"]
    before = scrape(own_server, "exspec:requests_total", outcome="cancelled")
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, protocol, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "got", "the client got no first response"
        wait_for(lambda: scrape(own_server, "exspec:num_requests_running") == 1, timeout_s=10,
                 what="the stream to be running")
    finally:
        proc.kill()   # SIGKILL: no goodbye, the socket just closes
        proc.wait()
    gone = time.monotonic()
    wait_for(lambda: scrape(own_server, "exspec:num_requests_running") == 0, timeout_s=10,
             what="exspec:num_requests_running to return to 0 after the client vanished")
    took = time.monotonic() - gone
    assert scrape(own_server, "exspec:requests_total", outcome="cancelled") == before + 1
    print(f"\n{protocol}: the pool was empty {took:.2f} s after the client vanished")


def test_sigterm_with_streams_in_flight_ends_every_stream_and_leaves_no_stub(own_server):
    ended: dict = {}
    started = threading.Barrier(7)

    def grpc_stream(i):
        started.wait()
        try:
            call = clients.grpc_stream(own_server.urls["grpc"], "long", [{
                "prompt": f"hello {i}", "stream": True,
                "sampling": {"max_tokens": 800, "ignore_eos": True}}], timeout_s=EXIT_TIMEOUT_S + 20)[0]
            last = call.responses[-1] if call.responses else None
            ended[f"grpc{i}"] = (time.monotonic(), "error: " + last.error if last and last.error
                                 else f"full ({len(call.ids())} tokens)")
        except Exception as exc:   # the stream was closed under it (or a timeout: a hang)
            ended[f"grpc{i}"] = (time.monotonic(), f"{type(exc).__name__}: {exc}"[:200])

    def http_stream(i):
        started.wait()
        try:
            status, events = clients.generate_stream(own_server.urls["http"], "long", {
                "text_input": f"hello {i}", "max_tokens": 800, "ignore_eos": True, "stream": True})
            ended[f"http{i}"] = (time.monotonic(), f"HTTP {status}, {len(events)} events")
        except Exception as exc:
            ended[f"http{i}"] = (time.monotonic(), f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=grpc_stream, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=http_stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    wait_for(lambda: scrape(own_server, "exspec:num_requests_running") >= 4, timeout_s=30,
             what="the streams to be running")
    marker = str(own_server.model_repository)
    assert stub_pids(marker), "no stub process found for this server"
    term = time.monotonic()
    own_server.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=EXIT_TIMEOUT_S + 10 + 5)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, f"{len(hung)} client streams still open {EXIT_TIMEOUT_S + 15} s after SIGTERM"
    late = {k: round(at - term, 1) for k, (at, _) in ended.items() if at - term > EXIT_TIMEOUT_S + 10}
    assert not late, f"streams ended later than the exit timeout + 10 s: {late}"
    own_server.process.wait(timeout=60)
    exited = time.monotonic()
    # The stub may outlive tritonserver only briefly: its orphan guard polls every 0.5 s.
    left = wait_gone(lambda: stub_pids(marker), timeout_s=10)
    assert not left, f"stub processes {left} still running 10 s after tritonserver exited"
    print(f"\ntritonserver exited {exited - term:.1f} s after SIGTERM; its stub "
          f"{time.monotonic() - exited:.1f} s later")
    print("\nafter SIGTERM: " + "; ".join(f"{k} at {at - term:.1f} s: {how}"
                                         for k, (at, how) in sorted(ended.items())))
