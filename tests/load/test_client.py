"""exspec_client against the real server: streaming, errors, cancellation, timeouts, unary."""
from __future__ import annotations

import asyncio

import pytest

from exspec_client import AsyncClient, Client, ExspecError, ExspecTimeout
from loadkit import SLOW_MODEL

PROMPT = "def add(a, b):\n"
PROTOCOLS = ("grpc", "http")


def client(server, protocol, model: str = "exspec") -> Client:
    return Client(server.urls[protocol], protocol=protocol, model=model, timeout_s=60)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stream_deltas_join_to_the_unary_answer(load_server, protocol):
    c = client(load_server, protocol)
    with c.stream(PROMPT, max_tokens=12) as generation:
        deltas = list(generation)
    streamed = generation.result
    unary = c.infer(PROMPT, max_tokens=12)
    assert len(deltas) > 1, f"{protocol}: one response only; streaming did not stream"
    assert streamed.token_ids == unary.token_ids, (
        f"{protocol}: streamed ids {streamed.token_ids} != unary {unary.token_ids}")
    assert streamed.text == unary.text
    assert streamed.finish_reason == "length" and streamed.num_output_tokens == 12
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s <= streamed.latency_s
    assert deltas[-1].draft_tokens is not None and deltas[-1].accepted_draft_tokens is not None, (
        f"{protocol}: the speculation statistics did not come back")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_more_than_one_sample_is_refused_before_anything_is_sent(protocol):
    """A Result holds one sample; n > 1 would come back as n texts joined into one. No server:
    the refusal comes before any connection."""
    c = Client("127.0.0.1:1" if protocol == "grpc" else "http://127.0.0.1:1", protocol=protocol)
    with pytest.raises(ValueError, match="one sample per generation; got n=2"):
        c.stream(PROMPT, max_tokens=4, n=2)
    with pytest.raises(ValueError, match="best_of=3"):
        AsyncClient("127.0.0.1:1").stream(PROMPT, best_of=3)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_error_carries_the_servers_message(load_server, protocol):
    with pytest.raises(ExspecError, match="max_tokens must be an integer >= 1"):
        client(load_server, protocol).generate(PROMPT, max_tokens=0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_leaving_the_loop_cancels_on_the_server(load_server, metrics, protocol):
    before = metrics.outcomes()["cancelled"]
    with client(load_server, protocol, SLOW_MODEL).stream(PROMPT, max_tokens=400,
                                                          ignore_eos=True) as gen:
        for _ in gen:
            break
    metrics.wait_outcome("cancelled", before + 1)
    metrics.wait_pool_empty()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_timeout_raises_and_cancels(load_server, metrics, protocol):
    before = metrics.outcomes()["cancelled"]
    with pytest.raises(ExspecTimeout):
        client(load_server, protocol, SLOW_MODEL).generate(PROMPT, max_tokens=400,
                                                           ignore_eos=True, timeout_s=0.5)
    metrics.wait_outcome("cancelled", before + 1)
    metrics.wait_pool_empty()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_client_matches_the_sync_client(load_server, protocol):
    expected = client(load_server, protocol).generate(PROMPT, max_tokens=10).token_ids

    async def run():
        async with AsyncClient(load_server.urls[protocol], protocol=protocol, model="exspec",
                               timeout_s=60) as c:
            results = await asyncio.gather(*(c.generate(PROMPT, max_tokens=10) for _ in range(3)))
            with pytest.raises(ExspecError, match="max_tokens"):
                await c.generate(PROMPT, max_tokens=0)
            return results

    for result in asyncio.run(run()):
        assert result.token_ids == expected, f"{protocol}: {result.token_ids} != {expected}"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_cli_says_when_no_server_answers_instead_of_a_traceback(protocol, capsys):
    import socket

    from exspec_client.cli import main
    with socket.socket() as s:   # a loopback port nothing listens on (bound, never listened)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        rc = main(["hi", "--url", f"127.0.0.1:{port}", "--protocol", protocol, "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "cannot reach a server" in err or "failed to connect" in err, err
